// nccl-perf: collective-perf's table for any libnccl.so.2. A C loop of NCCL
// calls on GPU buffers, linked to libnccl.so.2 by soname, so that
// LD_LIBRARY_PATH picks NVIDIA's NCCL or collectived's (build/lib/nccl): the
// same sizes measured both ways, and against collective-perf -g, give the
// shim's cost per call. It uses NCCL's API and the CUDA runtime only.
//
// Ranks are forked processes (-t N), rank r on GPU r % --gpus (default: every
// visible GPU); rank 0 makes the unique id and hands it over in shared memory.
// Time per size: CUDA events around `-n` back-to-back calls on the rank's
// stream after `-w` warm-up calls, the maximum over ranks (nccl-tests' way).
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "client/nccl/host_values.h"
#include "client/nccl/nccl.h"

namespace {

enum class Op { all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all };
constexpr Op kAllOps[] = {Op::all_reduce, Op::all_gather, Op::reduce_scatter,
                          Op::broadcast,  Op::reduce,     Op::all_to_all};
const char* op_name(Op op) {
  constexpr const char* names[] = {"all-reduce", "all-gather", "reduce-scatter",
                                   "broadcast",  "reduce",     "all-to-all"};
  return names[static_cast<int>(op)];
}
bool reducing(Op op) {
  return op == Op::all_reduce || op == Op::reduce || op == Op::reduce_scatter;
}
bool sharded(Op op) {
  return op == Op::all_gather || op == Op::reduce_scatter || op == Op::all_to_all;
}
double bus_factor(Op op, int n) {
  if (op == Op::all_reduce) return 2.0 * (n - 1) / n;
  return sharded(op) ? static_cast<double>(n - 1) / n : 1.0;
}

struct Type {
  const char* name;
  ncclDataType_t nccl;
  std::size_t size;
};
constexpr Type kTypes[] = {{"int8", ncclInt8, 1},     {"uint8", ncclUint8, 1},
                           {"int32", ncclInt32, 4},   {"uint32", ncclUint32, 4},
                           {"int64", ncclInt64, 8},   {"uint64", ncclUint64, 8},
                           {"half", ncclFloat16, 2},  {"bfloat16", ncclBfloat16, 2},
                           {"float", ncclFloat32, 4}, {"double", ncclFloat64, 8}};
constexpr const char* kRedops[] = {"sum", "prod", "max", "min", "avg"};

struct Options {
  std::size_t min_bytes = 32 << 20, max_bytes = 32 << 20;
  double factor = 2;
  int iters = 20, warmup = 5, check = 1, nranks = 2, gpus = 0;
  Type type = kTypes[8];
  int redop = 0;
  std::vector<Op> ops{Op::all_reduce};
};

/// Shared by the ranks (mapped before the fork).
struct Shared {
  ncclUniqueId id;
  std::atomic<int> id_ready{0}, arrived{0}, generation{0};
  double times[64];
  long wrong[64];
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(
      stderr,
      "nccl-perf: %s\nusage: nccl-perf [-t ranks] [-b minbytes] [-e maxbytes] [-f factor]\n"
      "                 [-n iters] [-w warmup] [-c 0|1] [-d dtype] [-o sum|prod|max|min|avg]\n"
      "                 [--op "
      "all-reduce|all-gather|reduce-scatter|broadcast|reduce|all-to-all|all]\n"
      "                 [--gpus N]\n",
      why);
  std::exit(2);
}

std::size_t parse_size(const char* s) {
  char* end = nullptr;
  const double v = std::strtod(s, &end);
  const std::size_t mul = *end == 'K' || *end == 'k'   ? 1 << 10
                          : *end == 'M' || *end == 'm' ? 1 << 20
                          : *end == 'G' || *end == 'g' ? std::size_t{1} << 30
                                                       : 1;
  return static_cast<std::size_t>(v * static_cast<double>(mul));
}

Options parse(int argc, char** argv) {
  Options o;
  bool ops_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage((a + " needs a value").c_str());
    const char* v = argv[++i];
    if (a == "-t")
      o.nranks = std::atoi(v);
    else if (a == "-b")
      o.min_bytes = parse_size(v);
    else if (a == "-e")
      o.max_bytes = parse_size(v);
    else if (a == "-f")
      o.factor = std::atof(v);
    else if (a == "-n")
      o.iters = std::atoi(v);
    else if (a == "-w")
      o.warmup = std::atoi(v);
    else if (a == "-c")
      o.check = std::atoi(v);
    else if (a == "--gpus")
      o.gpus = std::atoi(v);
    else if (a == "-d") {
      auto it = std::find_if(std::begin(kTypes), std::end(kTypes),
                             [&](const Type& t) { return std::strcmp(t.name, v) == 0; });
      if (it == std::end(kTypes)) usage("unknown dtype");
      o.type = *it;
    } else if (a == "-o") {
      auto it = std::find_if(std::begin(kRedops), std::end(kRedops),
                             [&](const char* r) { return std::strcmp(r, v) == 0; });
      if (it == std::end(kRedops)) usage("unknown reduction");
      o.redop = static_cast<int>(it - std::begin(kRedops));
    } else if (a == "--op") {
      if (!ops_given) o.ops.clear();
      ops_given = true;
      for (Op op : kAllOps) {
        if (std::strcmp(v, "all") == 0 || std::strcmp(v, op_name(op)) == 0) o.ops.push_back(op);
      }
      if (o.ops.empty()) usage("unknown --op");
    } else {
      usage(("unknown flag " + a).c_str());
    }
  }
  if (o.nranks < 1 || o.nranks > 64 || o.iters < 1 || o.factor <= 1) usage("bad values");
  return o;
}

