/*
 * gloo-perf: a Gloo anchor for collective-perf. Runs the collectives over
 * host memory with Debian 12's libgloo-dev (gloo 0.5, git 2022-05-18) and its
 * TCP transport bound to 127.0.0.1, and prints the nccl-tests table format
 * (see perf-common.h for the conventions).
 *
 *   g++ -O2 -std=c++17 -o build/bench/gloo-perf bench/gloo-perf.cc -lgloo -lpthread
 *   build/bench/gloo-perf -t 4 -b 8 -e 64M -f 4 --op all
 *
 * Launch: with -t N (default 4) the program forks N ranks itself; they meet
 * through a gloo::rendezvous::FileStore in a fresh mkdtemp directory under
 * $TMPDIR (or /tmp), removed at the end. Alternatively set GLOO_RANK,
 * GLOO_SIZE and GLOO_STORE_DIR and start the processes yourself.
 *
 * Mapping to Gloo (new-style "options" API unless said otherwise):
 *   all-reduce      gloo::allreduce (gloo/allreduce.h); algorithm: the library's
 *                   default (UNSPECIFIED = ring), or --algo ring|bcube.
 *                   in-place: output only (Gloo reduces the output in place).
 *   all-gather      gloo::allgather (ring); in-place: no input, own block already at
 *                   recv+rank*count.
 *   reduce-scatter  the new-style API has none in this version; uses the old-style
 *                   gloo::ReduceScatterHalvingDoubling<T> (gloo/reduce_scatter.h),
 *                   which works in place on the full n*count buffer and leaves the
 *                   rank's block at recv[0..count). It binds its buffer at
 *                   construction, so instances are cached per (pointer, size) and
 *                   the nccl-tests buffer rotation is off for this op; out-of-place
 *                   is memcpy(send -> recv) + the in-place algorithm (copy timed).
 *   broadcast       gloo::broadcast (root sends to all); in-place: output only.
 *   reduce          gloo::reduce; in-place: output only.
 *   all-to-all      gloo::alltoall; in-place: the same buffer as input and output is
 *                   not allowed by Gloo's contract, so in-place copies the input to a
 *                   scratch buffer first (copy timed).
 * avg: Gloo has no avg. It is sum followed by a local division of the result by
 * nranks, inside the timing. Options objects are built per call (the buffer
 * address rotates), as torch's ProcessGroupGloo also does per call.
 */
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/config.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include "perf-common.h"

