// collective-perf: collectived's benchmark, compatible with nccl-tests.
//
// Starts N ranks as local processes (-t N), each a client of a daemon (round
// robin over --daemons), and prints nccl-tests' table: size, count, type,
// redop, root, then time, algbw, busbw and #wrong for out-of-place and
// in-place. Exits non-zero when any #wrong is non-zero or an operation fails.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "client/collective.h"
#include "engine/gpu/cuda_driver.h"
#include "ipc/half.h"

namespace {

using Clock = std::chrono::steady_clock;

/// One rank's node name in the header's exchange (collective_status_t's field).
constexpr std::size_t kNodeNameBytes = sizeof(collective_status_t::node_name);

enum class Op { all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all };
constexpr Op kAllOps[] = {Op::all_reduce, Op::all_gather, Op::reduce_scatter,
                          Op::broadcast,  Op::reduce,     Op::all_to_all};

const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce: return "all-reduce";
    case Op::all_gather: return "all-gather";
    case Op::reduce_scatter: return "reduce-scatter";
    case Op::broadcast: return "broadcast";
    case Op::reduce: return "reduce";
    case Op::all_to_all: return "all-to-all";
  }
  return "?";
}

bool reducing(Op op) { return op == Op::all_reduce || op == Op::reduce || op == Op::reduce_scatter; }
bool rooted(Op op) { return op == Op::broadcast || op == Op::reduce; }
// nccl-tests: the size column is the whole array for these, per rank otherwise.
bool sharded(Op op) {
  return op == Op::all_gather || op == Op::reduce_scatter || op == Op::all_to_all;
}

/// busbw factor from nccl-tests' doc/PERFORMANCE.md.
double bus_factor(Op op, int n) {
  switch (op) {
    case Op::all_reduce: return 2.0 * (n - 1) / n;
    case Op::all_gather:
    case Op::reduce_scatter:
    case Op::all_to_all: return static_cast<double>(n - 1) / n;
    default: return 1.0;
  }
}

struct Options {
  std::size_t min_bytes = 32 << 20, max_bytes = 32 << 20, step_bytes = 1 << 20;
  double factor = 0;  // 0: use step_bytes
  int iters = 20, warmup = 5, check = 1, blocking = 0, nranks = 1;
  std::vector<collective_dtype_t> dtypes{COLLECTIVE_FLOAT32};
  std::vector<collective_redop_t> redops{COLLECTIVE_SUM};
  int root = 0;  // -1: all
  std::vector<Op> ops{Op::all_reduce};
  std::vector<std::string> daemons;
  bool gpu = false;  // -g: GPU buffers, stream-ordered calls
  int gpus = 0;      // --gpus N: rank r uses GPU r % N (0: every visible GPU)
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "collective-perf: %s\n"
               "usage: collective-perf [-t ranks] [-b minbytes] [-e maxbytes] [-f factor | -i step]\n"
               "                       [-n iters] [-w warmup] [-c check(0/1)] [-d dtype|all]\n"
               "                       [-o sum|prod|min|max|avg|all] [-r root|all] [-z 0/1]\n"
               "                       [--op all-reduce|all-gather|reduce-scatter|broadcast|reduce|\n"
               "                             all-to-all|all] (repeatable) [--daemons SOCK1,SOCK2,...]\n"
               "                       [-g] [--gpus N]\n"
               "-g: GPU buffers (rank r on GPU r %% N), stream-ordered calls, timed with CUDA events.\n"
               "sizes take K, M, G suffixes (powers of 1024). Ranks are local processes,\n"
               "assigned to the daemons round robin ($COLLECTIVED_SOCKET or the default).\n",
               why);
  std::exit(2);
}

std::size_t parse_size(const char* s) {
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  if (end == s || v < 0) usage("bad size");
  std::size_t mul = 1;
  switch (*end) {
    case 'k': case 'K': mul = 1 << 10; break;
    case 'm': case 'M': mul = 1 << 20; break;
    case 'g': case 'G': mul = std::size_t{1} << 30; break;
    case '\0': break;
    default: usage("bad size suffix");
  }
  return static_cast<std::size_t>(v * static_cast<double>(mul));
}

