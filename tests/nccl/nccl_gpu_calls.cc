// The rank processes of tests/nccl/nccl_gpu_test: set-up and queries, the
// collectives' matrix (nccl_gpu_matrix.cc), groups of sends and receives
// (a ring with self-sends, two communicators in one group, two streams,
// nesting, gather and scatter), split, non-blocking init and finalize,
// InitAll, registration, refused calls; and the failure case.
#include <unistd.h>

#include <cstring>
#include <vector>

#include "tests/nccl/nccl_gpu_test.h"

namespace ncclt {

void Rank::check(bool good, const char* fmt, ...) {
  ++checks;
  if (good) return;
  ++failures;
  char text[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  std::printf("rank %d: FAIL %s\n", rank, text);
  std::fflush(stdout);
}

bool Rank::ok(ncclResult_t r, const char* what) {
  check(r == ncclSuccess, "%s returned %d (%s): %s", what, static_cast<int>(r),
        ncclGetErrorString(r), ncclGetLastError(nullptr));
  return r == ncclSuccess;
}

void Rank::cuda(cudaError_t e, const char* what) const {
  if (e == cudaSuccess) return;
  std::printf("rank %d: FAIL %s: %s\n", rank, what, cudaGetErrorString(e));
  std::fflush(stdout);
  _exit(3);
}

ncclUniqueId Rank::id(int slot) {
  if (rank == 0) {
    if (!ok(ncclGetUniqueId(&sh->ids[slot]), "ncclGetUniqueId")) _exit(3);
    sh->id_ready[slot].store(1);
  }
  const double until = now_s() + 60;
  while (sh->id_ready[slot].load() == 0 && now_s() < until) usleep(200);
  return sh->ids[slot];
}

void Rank::barrier() {
  const int gen = sh->generation.load();
  if (sh->arrived.fetch_add(1) + 1 == n) {
    sh->arrived.store(0);
    sh->generation.fetch_add(1);
    return;
  }
  while (sh->generation.load() == gen) usleep(100);
}

void Rank::settled(const char* what) {
  ncclResult_t state = ncclInternalError;
  ncclCommGetAsyncError(comm, &state);
  check(state == ncclSuccess, "%s: ncclCommGetAsyncError says %d: %s", what,
        static_cast<int>(state), ncclGetLastError(comm));
}

namespace {

constexpr std::size_t kCnt = 1001;  // float32 elements per block in the group tests

float* f(void* base, std::size_t block) { return static_cast<float*>(base) + block * kCnt; }

/// Block `block` of `base` holds value(sum, who, seed + i).
void upload(Rank& r, void* base, std::size_t block, int who, std::size_t seed) {
  std::vector<float> h(kCnt);
  for (std::size_t i = 0; i < kCnt; ++i) h[i] = static_cast<float>(value(Op::sum, who, seed + i));
  r.cuda(cudaMemcpy(f(base, block), h.data(), kCnt * 4, cudaMemcpyHostToDevice), "upload");
  r.cuda(cudaDeviceSynchronize(), "upload");
}

void expect_block(Rank& r, void* base, std::size_t block, int who, std::size_t seed,
                  const char* what) {
  std::vector<float> h(kCnt);
  r.cuda(cudaMemcpy(h.data(), f(base, block), kCnt * 4, cudaMemcpyDeviceToHost), "download");
  std::size_t bad = kCnt;
  for (std::size_t i = 0; i < kCnt && bad == kCnt; ++i) {
    if (h[i] != static_cast<float>(value(Op::sum, who, seed + i))) bad = i;
  }
  r.check(bad == kCnt, "%s: element %zu is %g, want %g", what, bad, bad < kCnt ? h[bad] : 0.f,
          bad < kCnt ? value(Op::sum, who, seed + bad) : 0.0);
}

void sync(Rank& r, const char* what) {
  r.cuda(cudaDeviceSynchronize(), what);
  r.settled(what);
}

void ring(Rank& r) {
  const int next = (r.rank + 1) % r.n, prev = (r.rank + r.n - 1) % r.n;
  upload(r, r.dsend, 0, r.rank, 0);
  upload(r, r.dsend, 1, r.rank, kCnt);
  r.cuda(cudaMemset(r.drecv, 0, 2 * kCnt * 4), "cudaMemset");
  ncclGroupStart();
  ncclSend(f(r.dsend, 0), kCnt, ncclFloat32, next, r.comm, r.stream);
  ncclRecv(f(r.drecv, 0), kCnt, ncclFloat32, prev, r.comm, r.stream);
  ncclSend(f(r.dsend, 1), kCnt, ncclFloat32, r.rank, r.comm, r.stream);
  ncclRecv(f(r.drecv, 1), kCnt, ncclFloat32, r.rank, r.comm, r.stream);
  r.ok(ncclGroupEnd(), "ncclGroupEnd of a ring exchange with self-sends");
  sync(r, "ring");
  expect_block(r, r.drecv, 0, prev, 0, "ring: the previous rank's block");
  expect_block(r, r.drecv, 1, r.rank, kCnt, "ring: the block sent to itself");

  // Nested groups, and a lone send/recv pair split across two streams.
  cudaStream_t other = nullptr;
  r.cuda(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), "cudaStreamCreate");
  r.cuda(cudaMemset(r.drecv, 0, kCnt * 4), "cudaMemset");
  ncclGroupStart();
  ncclGroupStart();
  ncclSend(f(r.dsend, 0), kCnt, ncclFloat32, next, r.comm, r.stream);
  r.ok(ncclGroupEnd(), "the inner ncclGroupEnd");
  ncclRecv(f(r.drecv, 0), kCnt, ncclFloat32, prev, r.comm, other);
  r.ok(ncclGroupEnd(), "the outer ncclGroupEnd (two streams)");
  // Work queued on the receive's stream afterwards must see the data.
  float* pinned = nullptr;
  r.cuda(cudaMallocHost(reinterpret_cast<void**>(&pinned), kCnt * 4), "cudaMallocHost");
  r.cuda(cudaMemcpyAsync(pinned, f(r.drecv, 0), kCnt * 4, cudaMemcpyDeviceToHost, other), "copy");
  r.cuda(cudaStreamSynchronize(other), "the receive's stream");
  std::size_t bad = kCnt;
  for (std::size_t i = 0; i < kCnt && bad == kCnt; ++i) {
    if (pinned[i] != static_cast<float>(value(Op::sum, prev, i))) bad = i;
  }
  r.check(bad == kCnt, "two streams: element %zu seen on the receive's stream is wrong", bad);
  sync(r, "nested groups on two streams");
  r.cuda(cudaFreeHost(pinned), "cudaFreeHost");
  r.cuda(cudaStreamDestroy(other), "cudaStreamDestroy");
}

/// One group over two communicators: a collective on each, sends and receives on the second.
void two_comms(Rank& r) {
  ncclComm_t second = nullptr;
  if (!r.ok(ncclCommSplit(r.comm, 0, r.rank, &second, nullptr), "ncclCommSplit (same ranks)")) {
    return;
  }
  const int next = (r.rank + 1) % r.n, prev = (r.rank + r.n - 1) % r.n;
  for (std::size_t b = 0; b < 3; ++b) upload(r, r.dsend, b, r.rank, b * kCnt);
  r.cuda(cudaMemset(r.drecv, 0, 3 * kCnt * 4), "cudaMemset");
  ncclGroupStart();
  ncclAllReduce(f(r.dsend, 0), f(r.drecv, 0), kCnt, ncclFloat32, ncclMax, r.comm, r.stream);
  ncclAllReduce(f(r.dsend, 1), f(r.drecv, 1), kCnt, ncclFloat32, ncclMin, second, r.stream);
  ncclSend(f(r.dsend, 2), kCnt, ncclFloat32, next, second, r.stream);
  ncclRecv(f(r.drecv, 2), kCnt, ncclFloat32, prev, second, r.stream);
  r.ok(ncclGroupEnd(), "ncclGroupEnd over two communicators");
  sync(r, "two communicators");
  std::vector<float> h(3 * kCnt);
  r.cuda(cudaMemcpy(h.data(), r.drecv, h.size() * 4, cudaMemcpyDeviceToHost), "download");
  bool good = true;
  for (std::size_t i = 0; i < kCnt; ++i) {
    good = good && h[i] == static_cast<float>(expected(ncclFloat32, Op::max, r.n, i)) &&
           h[kCnt + i] == static_cast<float>(expected(ncclFloat32, Op::min, r.n, kCnt + i)) &&
           h[2 * kCnt + i] == static_cast<float>(value(Op::sum, prev, 2 * kCnt + i));
  }
  r.check(good, "a group over two communicators: wrong results");
  r.ok(ncclCommDestroy(second), "ncclCommDestroy (second)");
}

void gather_scatter(Rank& r) {
  const int root = 1 % r.n;
  upload(r, r.dsend, 0, r.rank, 0);
  r.cuda(cudaMemset(r.drecv, 0, r.n * kCnt * 4), "cudaMemset");
  r.ok(ncclGather(r.dsend, r.drecv, kCnt, ncclFloat32, root, r.comm, r.stream), "ncclGather");
  sync(r, "ncclGather");
  for (int k = 0; r.rank == root && k < r.n; ++k) expect_block(r, r.drecv, k, k, 0, "ncclGather");
  for (int k = 0; k < r.n; ++k) upload(r, r.dsend, k, k, 0);
  r.cuda(cudaMemset(r.drecv, 0, kCnt * 4), "cudaMemset");
  r.ok(ncclScatter(r.dsend, r.drecv, kCnt, ncclFloat32, root, r.comm, r.stream), "ncclScatter");
  sync(r, "ncclScatter");
  expect_block(r, r.drecv, 0, r.rank, 0, "ncclScatter");
}

/// An int32 all-reduce of (rank + 1) on `c`: the sum over `members` ranks' values.
void sum_of_ranks(Rank& r, ncclComm_t c, int value, int want, const char* what) {
  int* d = static_cast<int*>(r.drecv);
  r.cuda(cudaMemcpy(d, &value, 4, cudaMemcpyHostToDevice), "upload");
  r.cuda(cudaDeviceSynchronize(), "upload");
  if (!r.ok(ncclAllReduce(d, d, 1, ncclInt32, ncclSum, c, r.stream), what)) return;
  r.cuda(cudaStreamSynchronize(r.stream), what);
  int got = 0;
  r.cuda(cudaMemcpy(&got, d, 4, cudaMemcpyDeviceToHost), "download");
  r.check(got == want, "%s: %d, want %d", what, got, want);
}

void split(Rank& r) {
  const bool out = r.rank == r.n - 1;
  ncclComm_t sub = reinterpret_cast<ncclComm_t>(1);
  if (!r.ok(ncclCommSplit(r.comm, out ? NCCL_SPLIT_NOCOLOR : 0, -r.rank, &sub, nullptr),
            "ncclCommSplit")) {
    return;
  }
  if (out) {
    r.check(sub == nullptr, "ncclCommSplit with NCCL_SPLIT_NOCOLOR: not NULL");
    return;
  }
  int count = 0, rank = -1;
  ncclCommCount(sub, &count);
  ncclCommUserRank(sub, &rank);
  r.check(count == r.n - 1 && rank == r.n - 2 - r.rank,
          "split by key -rank: count %d rank %d, want %d and %d", count, rank, r.n - 1,
          r.n - 2 - r.rank);
  sum_of_ranks(r, sub, r.rank + 1, (r.n - 1) * r.n / 2, "all-reduce on the split");
  r.ok(ncclCommDestroy(sub), "ncclCommDestroy (split)");
}

ncclResult_t poll(ncclComm_t c, double seconds) {
  ncclResult_t state = ncclInProgress;
  const double until = now_s() + seconds;
  while (ncclCommGetAsyncError(c, &state) == ncclSuccess && state == ncclInProgress &&
         now_s() < until) {
    usleep(1000);
  }
  return state;
}

void nonblocking(Rank& r) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t c = nullptr;
  const ncclResult_t rc = ncclCommInitRankConfig(&c, r.n, r.id(2), r.rank, &cfg);
  r.check(rc == ncclInProgress || rc == ncclSuccess, "non-blocking ncclCommInitRankConfig: %d",
          static_cast<int>(rc));
  if (c == nullptr) return;
  r.ok(poll(c, 60), "non-blocking init, polled with ncclCommGetAsyncError");
  sum_of_ranks(r, c, r.rank + 1, r.n * (r.n + 1) / 2, "all-reduce on a non-blocking communicator");
  const ncclResult_t fin = ncclCommFinalize(c);
  r.check(fin == ncclInProgress || fin == ncclSuccess, "non-blocking ncclCommFinalize: %d",
          static_cast<int>(fin));
  r.ok(poll(c, 60), "non-blocking finalize, polled");
  r.ok(ncclCommDestroy(c), "ncclCommDestroy (non-blocking)");
}

void init_all(Rank& r) {
  const int dev = 0;
  ncclComm_t c = nullptr;
  if (!r.ok(ncclCommInitAll(&c, 1, &dev), "ncclCommInitAll (1 device)")) return;
  int count = 0, device = -1, rank = -1;
  ncclCommCount(c, &count);
  ncclCommCuDevice(c, &device);
  ncclCommUserRank(c, &rank);
  r.check(count == 1 && device == 0 && rank == 0, "InitAll: count %d device %d rank %d", count,
          device, rank);
  sum_of_ranks(r, c, 42, 42, "all-reduce on InitAll's communicator");
  r.ok(ncclCommDestroy(c), "ncclCommDestroy (InitAll)");
}

void refused(Rank& r) {
  auto expect = [&](ncclResult_t got, ncclResult_t want, const char* text) {
    const char* last = ncclGetLastError(nullptr);
    r.check(got == want && std::strstr(last, text) != nullptr, "%s: returned %d, last error %s",
            text, static_cast<int>(got), last);
  };
  ncclWindow_t w = nullptr;
  expect(ncclCommWindowRegister(r.comm, r.dsend, 4096, &w, NCCL_WIN_DEFAULT), ncclInvalidUsage,
         "ncclCommWindowRegister");
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  expect(ncclGroupSimulateEnd(&sim), ncclInvalidUsage, "ncclGroupSimulateEnd");
  expect(ncclAllReduce(r.dsend, r.drecv, 8, ncclFloat8e5m2, ncclSum, r.comm, r.stream),
         ncclInvalidArgument, "ncclFloat8e5m2");
  r.settled("after refused calls");
}

void setup(Rank& r) {
  r.cap = static_cast<std::size_t>(r.n) * (std::size_t{1} << 20) * 8;
  if (!r.ok(ncclMemAlloc(&r.dsend, r.cap), "ncclMemAlloc") ||
      !r.ok(ncclMemAlloc(&r.drecv, r.cap), "ncclMemAlloc")) {
    _exit(3);
  }
  int count = 0, device = -1, rank = -1;
  ncclCommCount(r.comm, &count);
  ncclCommCuDevice(r.comm, &device);
  ncclCommUserRank(r.comm, &rank);
  r.check(count == r.n && device == 0 && rank == r.rank, "count %d device %d rank %d", count,
          device, rank);
  r.cuda(cudaMalloc(&r.dscalars, 8 * ncclNumTypes), "cudaMalloc");
  for (ncclDataType_t t : kTypes) {
    char host[8], dev[8];
    host_store(t, host, 0, kHostScalar);
    host_store(t, dev, 0, kDeviceScalar);
    char* at = static_cast<char*>(r.dscalars) + 8 * t;
    r.cuda(cudaMemcpy(at, dev, 8, cudaMemcpyHostToDevice), "cudaMemcpy scalar");
    r.ok(ncclRedOpCreatePreMulSum(&r.premul[0][t], host, t, ncclScalarHostImmediate, r.comm),
         "ncclRedOpCreatePreMulSum (host)");
    r.ok(ncclRedOpCreatePreMulSum(&r.premul[1][t], at, t, ncclScalarDevice, r.comm),
         "ncclRedOpCreatePreMulSum (device)");
  }
  r.cuda(cudaDeviceSynchronize(), "the scalars");
}

void teardown(Rank& r) {
  for (ncclDataType_t t : kTypes) {
    r.ok(ncclRedOpDestroy(r.premul[0][t], r.comm), "ncclRedOpDestroy");
    r.ok(ncclRedOpDestroy(r.premul[1][t], r.comm), "ncclRedOpDestroy");
  }
  r.ok(ncclCommFinalize(r.comm), "ncclCommFinalize");
  r.ok(ncclCommDestroy(r.comm), "ncclCommDestroy");
  r.ok(ncclMemFree(r.dsend), "ncclMemFree");
  r.ok(ncclMemFree(r.drecv), "ncclMemFree");
  r.cuda(cudaFree(r.dscalars), "cudaFree");
}

}  // namespace