namespace {

std::shared_ptr<gloo::Context> g_ctx;
int g_algo = 0;  // 0 = library default, 1 = ring, 2 = bcube
std::vector<char> g_scratch;

using RedFn = void (*)(void*, const void*, const void*, size_t);

template <typename T>
RedFn red_fn(int redop) {
  switch (redop) {
    case RO_PROD: return &gloo::product<T>;
    case RO_MAX: return &gloo::max<T>;
    case RO_MIN: return &gloo::min<T>;
    default: return &gloo::sum<T>;
  }
}

template <typename T>
const gloo::ReductionFunction<T>* red_obj(int redop) {
  switch (redop) {
    case RO_PROD: return gloo::ReductionFunction<T>::product;
    case RO_MAX: return gloo::ReductionFunction<T>::max;
    case RO_MIN: return gloo::ReductionFunction<T>::min;
    default: return gloo::ReductionFunction<T>::sum;
  }
}

// Old-style reduce-scatter instances, keyed by (pointer, total count, redop).
template <typename T>
gloo::ReduceScatterHalvingDoubling<T>* rs_instance(T* ptr, size_t count, int redop) {
  static std::map<std::tuple<void*, size_t, int>, std::unique_ptr<gloo::ReduceScatterHalvingDoubling<T>>> cache;
  auto key = std::make_tuple((void*)ptr, count, redop);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second.get();
  if (cache.size() > 64) cache.clear();  // all ranks clear at the same point
  const int n = g_ctx->size;
  std::vector<int> recvElems(n, (int)(count / n));
  std::vector<T*> ptrs{ptr};
  auto* inst = new gloo::ReduceScatterHalvingDoubling<T>(g_ctx, ptrs, (int)count, recvElems, red_obj<T>(redop));
  cache[key].reset(inst);
  return inst;
}

template <typename T>
void run_typed(int op, int in_place, const void* send_, void* recv_, size_t count, int dt, int redop, int root) {
  T* send = const_cast<T*>(static_cast<const T*>(send_));
  T* recv = static_cast<T*>(recv_);
  const int n = g_ctx->size, me = g_ctx->rank;
  switch (op) {
    case OP_ALL_REDUCE: {
      gloo::AllreduceOptions o(g_ctx);
      if (!in_place) o.setInput(send, count);
      o.setOutput(recv, count);
      o.setReduceFunction(red_fn<T>(redop));
      if (g_algo == 1) o.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      if (g_algo == 2) o.setAlgorithm(gloo::AllreduceOptions::Algorithm::BCUBE);
      gloo::allreduce(o);
      if (redop == RO_AVG) perf_divide(recv, dt, count, n);
      break;
    }
    case OP_ALL_GATHER: {
      gloo::AllgatherOptions o(g_ctx);
      if (!in_place) o.setInput(send, count);
      o.setOutput(recv, count * n);
      gloo::allgather(o);
      break;
    }
    case OP_REDUCE_SCATTER: {
      if (!in_place) memcpy(recv, send, count * n * sizeof(T));
      rs_instance<T>(recv, count * n, redop)->run();
      if (redop == RO_AVG) perf_divide(recv, dt, count, n);
      break;
    }
    case OP_BROADCAST: {
      gloo::BroadcastOptions o(g_ctx);
      o.setRoot(root);
      if (!in_place && me == root) o.setInput(send, count);
      o.setOutput(recv, count);
      gloo::broadcast(o);
      break;
    }
    case OP_REDUCE: {
      gloo::ReduceOptions o(g_ctx);
      o.setRoot(root);
      if (!in_place) o.setInput(send, count);
      o.setOutput(recv, count);
      o.setReduceFunction(red_fn<T>(redop));
      gloo::reduce(o);
      if (redop == RO_AVG && me == root) perf_divide(recv, dt, count, n);
      break;
    }
    case OP_ALL_TO_ALL: {
      const size_t bytes = count * n * sizeof(T);
      if (in_place) {
        if (g_scratch.size() < bytes) g_scratch.resize(bytes);
        memcpy(g_scratch.data(), recv, bytes);
        send = reinterpret_cast<T*>(g_scratch.data());
      }
      gloo::AlltoallOptions o(g_ctx);
      o.setInput(send, count * n);
      o.setOutput(recv, count * n);
      gloo::alltoall(o);
      break;
    }
  }
}

int gloo_run(int op, int in_place, const void* send, void* recv, size_t count, int dt, int redop, int root) {
  if (count == 0) return 0;  // Gloo asserts on empty buffers; nccl-tests' alltoall also skips count 0
  try {
    switch (dt) {
      case DT_INT8: run_typed<int8_t>(op, in_place, send, recv, count, dt, redop, root); break;
      case DT_UINT8: run_typed<uint8_t>(op, in_place, send, recv, count, dt, redop, root); break;
      case DT_INT32: run_typed<int32_t>(op, in_place, send, recv, count, dt, redop, root); break;
      case DT_UINT32: run_typed<uint32_t>(op, in_place, send, recv, count, dt, redop, root); break;
      case DT_INT64: run_typed<int64_t>(op, in_place, send, recv, count, dt, redop, root); break;
      case DT_UINT64: run_typed<uint64_t>(op, in_place, send, recv, count, dt, redop, root); break;
      case DT_FLOAT: run_typed<float>(op, in_place, send, recv, count, dt, redop, root); break;
      default: run_typed<double>(op, in_place, send, recv, count, dt, redop, root); break;
    }
  } catch (const std::exception& e) {
    fprintf(stderr, "gloo-perf: rank %d: %s: %s\n", g_ctx->rank, perf_op_names[op], e.what());
    return 1;
  }
  return 0;
}

void gloo_barrier() {
  gloo::BarrierOptions o(g_ctx);
  gloo::barrier(o);
}

double gloo_allreduce_time(double v, int mode) {
  double x = v;
  if (mode == 0) {
    gloo::BroadcastOptions o(g_ctx);
    o.setRoot(0);
    o.setOutput(&x, 1);
    gloo::broadcast(o);
    return x;
  }
  gloo::AllreduceOptions o(g_ctx);
  o.setOutput(&x, 1);
  o.setReduceFunction(mode == 2 ? red_fn<double>(RO_MIN) : mode == 1 ? red_fn<double>(RO_SUM) : red_fn<double>(RO_MAX));
  gloo::allreduce(o);
  return mode == 1 ? x / g_ctx->size : x;
}

int64_t gloo_sum_i64(int64_t v) {
  int64_t x = v;
  gloo::AllreduceOptions o(g_ctx);
  o.setOutput(&x, 1);
  o.setReduceFunction(red_fn<int64_t>(RO_SUM));
  gloo::allreduce(o);
  return x;
}

void gloo_describe(FILE* f) {
  fprintf(f, "# library: gloo %d.%d.%d (Debian libgloo-dev), transport tcp on 127.0.0.1, rendezvous FileStore\n",
          GLOO_VERSION_MAJOR, GLOO_VERSION_MINOR, GLOO_VERSION_PATCH);
  fprintf(f, "# all-reduce algorithm: %s; reduce-scatter: ReduceScatterHalvingDoubling (old-style API)\n",
          g_algo == 1 ? "ring" : g_algo == 2 ? "bcube" : "library default (ring)");
  fprintf(f, "# avg = sum + local division\n");
  fprintf(f, "# Using devices\n");
  char host[256] = "?";
  gethostname(host, sizeof host);
  for (int r = 0; r < g_ctx->size; r++) fprintf(f, "#  Rank %2d Group  0 on %10s device cpu\n", r, host);
}

int run_rank(int rank, int size, const std::string& storeDir, const struct perf_args& a) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";  // loopback only
    attr.ai_family = AF_INET;
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(storeDir);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(std::chrono::seconds(600));
    ctx->connectFullMesh(store, dev);
    g_ctx = ctx;
  } catch (const std::exception& e) {
    fprintf(stderr, "gloo-perf: rank %d: rendezvous failed: %s\n", rank, e.what());
    return 2;
  }
  struct perf_backend b;
  memset(&b, 0, sizeof b);
  b.name = "gloo-perf";
  b.rank = rank;
  b.nranks = size;
  for (int op = 0; op < OP_COUNT; op++) b.supported[op] = 1;
  b.no_shift[OP_REDUCE_SCATTER] = 1;
  b.run = gloo_run;
  b.barrier = gloo_barrier;
  b.allreduce_time = gloo_allreduce_time;
  b.allreduce_sum_i64 = gloo_sum_i64;
  b.describe = gloo_describe;
  int rc;
  try {
    rc = perf_main(&b, &a);
  } catch (const std::exception& e) {
    fprintf(stderr, "gloo-perf: rank %d: %s\n", rank, e.what());
    rc = 2;
  }
  fflush(stdout);
  g_ctx.reset();
  return rc;
}