collective_dtype_t parse_dtype(const std::string& s) {
  static const std::pair<const char*, collective_dtype_t> names[] = {
      {"int8", COLLECTIVE_INT8},       {"uint8", COLLECTIVE_UINT8},
      {"int32", COLLECTIVE_INT32},     {"int", COLLECTIVE_INT32},
      {"uint32", COLLECTIVE_UINT32},   {"int64", COLLECTIVE_INT64},
      {"uint64", COLLECTIVE_UINT64},   {"half", COLLECTIVE_FLOAT16},
      {"float16", COLLECTIVE_FLOAT16}, {"bfloat16", COLLECTIVE_BFLOAT16},
      {"bf16", COLLECTIVE_BFLOAT16},   {"float", COLLECTIVE_FLOAT32},
      {"float32", COLLECTIVE_FLOAT32}, {"double", COLLECTIVE_FLOAT64},
      {"float64", COLLECTIVE_FLOAT64}};
  for (auto& [n, d] : names) {
    if (s == n) return d;
  }
  usage(("unknown dtype " + s).c_str());
}

Options parse(int argc, char** argv) {
  Options o;
  bool ops_given = false;  // the first --op replaces the default list, later ones add
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> const char* {
      if (i + 1 >= argc) usage((a + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "-t") {
      o.nranks = std::atoi(val());
    } else if (a == "-b") {
      o.min_bytes = parse_size(val());
    } else if (a == "-e") {
      o.max_bytes = parse_size(val());
    } else if (a == "-f") {
      o.factor = std::atof(val());
    } else if (a == "-i") {
      o.step_bytes = parse_size(val());
      o.factor = 0;
    } else if (a == "-n") {
      o.iters = std::atoi(val());
    } else if (a == "-w") {
      o.warmup = std::atoi(val());
    } else if (a == "-c") {
      o.check = std::atoi(val());
    } else if (a == "-z") {
      o.blocking = std::atoi(val());
    } else if (a == "-d") {
      std::string v = val();
      o.dtypes.clear();
      if (v == "all") {
        for (int d = COLLECTIVE_INT8; d <= COLLECTIVE_FLOAT64; ++d) {
          o.dtypes.push_back(static_cast<collective_dtype_t>(d));
        }
      } else {
        o.dtypes.push_back(parse_dtype(v));
      }
    } else if (a == "-o") {
      std::string v = val();
      o.redops.clear();
      const char* names[] = {"sum", "prod", "min", "max", "avg"};
      for (int r = 0; r < 5; ++r) {
        if (v == "all" || v == names[r]) o.redops.push_back(static_cast<collective_redop_t>(r));
      }
      if (o.redops.empty()) usage(("unknown reduction " + v).c_str());
    } else if (a == "-r") {
      std::string v = val();
      o.root = v == "all" ? -1 : std::atoi(v.c_str());
    } else if (a == "--op") {
      std::string v = val();
      if (!ops_given) o.ops.clear();
      ops_given = true;
      bool known = false;
      for (Op op : kAllOps) {
        if (v != "all" && v != op_name(op)) continue;
        known = true;
        if (std::find(o.ops.begin(), o.ops.end(), op) == o.ops.end()) o.ops.push_back(op);
      }
      if (!known) usage(("unknown operation " + v).c_str());
    } else if (a == "--daemons") {
      std::string v = val();
      for (std::size_t at = 0; at <= v.size();) {
        const std::size_t comma = std::min(v.find(',', at), v.size());
        if (comma > at) o.daemons.push_back(v.substr(at, comma - at));
        at = comma + 1;
      }
    } else if (a == "-g") {
      o.gpu = true;
    } else if (a == "--gpus") {
      o.gpus = std::atoi(val());
    } else if (a == "-h" || a == "--help") {
      usage("help");
    } else {
      usage(("unknown argument " + a).c_str());
    }
  }
  if (o.nranks < 1) usage("-t must be at least 1");
  if (o.min_bytes > o.max_bytes) usage("-b is larger than -e");
  if (o.iters < 1) usage("-n must be at least 1");
  if (o.root >= o.nranks) usage("-r is not a rank");
  if (o.daemons.empty()) o.daemons.push_back("");  // $COLLECTIVED_SOCKET or the default
  return o;
}

// --- data -----------------------------------------------------------------------

bool is_signed(collective_dtype_t d) {
  return d == COLLECTIVE_INT8 || d == COLLECTIVE_INT32 || d == COLLECTIVE_INT64 ||
         d == COLLECTIVE_FLOAT16 || d == COLLECTIVE_BFLOAT16 || d == COLLECTIVE_FLOAT32 ||
         d == COLLECTIVE_FLOAT64;
}
bool is_float(collective_dtype_t d) { return d >= COLLECTIVE_FLOAT16; }

/// Test values: small integers, so that every type holds them and their sums
/// exactly; {1,2} for products.
double value(collective_dtype_t d, collective_redop_t op, int rank, std::size_t i) {
  if (op == COLLECTIVE_PROD) return 1.0 + static_cast<double>((rank + i) % 2);
  const long v = static_cast<long>((rank * 7 + i * 3) % 9);
  return is_signed(d) ? static_cast<double>(v - 4) : static_cast<double>(v);
}

void store(collective_dtype_t d, void* base, std::size_t i, double v) {
  using namespace collectived;
  switch (d) {
    case COLLECTIVE_INT8: static_cast<std::int8_t*>(base)[i] = static_cast<std::int8_t>(v); break;
    case COLLECTIVE_UINT8: static_cast<std::uint8_t*>(base)[i] = static_cast<std::uint8_t>(v); break;
    case COLLECTIVE_INT32: static_cast<std::int32_t*>(base)[i] = static_cast<std::int32_t>(v); break;
    case COLLECTIVE_UINT32: static_cast<std::uint32_t*>(base)[i] = static_cast<std::uint32_t>(v); break;
    case COLLECTIVE_INT64: static_cast<std::int64_t*>(base)[i] = static_cast<std::int64_t>(v); break;
    case COLLECTIVE_UINT64: static_cast<std::uint64_t*>(base)[i] = static_cast<std::uint64_t>(v); break;
    case COLLECTIVE_FLOAT16: static_cast<std::uint16_t*>(base)[i] = f32_to_f16(static_cast<float>(v)); break;
    case COLLECTIVE_BFLOAT16: static_cast<std::uint16_t*>(base)[i] = f32_to_bf16(static_cast<float>(v)); break;
    case COLLECTIVE_FLOAT32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case COLLECTIVE_FLOAT64: static_cast<double*>(base)[i] = v; break;
  }
}

double load(collective_dtype_t d, const void* base, std::size_t i) {
  using namespace collectived;
  switch (d) {
    case COLLECTIVE_INT8: return static_cast<const std::int8_t*>(base)[i];
    case COLLECTIVE_UINT8: return static_cast<const std::uint8_t*>(base)[i];
    case COLLECTIVE_INT32: return static_cast<const std::int32_t*>(base)[i];
    case COLLECTIVE_UINT32: return static_cast<const std::uint32_t*>(base)[i];
    case COLLECTIVE_INT64: return static_cast<double>(static_cast<const std::int64_t*>(base)[i]);
    case COLLECTIVE_UINT64: return static_cast<double>(static_cast<const std::uint64_t*>(base)[i]);
    case COLLECTIVE_FLOAT16: return f16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
    case COLLECTIVE_BFLOAT16: return bf16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
    case COLLECTIVE_FLOAT32: return static_cast<const float*>(base)[i];
    case COLLECTIVE_FLOAT64: return static_cast<const double*>(base)[i];
  }
  return 0;
}

/// Expected reduction of element `i` over all ranks (small integers: exact).
double expected_reduce(collective_dtype_t d, collective_redop_t op, int n, std::size_t i) {
  double acc = value(d, op, 0, i);
  for (int r = 1; r < n; ++r) {
    const double v = value(d, op, r, i);
    switch (op) {
      case COLLECTIVE_SUM:
      case COLLECTIVE_AVG: acc += v; break;
      case COLLECTIVE_PROD: acc *= v; break;
      case COLLECTIVE_MIN: acc = std::min(acc, v); break;
      case COLLECTIVE_MAX: acc = std::max(acc, v); break;
    }
  }
  if (op == COLLECTIVE_PROD && !is_float(d)) {
    // Integer products wrap: reproduce that by storing into the type.
    std::uint64_t buf = 0;
    store(d, &buf, 0, acc);
    acc = load(d, &buf, 0);
  }
  if (op == COLLECTIVE_AVG) acc = is_float(d) ? acc / n : std::trunc(acc / n);
  return acc;
}

bool close_enough(collective_dtype_t d, double got, double want) {
  if (!is_float(d)) return got == want;
  const double tol = d == COLLECTIVE_FLOAT16 ? 1e-3 : d == COLLECTIVE_BFLOAT16 ? 1e-2 : 1e-6;
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

// --- one rank -------------------------------------------------------------------

namespace cu = collectived::engine::gpu::cu;

/// -g: this rank's GPU, stream and device buffers (driver API, loaded at run time).
struct GpuSide {
  std::unique_ptr<collectived::engine::gpu::CudaDriver> cu;
  int device = 0;
  int ngpus = 1;
  cu::Context ctx = nullptr;
  cu::Stream stream = nullptr;
  cu::Event start = nullptr, stop = nullptr;
  cu::DevicePtr send = 0, recv = 0;
};

struct Rank {
  Options o;
  GpuSide g;
  char* hsend = nullptr;  // -g: host images of the device buffers
  char* hrecv = nullptr;
  int rank = 0;
  collective_client_t* client = nullptr;
  collective_comm_t* comm = nullptr;
  char* sendbuf = nullptr;
  char* recvbuf = nullptr;
  std::size_t buf_bytes = 0;
  long wrong_total = 0;
  double bw_sum = 0;
  int bw_count = 0;
  bool failed = false;

  void die(const char* what) {
    std::fprintf(stderr, "collective-perf: rank %d: %s: %s\n", rank, what, collective_last_error());
    std::fflush(stderr);
    std::_Exit(3);
  }

  void wait_one(collective_request_t* r, const char* what) {
    if (collective_wait(r, -1) != COLLECTIVE_OK) {
      collective_request_free(r);
      die(what);
    }
    collective_request_free(r);
  }

  /// Submits one operation; returns its request.
  collective_request_t* submit(Op op, collective_dtype_t d, collective_redop_t redop, int root,
                               std::size_t count, const void* send, void* recv) {
    collective_request_t* r = nullptr;
    collective_result_t rc = COLLECTIVE_OK;
    if (o.gpu) {
      void* s = g.stream;
      switch (op) {
        case Op::all_reduce:
          rc = collective_all_reduce_stream(comm, send, recv, count, d, redop, s, &r);
          break;
        case Op::all_gather: rc = collective_all_gather_stream(comm, send, recv, count, d, s, &r); break;
        case Op::reduce_scatter:
          rc = collective_reduce_scatter_stream(comm, send, recv, count, d, redop, s, &r);
          break;
        case Op::broadcast:
          rc = collective_broadcast_stream(comm, send, recv, count, d, root, s, &r);
          break;
        case Op::reduce:
          rc = collective_reduce_stream(comm, send, recv, count, d, redop, root, s, &r);
          break;
        case Op::all_to_all: rc = collective_all_to_all_stream(comm, send, recv, count, d, s, &r); break;
      }
      if (rc != COLLECTIVE_OK) die(op_name(op));
      return r;
    }
    switch (op) {
      case Op::all_reduce: rc = collective_all_reduce(comm, send, recv, count, d, redop, &r); break;
      case Op::all_gather: rc = collective_all_gather(comm, send, recv, count, d, &r); break;
      case Op::reduce_scatter:
        rc = collective_reduce_scatter(comm, send, recv, count, d, redop, &r);
        break;
      case Op::broadcast: rc = collective_broadcast(comm, send, recv, count, d, root, &r); break;
      case Op::reduce: rc = collective_reduce(comm, send, recv, count, d, redop, root, &r); break;
      case Op::all_to_all: rc = collective_all_to_all(comm, send, recv, count, d, &r); break;
    }
    if (rc != COLLECTIVE_OK) die(op_name(op));
    return r;
  }

  /// Send and receive pointers for `count` elements per rank.
  std::pair<const void*, void*> buffers(Op op, bool in_place, std::size_t count, std::size_t es,
                                        bool host = false) {
    char* sb = sendbuf;
    char* rb = recvbuf;
    if (o.gpu) {
      sb = host ? hsend : reinterpret_cast<char*>(g.send);
      rb = host ? hrecv : reinterpret_cast<char*>(g.recv);
    }
    if (!in_place) return {sb, rb};
    switch (op) {
      case Op::all_gather: return {rb + rank * count * es, rb};
      case Op::reduce_scatter: return {rb, rb + rank * count * es};
      default: return {rb, rb};
    }
  }

  void cuda(cu::Result r, const char* what) {
    if (r == cu::kSuccess) return;
    std::fprintf(stderr, "collective-perf: rank %d: %s: %s\n", rank, what,
                 g.cu->error_text(r).c_str());
    std::fflush(stderr);
    std::_Exit(3);
  }

  void gpu_setup() {
    try {
      g.cu = collectived::engine::gpu::CudaDriver::load();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "collective-perf: rank %d: -g: %s\n", rank, e.what());
      std::_Exit(3);
    }
    int count = 0;
    cuda(g.cu->cuDeviceGetCount(&count), "cuDeviceGetCount");
    const int use = o.gpus > 0 ? std::min(o.gpus, count) : count;
    g.ngpus = use > 0 ? use : 1;
    g.device = rank % g.ngpus;
    cu::Device dev = 0;
    cuda(g.cu->cuDeviceGet(&dev, g.device), "cuDeviceGet");
    cuda(g.cu->cuDevicePrimaryCtxRetain(&g.ctx, dev), "cuDevicePrimaryCtxRetain");
    cuda(g.cu->cuCtxSetCurrent(g.ctx), "cuCtxSetCurrent");
    cuda(g.cu->cuStreamCreate(&g.stream, 1 /* non-blocking */), "cuStreamCreate");
    cuda(g.cu->cuEventCreate(&g.start, 0), "cuEventCreate");
    cuda(g.cu->cuEventCreate(&g.stop, 0), "cuEventCreate");
    cuda(g.cu->cuMemAlloc(&g.send, buf_bytes), "cuMemAlloc");
    cuda(g.cu->cuMemAlloc(&g.recv, buf_bytes), "cuMemAlloc");
    cuda(g.cu->cuMemsetD8(g.send, 0, buf_bytes), "cuMemsetD8");
    cuda(g.cu->cuMemsetD8(g.recv, 0, buf_bytes), "cuMemsetD8");
    hsend = static_cast<char*>(std::calloc(buf_bytes, 1));
    hrecv = static_cast<char*>(std::calloc(buf_bytes, 1));
    if (hsend == nullptr || hrecv == nullptr) die("out of host memory");
  }

  /// Fills, runs once, checks; returns this rank's wrong elements.
  long check(Op op, collective_dtype_t d, collective_redop_t redop, int root, std::size_t count,
             bool in_place) {
    const std::size_t es = collective_dtype_size(d);
    const int n = o.nranks;
    auto [send, recv] = buffers(op, in_place, count, es, /*host=*/true);
    const std::size_t send_elems =
        (op == Op::reduce_scatter || op == Op::all_to_all) ? count * n : count;
    std::memset(o.gpu ? hrecv : recvbuf, 0x5a, buf_bytes);  // stale results must not pass as right
    for (std::size_t i = 0; i < send_elems; ++i) {
      store(d, const_cast<void*>(send), i, value(d, redop, rank, i));
    }
    if (o.gpu) {
      cuda(g.cu->cuMemcpyHtoD(g.send, hsend, buf_bytes), "cuMemcpyHtoD");
      cuda(g.cu->cuMemcpyHtoD(g.recv, hrecv, buf_bytes), "cuMemcpyHtoD");
      // Copies from pageable memory return before their DMA lands, and the
      // operation's stream (non-blocking) would not wait for it: the daemon
      // could read the old contents (seen with two processes sharing a GPU).
      cuda(g.cu->cuStreamSynchronize(nullptr), "cuStreamSynchronize (the uploads)");
      auto [dsend, drecv] = buffers(op, in_place, count, es);
      wait_one(submit(op, d, redop, root, count, dsend, drecv), "check run");
      cuda(g.cu->cuStreamSynchronize(g.stream), "cuStreamSynchronize");
      cuda(g.cu->cuMemcpyDtoH(hrecv, g.recv, buf_bytes), "cuMemcpyDtoH");
    } else {
      wait_one(submit(op, d, redop, root, count, send, recv), "check run");
    }
    long wrong = 0;
    auto expect = [&](std::size_t at, double want) {
      if (!close_enough(d, load(d, recv, at), want)) ++wrong;
    };
    switch (op) {
      case Op::all_reduce:
        for (std::size_t i = 0; i < count; ++i) expect(i, expected_reduce(d, redop, n, i));
        break;
      case Op::reduce:
        if (rank == root) {
          for (std::size_t i = 0; i < count; ++i) expect(i, expected_reduce(d, redop, n, i));
        }
        break;
      case Op::broadcast:
        for (std::size_t i = 0; i < count; ++i) expect(i, value(d, redop, root, i));
        break;
      case Op::all_gather:
        for (int k = 0; k < n; ++k)
          for (std::size_t i = 0; i < count; ++i) expect(k * count + i, value(d, redop, k, i));
        break;
      case Op::reduce_scatter:
        for (std::size_t i = 0; i < count; ++i) {
          expect(i, expected_reduce(d, redop, n, rank * count + i));
        }
        break;
      case Op::all_to_all:
        for (int k = 0; k < n; ++k)
          for (std::size_t i = 0; i < count; ++i) {
            expect(k * count + i, value(d, redop, k, rank * count + i));
          }
        break;
    }
    return wrong;
  }

  /// Average microseconds per operation over o.iters, as this rank saw it.
  double time(Op op, collective_dtype_t d, collective_redop_t redop, int root, std::size_t count,
              bool in_place) {
    const std::size_t es = collective_dtype_size(d);
    auto [send, recv] = buffers(op, in_place, count, es);
    std::vector<collective_request_t*> reqs;
    auto run = [&](int iters) {
      for (int i = 0; i < iters; ++i) {
        auto* r = submit(op, d, redop, root, count, send, recv);
        if (o.blocking) {
          wait_one(r, "timed run");
        } else {
          reqs.push_back(r);
        }
      }
      // The last first, like nccl-tests' one synchronize of the stream for
      // the whole batch: one communicator's operations complete in order, so
      // the others are done by then, and the client sleeps through their
      // completions instead of waking for each (ipc/ring.h wake_id).
      for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) wait_one(*it, "timed run");
      reqs.clear();
    };
    run(o.warmup);
    if (o.gpu) {
      // nccl-tests' way: the time the GPU stream took for the iterations.
      cuda(g.cu->cuStreamSynchronize(g.stream), "cuStreamSynchronize");
      barrier();
      cuda(g.cu->cuEventRecord(g.start, g.stream), "cuEventRecord");
      for (int i = 0; i < o.iters; ++i) reqs.push_back(submit(op, d, redop, root, count, send, recv));
      cuda(g.cu->cuEventRecord(g.stop, g.stream), "cuEventRecord");
      cuda(g.cu->cuEventSynchronize(g.stop), "cuEventSynchronize");
      for (auto* r : reqs) wait_one(r, "timed run");
      reqs.clear();
      float ms = 0;
      cuda(g.cu->cuEventElapsedTime(&ms, g.start, g.stop), "cuEventElapsedTime");
      return 1000.0 * ms / o.iters;
    }
    barrier();
    const auto t0 = Clock::now();
    run(o.iters);
    const auto t1 = Clock::now();
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / o.iters;
  }

  void barrier() {
    collective_request_t* r = nullptr;
    if (collective_barrier(comm, &r) != COLLECTIVE_OK) die("barrier");
    wait_one(r, "barrier");
  }

  /// max over ranks (time) or sum (wrong counts), through the daemon itself.
  double all_reduce_scalar(double v, collective_redop_t op) {
    auto* p = reinterpret_cast<double*>(sendbuf);
    auto* q = reinterpret_cast<double*>(recvbuf);
    p[0] = v;
    collective_request_t* r = nullptr;
    if (collective_all_reduce(comm, p, q, 1, COLLECTIVE_FLOAT64, op, &r) != COLLECTIVE_OK) {
      die("result exchange");
    }
    wait_one(r, "result exchange");
    return q[0];
  }

  /// Every rank's node name (`mine` from each rank), through the daemon.
  std::vector<std::string> node_names(const char* mine) {
    std::memset(sendbuf, 0, kNodeNameBytes);
    std::memcpy(sendbuf, mine, strnlen(mine, kNodeNameBytes - 1));
    collective_request_t* r = nullptr;
    if (collective_all_gather(comm, sendbuf, recvbuf, kNodeNameBytes, COLLECTIVE_UINT8, &r) !=
        COLLECTIVE_OK) {
      die("node name exchange");
    }
    wait_one(r, "node name exchange");
    std::vector<std::string> names;
    for (int i = 0; i < o.nranks; ++i) {
      const char* p = recvbuf + static_cast<std::size_t>(i) * kNodeNameBytes;
      names.emplace_back(p, strnlen(p, kNodeNameBytes - 1));
    }
    return names;
  }

  void print_header() {
    std::printf("#%62s%-34s%s\n", "", "out-of-place", "in-place");
    std::printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size",
                "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
                "algbw", "busbw", "#wrong");
    std::printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)",
                "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
                "(GB/s)", "");
  }

  void run_case(Op op, collective_dtype_t d, collective_redop_t redop, int root) {
    const std::size_t es = collective_dtype_size(d);
    const int n = o.nranks;
    if (rank == 0) {
      std::printf("#\n# %s, %s%s%s\n", op_name(op), collective_dtype_name(d),
                  reducing(op) ? ", " : "", reducing(op) ? collective_redop_name(redop) : "");
      print_header();
    }
    for (std::size_t size = o.min_bytes; size <= o.max_bytes;) {
      // Count per rank; sizes round down to whole elements (per rank for sharded ops).
      const std::size_t unit = sharded(op) ? es * n : es;
      const std::size_t count = sharded(op) ? size / unit : size / es;
      const std::size_t bytes = sharded(op) ? count * es * n : count * es;
      const std::size_t elements = sharded(op) ? count * n : count;
      double t[2];
      long wrong[2];
      for (int ip = 0; ip < 2; ++ip) {
        if (o.gpu && op == Op::all_to_all && ip == 1) {
          t[ip] = 0;  // in-place all-to-all is refused on GPU buffers
          wrong[ip] = 0;
          continue;
        }
        long w = o.check ? check(op, d, redop, root, count, ip == 1) : 0;
        wrong[ip] = static_cast<long>(all_reduce_scalar(static_cast<double>(w), COLLECTIVE_SUM));
        t[ip] = all_reduce_scalar(time(op, d, redop, root, count, ip == 1), COLLECTIVE_MAX);
      }
      if (rank == 0) {
        std::printf("%12zu  %12zu  %8s  %6s  %6d", bytes, elements, collective_dtype_name(d),
                    reducing(op) ? collective_redop_name(redop) : "none", rooted(op) ? root : -1);
        for (int ip = 0; ip < 2; ++ip) {
          const double algbw = t[ip] > 0 ? static_cast<double>(bytes) / 1e3 / t[ip] : 0;
          const double busbw = algbw * bus_factor(op, n);
          char ts[32];
          if (t[ip] >= 10000.0) {
            std::snprintf(ts, sizeof ts, "%7.0f", t[ip]);
          } else if (t[ip] >= 100.0) {
            std::snprintf(ts, sizeof ts, "%7.1f", t[ip]);
          } else {
            std::snprintf(ts, sizeof ts, "%7.2f", t[ip]);
          }
          char ws[32];
          if (o.check) {
            std::snprintf(ws, sizeof ws, "%6ld", wrong[ip]);
          } else {
            std::snprintf(ws, sizeof ws, "%6s", "N/A");
          }
          std::printf("  %7s  %6.2f  %6.2f  %s", ts, algbw, busbw, ws);
          if (ip == 0) {
            bw_sum += busbw;
            ++bw_count;
          }
          wrong_total += wrong[ip];
        }
        std::printf("\n");
        std::fflush(stdout);
      }
      if (o.factor > 1) {
        const auto next = static_cast<std::size_t>(static_cast<double>(size) * o.factor);
        if (next <= size) break;
        size = next;
      } else {
        if (o.step_bytes == 0) break;
        size += o.step_bytes;
      }
    }
  }

  int main_loop(const collective_unique_id_t& id) {
    const std::string& sock = o.daemons[rank % o.daemons.size()];
    std::string name = "collective-perf rank " + std::to_string(rank);
    if (collective_connect(sock.empty() ? nullptr : sock.c_str(), name.c_str(), &client) !=
        COLLECTIVE_OK) {
      die("connect");
    }
    // The GPU first, as NCCL wants (cudaSetDevice before ncclCommInitRank):
    // a communicator made with the context current loads the library's
    // staging kernels then (gpu_comm_created), not at a first operation.
    buf_bytes = std::max<std::size_t>(o.max_bytes, 64);
    if (o.gpu) gpu_setup();
    if (collective_comm_init_rank(client, &id, o.nranks, rank, &comm) != COLLECTIVE_OK) {
      die("comm_init_rank");
    }
    // -g: the host buffers only carry the results exchange and the node names.
    const std::size_t host_bytes =
        o.gpu ? std::max<std::size_t>(64, kNodeNameBytes * static_cast<std::size_t>(o.nranks))
              : std::max(buf_bytes, kNodeNameBytes * static_cast<std::size_t>(o.nranks));
    void* a = nullptr;
    void* b = nullptr;
    if (collective_host_alloc(client, host_bytes, &a) != COLLECTIVE_OK ||
        collective_host_alloc(client, host_bytes, &b) != COLLECTIVE_OK) {
      die("host_alloc");
    }
    sendbuf = static_cast<char*>(a);
    recvbuf = static_cast<char*>(b);
    std::memset(sendbuf, 0, host_bytes);
    std::memset(recvbuf, 0, host_bytes);
    // Each rank's node is its own daemon's (ranks go to the daemons round
    // robin), so every rank asks its daemon and rank 0 prints them all.
    collective_status_t st{};
    if (collective_status(client, &st) != COLLECTIVE_OK) die("status");
    const std::vector<std::string> nodes = node_names(st.node_name);
    if (rank == 0) {
      std::printf("# collective-perf (collectived %s): nranks %d, minBytes %zu maxBytes %zu "
                  "step: %s warmup iters: %d iters: %d validation: %d blocking: %d\n",
                  st.daemon_version, o.nranks, o.min_bytes, o.max_bytes,
                  o.factor > 1 ? (std::to_string(o.factor) + "(factor)").c_str()
                               : (std::to_string(o.step_bytes) + "(bytes)").c_str(),
                  o.warmup, o.iters, o.check, o.blocking);
      if (o.gpu) {
        collective_gpu_status_t gs{};
        if (collective_gpu_status(client, &gs) == COLLECTIVE_OK) {
          std::printf("# daemon GPUs: %s; MPS: %s\n", gs.reason, gs.mps_reason);
        }
      }
      std::printf("#\n# Using devices\n");
      for (int r = 0; r < o.nranks; ++r) {
        const std::string& s = o.daemons[r % o.daemons.size()];
        if (o.gpu) {
          std::printf("#  Rank %2d Group  0 on node %s daemon %s (GPU %d)\n", r, nodes[r].c_str(),
                      s.empty() ? "default" : s.c_str(), r % g.ngpus);
        } else {
          std::printf("#  Rank %2d Group  0 on node %s daemon %s (host memory)\n", r,
                      nodes[r].c_str(), s.empty() ? "default" : s.c_str());
        }
      }
      std::fflush(stdout);
    }
    for (Op op : o.ops) {
      for (collective_dtype_t d : o.dtypes) {
        const std::vector<collective_redop_t> ops =
            reducing(op) ? o.redops : std::vector<collective_redop_t>{COLLECTIVE_SUM};
        for (collective_redop_t redop : ops) {
          if (rooted(op)) {
            for (int root = 0; root < o.nranks; ++root) {
              if (o.root == -1 || o.root == root) run_case(op, d, redop, root);
            }
          } else {
            run_case(op, d, redop, 0);
          }
        }
      }
    }
    if (rank == 0) {
      if (o.gpu) std::printf("# GPU path: %s\n", collective_comm_gpu_path(comm));
      std::printf("# Out of bounds values : %ld %s\n", wrong_total, wrong_total ? "FAILED" : "OK");
      std::printf("# Avg bus bandwidth    : %g \n", bw_count ? bw_sum / bw_count : 0.0);
      std::printf("#\n# Collective test concluded: collective-perf\n#\n");
      std::fflush(stdout);
    }
    collective_comm_destroy(comm);
    collective_disconnect(client);
    return wrong_total == 0 ? 0 : 1;
  }
};

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  collective_unique_id_t id;
  {
    collective_client_t* c = nullptr;
    const std::string& s = o.daemons[0];
    if (collective_connect(s.empty() ? nullptr : s.c_str(), "collective-perf launcher", &c) !=
            COLLECTIVE_OK ||
        collective_get_unique_id(c, &id) != COLLECTIVE_OK) {
      std::fprintf(stderr, "collective-perf: %s\n", collective_last_error());
      return 3;
    }
    collective_disconnect(c);
  }
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.nranks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("collective-perf: fork");
      return 3;
    }
    if (pid == 0) {
      Rank rank;
      rank.o = o;
      rank.rank = r;
      std::_Exit(rank.main_loop(id));
    }
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    rc = std::max(rc, code);
  }
  if (rc != 0) std::fprintf(stderr, "collective-perf: failed (exit %d)\n", rc);
  return rc;
}