struct Rank {
  Options o;
  Shared* sh;
  int rank = 0, n = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void *send = nullptr, *recv = nullptr;
  std::vector<char> host;

  [[noreturn]] void die(const char* what, const char* why) {
    std::fprintf(stderr, "nccl-perf: rank %d: %s: %s\n", rank, what, why);
    std::exit(3);
  }
  void nccl(ncclResult_t r, const char* what) {
    if (r != ncclSuccess)
      die(what, (std::string(ncclGetErrorString(r)) + ": " + ncclGetLastError(comm)).c_str());
  }
  void cuda(cudaError_t e, const char* what) {
    if (e != cudaSuccess) die(what, cudaGetErrorString(e));
  }
  /// Polls `ready` until it holds; a rank that died leaves the others here,
  /// so after 120 s this rank gives up, naming what it waited for.
  template <typename Ready>
  void wait_for(Ready ready, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (!ready()) {
      if (std::chrono::steady_clock::now() > deadline) die(what, "the other ranks did not arrive within 120 s");
      usleep(50);
    }
  }
  void barrier() {
    const int gen = sh->generation.load();
    if (sh->arrived.fetch_add(1) + 1 == n) {
      sh->arrived.store(0);
      sh->generation.fetch_add(1);
    } else {
      wait_for([&] { return sh->generation.load() != gen; }, "barrier");
    }
  }

  void submit(Op op, std::size_t count, bool in_place) {
    const std::size_t es = o.type.size;
    char* r = static_cast<char*>(recv);
    char* s = in_place ? r : static_cast<char*>(send);
    if (in_place && op == Op::all_gather) s = r + rank * count * es;
    if (in_place && op == Op::reduce_scatter) r = s + rank * count * es;
    const auto t = o.type.nccl;
    const auto red = static_cast<ncclRedOp_t>(o.redop);
    switch (op) {
      case Op::all_reduce:
        nccl(ncclAllReduce(s, r, count, t, red, comm, stream), "ncclAllReduce");
        break;
      case Op::all_gather:
        nccl(ncclAllGather(s, r, count, t, comm, stream), "ncclAllGather");
        break;
      case Op::reduce_scatter:
        nccl(ncclReduceScatter(s, r, count, t, red, comm, stream), "ncclReduceScatter");
        break;
      case Op::broadcast:
        nccl(ncclBroadcast(s, r, count, t, 0, comm, stream), "ncclBroadcast");
        break;
      case Op::reduce:
        nccl(ncclReduce(s, r, count, t, red, 0, comm, stream), "ncclReduce");
        break;
      case Op::all_to_all:
        nccl(ncclAlltoAll(s, r, count, t, comm, stream), "ncclAlltoAll");
        break;
    }
  }