void remove_dir(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (struct dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      std::string p = dir + "/" + name;
      struct stat st;
      if (lstat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_dir(p);
      else unlink(p.c_str());
    }
    closedir(d);
  }
  rmdir(dir.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  // Strip our own --algo option before the shared parser sees argv.
  std::vector<char*> args;
  for (int i = 0; i < argc; i++) {
    if (!strcmp(argv[i], "--algo") && i + 1 < argc) {
      std::string v = argv[++i];
      if (v == "ring") g_algo = 1;
      else if (v == "bcube") g_algo = 2;
      else if (v == "default") g_algo = 0;
      else { fprintf(stderr, "gloo-perf: --algo ring|bcube|default\n"); return 2; }
      continue;
    }
    args.push_back(argv[i]);
  }
  args.push_back(nullptr);
  struct perf_args a;
  int pr = perf_parse_args((int)args.size() - 1, args.data(), &a);
  if (pr != 0) return pr > 0 ? 0 : 2;

  const char* envRank = getenv("GLOO_RANK");
  if (envRank) {  // externally launched
    const char* envSize = getenv("GLOO_SIZE");
    const char* envDir = getenv("GLOO_STORE_DIR");
    if (!envSize || !envDir) {
      fprintf(stderr, "gloo-perf: GLOO_RANK needs GLOO_SIZE and GLOO_STORE_DIR\n");
      return 2;
    }
    return run_rank(atoi(envRank), atoi(envSize), envDir, a);
  }

  const int size = a.nranks_request > 0 ? a.nranks_request : 4;
  const char* tmp = getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/gloo-perf.XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back(0);
  if (!mkdtemp(buf.data())) {
    perror("gloo-perf: mkdtemp");
    return 2;
  }
  std::string dir = buf.data();
  fflush(stdout);
  fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < size; r++) {
    pid_t pid = fork();
    if (pid < 0) {
      perror("gloo-perf: fork");
      for (pid_t p : pids) kill(p, SIGTERM);
      for (pid_t p : pids) waitpid(p, nullptr, 0);
      remove_dir(dir);
      return 2;
    }
    if (pid == 0) _exit(run_rank(r, size, dir, a));
    pids.push_back(pid);
  }
  int rc = 0;
  size_t left = pids.size();
  while (left > 0) {
    int st = 0;
    pid_t p = wait(&st);
    if (p < 0) break;
    left--;
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    if (code != 0 && rc == 0) {
      rc = code;
      // one rank failed: the others would block until Gloo's timeout; stop them
      for (pid_t q : pids)
        if (q != p) kill(q, SIGTERM);
    }
  }
  remove_dir(dir);
  return rc;
}