int rank_main(Shared* sh, int rank, int n) {
  Rank r{sh, rank, n};
  r.cuda(cudaSetDevice(0), "cudaSetDevice");
  r.cuda(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  if (!r.ok(ncclCommInitRank(&r.comm, n, r.id(0), rank), "ncclCommInitRank")) return 1;
  setup(r);
  void *hs = nullptr, *hr = nullptr;
  r.ok(ncclCommRegister(r.comm, r.dsend, r.cap, &hs), "ncclCommRegister");
  r.ok(ncclCommRegister(r.comm, r.drecv, r.cap, &hr), "ncclCommRegister");
  check_collectives(r);
  ring(r);
  two_comms(r);
  gather_scatter(r);
  split(r);
  nonblocking(r);
  init_all(r);
  refused(r);
  r.ok(ncclCommDeregister(r.comm, hs), "ncclCommDeregister");
  r.ok(ncclCommDeregister(r.comm, hr), "ncclCommDeregister");
  teardown(r);
  std::printf("rank %d: %ld checks, %ld failed\n", rank, r.checks, r.failures);
  std::fflush(stdout);
  return r.failures == 0 ? 0 : 1;
}

int failure_rank(Shared* sh, int rank, int n) {
  Rank r{sh, rank, n};
  r.cuda(cudaSetDevice(0), "cudaSetDevice");
  r.cuda(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  if (!r.ok(ncclCommInitRank(&r.comm, n, r.id(0), rank), "ncclCommInitRank")) return 1;
  r.cuda(cudaMalloc(&r.drecv, 1 << 20), "cudaMalloc");
  sum_of_ranks(r, r.comm, 1, n, "an all-reduce before the kill");
  if (rank == sh->victim) {
    sh->victim_ready.store(1);
    for (;;) pause();  // killed by the test's parent
  }
  r.ok(ncclAllReduce(r.drecv, r.drecv, 1024, ncclFloat32, ncclSum, r.comm, r.stream),
       "the all-reduce the killed rank never joins");
  sh->submitted.fetch_add(1);
  const double until = now_s() + 120;
  while (sh->victim_dead.load() == 0 && now_s() < until) usleep(1000);
  ncclResult_t state = ncclSuccess;
  const double give_up = now_s() + 30;
  while (ncclCommGetAsyncError(r.comm, &state) == ncclSuccess && state == ncclSuccess &&
         now_s() < give_up) {
    usleep(1000);
  }
  const double took = now_s() - sh->killed_at;
  const char* last = ncclGetLastError(r.comm);
  char victim[32];
  std::snprintf(victim, sizeof victim, "rank %d", sh->victim);
  std::printf("rank %d: the killed rank surfaced after %.2f s: %d (%s): %s\n", rank, took,
              static_cast<int>(state), ncclGetErrorString(state), last);
  r.check(state != ncclSuccess && state != ncclInProgress, "no error after the kill");
  r.check(std::strstr(last, victim) != nullptr, "the error does not name %s", victim);
  r.check(took < 12, "the error came %.1f s after the kill (deadline 10 s)", took);
  const double released = now_s() + 30;
  while (cudaStreamQuery(r.stream) == cudaErrorNotReady && now_s() < released) usleep(1000);
  r.check(cudaStreamQuery(r.stream) == cudaSuccess, "the stream was not released");
  const double t0 = now_s();
  r.ok(ncclCommAbort(r.comm), "ncclCommAbort");
  r.check(now_s() - t0 < 2, "ncclCommAbort took %.1f s", now_s() - t0);
  std::printf("rank %d: %ld checks, %ld failed\n", rank, r.checks, r.failures);
  return r.failures == 0 ? 0 : 1;
}

}  // namespace ncclt