  /// Rank r contributes r + 1 everywhere: the expected value of output element i.
  double want(Op op, std::size_t count, std::size_t i) const {
    const bool integer = o.type.nccl != ncclFloat16 && o.type.nccl != ncclBfloat16 &&
                         o.type.nccl != ncclFloat32 && o.type.nccl != ncclFloat64;
    switch (op) {
      case Op::broadcast:
        return 1;
      case Op::all_gather:
      case Op::all_to_all:
        return static_cast<double>(i / count + 1);
      default:
        break;
    }
    double acc = o.redop == 1 ? 1 : 0;
    for (int r = 1; r <= n; ++r)
      acc = o.redop == 1 ? acc * r : o.redop == 2 ? r : o.redop == 3 ? 1 : acc + r;
    if (o.redop == 4)
      acc = integer ? static_cast<double>(static_cast<long long>(acc) / n) : acc / n;
    return acc;
  }

  long check(Op op, std::size_t count, bool in_place) {
    const std::size_t es = o.type.size;
    const std::size_t in_n = op == Op::reduce_scatter || op == Op::all_to_all ? count * n : count;
    const std::size_t out_n = op == Op::all_gather || op == Op::all_to_all ? count * n : count;
    for (std::size_t i = 0; i < in_n; ++i) collectived::client::nccl::host_store(o.type.nccl, host.data(), i, rank + 1);
    char* dst = in_place ? static_cast<char*>(recv) : static_cast<char*>(send);
    if (in_place && op == Op::all_gather) dst += rank * count * es;
    cuda(cudaMemset(recv, 0, std::max(in_n, out_n) * es), "cudaMemset");
    cuda(cudaMemcpy(dst, host.data(), in_n * es, cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda(cudaDeviceSynchronize(), "upload");
    submit(op, count, in_place);
    cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    if (op == Op::reduce && rank != 0) return 0;
    const char* out =
        static_cast<char*>(recv) + (in_place && op == Op::reduce_scatter ? rank * count * es : 0);
    cuda(cudaMemcpy(host.data(), out, out_n * es, cudaMemcpyDeviceToHost), "cudaMemcpy");
    long wrong = 0;
    for (std::size_t i = 0; i < out_n; ++i) {
      const double w = want(op, count, i), g = collectived::client::nccl::host_load(o.type.nccl, host.data(), i);
      if (std::abs(g - w) > 1e-2 * std::abs(w)) ++wrong;
    }
    return wrong;
  }

  double time(Op op, std::size_t count, bool in_place, cudaEvent_t start, cudaEvent_t stop) {
    for (int i = 0; i < o.warmup; ++i) submit(op, count, in_place);
    cuda(cudaStreamSynchronize(stream), "warm-up");
    barrier();
    cuda(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < o.iters; ++i) submit(op, count, in_place);
    cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return 1000.0 * ms / o.iters;
  }

  int main_loop();
};

int Rank::main_loop() {
  int gpus = 0;
  cuda(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
  if (o.gpus > 0) gpus = std::min(gpus, o.gpus);
  cuda(cudaSetDevice(rank % gpus), "cudaSetDevice");
  cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  if (rank == 0) {
    nccl(ncclGetUniqueId(&sh->id), "ncclGetUniqueId");
    sh->id_ready.store(1);
  }
  wait_for([&] { return sh->id_ready.load() != 0; }, "rank 0's ncclGetUniqueId");
  nccl(ncclCommInitRank(&comm, n, sh->id, rank), "ncclCommInitRank");
  // Sizes are whole arrays (sharded ops) or one rank's: no buffer exceeds the largest.
  const std::size_t bytes = std::max<std::size_t>(o.max_bytes, 64) + 64;
  cuda(cudaMalloc(&send, bytes), "cudaMalloc");
  cuda(cudaMalloc(&recv, bytes), "cudaMalloc");
  host.resize(bytes);
  cudaEvent_t start, stop;
  cuda(cudaEventCreate(&start), "cudaEventCreate");
  cuda(cudaEventCreate(&stop), "cudaEventCreate");
  int version = 0;
  ncclGetVersion(&version);
  Dl_info lib{};  // which libnccl.so.2 LD_LIBRARY_PATH gave us
  dladdr(reinterpret_cast<void*>(&ncclGetVersion), &lib);
  if (rank == 0) {
    std::printf(
        "# nccl-perf: %s (version %d), nranks %d on %d GPU(s), iters %d warmup %d check %d\n",
        lib.dli_fname ? lib.dli_fname : "libnccl.so.2", version, n, gpus, o.iters, o.warmup,
        o.check);
  }
  long wrong_total = 0;
  for (Op op : o.ops) {
    if (rank == 0) {
      std::printf("#\n# %s, %s%s%s\n", op_name(op), o.type.name, reducing(op) ? ", " : "",
                  reducing(op) ? kRedops[o.redop] : "");
      std::printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size",
                  "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
                  "algbw", "busbw", "#wrong");
    }
    for (std::size_t size = o.min_bytes; size <= o.max_bytes;) {
      const std::size_t es = o.type.size;
      const std::size_t count = sharded(op) ? size / (es * n) : size / es;
      const std::size_t shown = sharded(op) ? count * es * n : count * es;
      double t[2];
      long w[2];
      for (int ip = 0; ip < 2; ++ip) {
        sh->wrong[rank] = o.check ? check(op, count, ip == 1) : 0;
        sh->times[rank] = time(op, count, ip == 1, start, stop);
        barrier();
        t[ip] = *std::max_element(sh->times, sh->times + n);
        w[ip] = 0;
        for (int r = 0; r < n; ++r) w[ip] += sh->wrong[r];
        barrier();
      }
      if (rank == 0) {
        std::printf("%12zu  %12zu  %8s  %6s  %6d", shown, sharded(op) ? count * n : count,
                    o.type.name, reducing(op) ? kRedops[o.redop] : "none",
                    op == Op::broadcast || op == Op::reduce ? 0 : -1);
        for (int ip = 0; ip < 2; ++ip) {
          const double algbw = t[ip] > 0 ? static_cast<double>(shown) / 1e3 / t[ip] : 0;
          std::printf("  %7.2f  %6.2f  %6.2f  %6ld", t[ip], algbw, algbw * bus_factor(op, n),
                      w[ip]);
          wrong_total += w[ip];
        }
        std::printf("\n");
        std::fflush(stdout);
      }
      const auto next = static_cast<std::size_t>(static_cast<double>(size) * o.factor);
      if (next <= size) break;
      size = next;
    }
  }
  if (rank == 0)
    std::printf("# Out of bounds values : %ld %s\n", wrong_total, wrong_total ? "FAILED" : "OK");
  nccl(ncclCommDestroy(comm), "ncclCommDestroy");
  return wrong_total == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  void* mem =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 3;
  auto* sh = new (mem) Shared();
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.nranks; ++r) {
    const pid_t pid = fork();  // before any CUDA call: CUDA does not survive fork
    if (pid == 0) {
      Rank rank;
      rank.o = o;
      rank.sh = sh;
      rank.rank = r;
      rank.n = o.nranks;
      std::_Exit(rank.main_loop());
    }
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    rc = std::max(rc, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  if (rc != 0) std::fprintf(stderr, "nccl-perf: failed (exit %d)\n", rc);
  return rc;
}
