/* collectived's libnccl.so.2 on a machine without a GPU (CI; label nccl).
 *
 * Loads the library with dlopen(RTLD_NOW), which fails on any undefined
 * symbol, and calls it as an NCCL program would: versions and error strings;
 * a daemon that is not there (the error names the socket); no CUDA driver
 * (the error says so). Then, against a real collectived and with
 * COLLECTIVED_NCCL_HOST_ONLY=1 (communicators without a device), the set-up
 * calls: ids, blocking and non-blocking init, a rendezvous that times out,
 * abort during init, InitAll, inits in a group, InitRankScalable, split,
 * finalize, destroy, groups, and the errors of calls that are refused. Collectives on GPU
 * buffers are tests/nccl/nccl_gpu_test's.
 *
 * usage: nccl_cpu_test LIBNCCL COLLECTIVED */
#include "tests/nccl/test_daemon.h"

#include <dlfcn.h>

#include "client/nccl/nccl.h"

#define NCCL_CALLS(X)                                                                              \
  X(ncclGetVersion)                                                                                \
  X(ncclGetErrorString)                                                                            \
  X(ncclGetLastError)                                                                              \
  X(ncclGetUniqueId)                                                                               \
  X(ncclCommInitRank) X(ncclCommInitRankConfig) X(ncclCommInitAll) X(ncclCommInitRankScalable)     \
      X(ncclCommCount) X(ncclCommUserRank) X(ncclCommCuDevice) X(ncclCommGetAsyncError)            \
          X(ncclCommSplit) X(ncclCommFinalize) X(ncclCommDestroy) X(ncclCommAbort)                 \
              X(ncclAllReduce) X(ncclCommWindowRegister) X(ncclGroupSimulateEnd) X(ncclCommShrink) \
                  X(ncclGroupStart) X(ncclGroupEnd) X(ncclSend) X(ncclRedOpCreatePreMulSum)        \
                      X(ncclRedOpDestroy)
#define DECLARE(f) static __typeof__(&f) p_##f;
NCCL_CALLS(DECLARE)

static int g_failed = 0;

/* `call` succeeds and `cond` holds; the detail is the library's last error, read after. */
#define EXPECT_OK(call, cond, what)                                       \
  do {                                                                    \
    const ncclResult_t rc_ = (call);                                      \
    expect(rc_ == ncclSuccess && (cond), what, p_ncclGetLastError(NULL)); \
  } while (0)

static void expect(int ok, const char* what, const char* detail) {
  printf("%s - %s%s%s\n", ok ? "ok" : "FAIL", what, detail && !ok ? ": " : "",
         detail && !ok ? detail : "");
  if (!ok) g_failed = 1;
}

/* The call returned `want` and ncclGetLastError contains `text`. */
static void expect_error(ncclResult_t got, ncclResult_t want, const char* text, const char* what) {
  const char* last = p_ncclGetLastError(NULL);
  char detail[2048];
  snprintf(detail, sizeof detail, "returned %d (%s), want %d; last error: %s", (int)got,
           p_ncclGetErrorString(got), (int)want, last);
  expect(got == want && (text == NULL || strstr(last, text) != NULL), what, detail);
  if (got == want) printf("    (%s)\n", last);
}

/* Polls until the communicator's async state is no longer ncclInProgress. */
static ncclResult_t settle(ncclComm_t c, double seconds, double* took) {
  const double t0 = test_now_s();
  ncclResult_t state = ncclInProgress;
  while (test_now_s() - t0 < seconds) {
    if (p_ncclCommGetAsyncError(c, &state) != ncclSuccess) return ncclInternalError;
    if (state != ncclInProgress) break;
    usleep(5000);
  }
  if (took) *took = test_now_s() - t0;
  return state;
}

static void without_daemon(void) {
  setenv("COLLECTIVED_SOCKET", "/nonexistent-dir/nccl-test.sock", 1);
  ncclUniqueId id;
  expect_error(p_ncclGetUniqueId(&id), ncclSystemError, "/nonexistent-dir/nccl-test.sock",
               "ncclGetUniqueId without a daemon names the socket");
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (cuda != NULL) {
    printf("ok - # skipped: no-driver check (a CUDA driver is installed here)\n");
    return;
  }
  memset(&id, 0, sizeof id);
  ncclComm_t c = (ncclComm_t)1;
  expect_error(p_ncclCommInitRank(&c, 1, id, 0), ncclUnhandledCudaError, "CUDA driver",
               "ncclCommInitRank without a CUDA driver says so");
  expect(c == NULL, "... and leaves the communicator NULL", NULL);
}

static void nonblocking(void) {
  ncclUniqueId id;
  EXPECT_OK(p_ncclGetUniqueId(&id), 1, "ncclGetUniqueId");
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t a = NULL, b = NULL;
  const ncclResult_t ra = p_ncclCommInitRankConfig(&a, 2, id, 0, &cfg);
  const ncclResult_t rb = p_ncclCommInitRankConfig(&b, 2, id, 1, &cfg);
  expect(ra == ncclInProgress && rb == ncclInProgress && a && b,
         "non-blocking init of 2 ranks in one thread returns ncclInProgress", NULL);
  expect(settle(a, 10, NULL) == ncclSuccess && settle(b, 10, NULL) == ncclSuccess,
         "... and ncclCommGetAsyncError turns to ncclSuccess", p_ncclGetLastError(NULL));
  int n = 0, r0 = -1, r1 = -1;
  p_ncclCommCount(a, &n);
  p_ncclCommUserRank(a, &r0);
  p_ncclCommUserRank(b, &r1);
  expect(n == 2 && r0 == 0 && r1 == 1, "count 2, ranks 0 and 1", NULL);
  expect(p_ncclCommFinalize(a) == ncclInProgress && settle(a, 10, NULL) == ncclSuccess,
         "non-blocking finalize: ncclInProgress, then ncclSuccess", p_ncclGetLastError(NULL));
  EXPECT_OK(p_ncclCommDestroy(a), p_ncclCommDestroy(b) == ncclSuccess, "destroy both");

  /* Rank 1 never comes: the rendezvous deadline (2 s here) ends it. */
  expect(p_ncclGetUniqueId(&id) == ncclSuccess, "ncclGetUniqueId", NULL);
  expect(p_ncclCommInitRankConfig(&a, 2, id, 0, &cfg) == ncclInProgress, "a lone rank's init",
         NULL);
  double took = 0;
  const ncclResult_t state = settle(a, 20, &took);
  char what[128];
  snprintf(what, sizeof what, "... fails within the rendezvous deadline (%.1f s)", took);
  expect_error(state, ncclRemoteError, "missing ranks: 1", what);
  expect(strstr(p_ncclGetLastError(a), "missing ranks: 1") != NULL,
         "ncclGetLastError(comm) has its message", p_ncclGetLastError(a));
  expect(p_ncclCommDestroy(a) == ncclSuccess, "destroy the failed communicator", NULL);

  /* Abort while the init waits for its ranks: returns at once. */
  expect(p_ncclGetUniqueId(&id) == ncclSuccess, "ncclGetUniqueId", NULL);
  expect(p_ncclCommInitRankConfig(&a, 2, id, 0, &cfg) == ncclInProgress, "another lone init", NULL);
  const double t0 = test_now_s();
  expect(p_ncclCommAbort(a) == ncclSuccess && test_now_s() - t0 < 0.5,
         "ncclCommAbort during its init returns at once", NULL);
}

static void groups_and_refusals(ncclComm_t c) {
  ncclRedOp_t op;
  float x = 2;
  expect_error(p_ncclAllReduce(NULL, NULL, 4, ncclFloat8e4m3, ncclSum, c, NULL),
               ncclInvalidArgument, "ncclFloat8e4m3", "fp8 is refused naming the type");
  expect_error(p_ncclRedOpCreatePreMulSum(&op, &x, ncclFloat32, ncclScalarHostImmediate, c),
               ncclInvalidUsage, "CUDA device", "PreMulSum needs a device");
  expect_error(p_ncclRedOpDestroy(ncclSum, c), ncclInvalidArgument, "built-in",
               "ncclRedOpDestroy of a built-in op");
  ncclWindow_t w;
  expect_error(p_ncclCommWindowRegister(c, &x, 4, &w, 0), ncclInvalidUsage,
               "does not implement ncclCommWindowRegister", "ncclCommWindowRegister is refused");
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  expect_error(p_ncclGroupSimulateEnd(&sim), ncclInvalidUsage,
               "does not implement ncclGroupSimulateEnd", "ncclGroupSimulateEnd is refused");
  ncclComm_t s = NULL;
  expect_error(p_ncclCommShrink(c, NULL, 0, &s, NULL, 0), ncclInvalidUsage,
               "does not implement ncclCommShrink", "ncclCommShrink is refused");
  expect_error(p_ncclGroupEnd(), ncclInvalidUsage, "no ncclGroupStart",
               "ncclGroupEnd without ncclGroupStart");
  p_ncclGroupStart();
  p_ncclGroupStart();
  expect(p_ncclGroupEnd() == ncclSuccess && p_ncclGroupEnd() == ncclSuccess, "nested empty groups",
         NULL);
  p_ncclGroupStart();
  expect_error(p_ncclSend(&x, 1, ncclFloat32, 5, c, NULL), ncclInvalidArgument, "peer 5",
               "ncclSend to a peer that is not a rank");
  expect_error(p_ncclGroupEnd(), ncclInvalidArgument, NULL, "... fails its group's end");
  ncclResult_t state = ncclInternalError;
  p_ncclCommGetAsyncError(c, &state);
  expect(state == ncclSuccess, "refused calls leave the communicator usable", NULL);
}

static void with_daemon(const char* bin) {
  const char* sets[] = {"deadlines.rendezvous_ms=2000", "log.level=debug", NULL};
  test_daemon d;
  if (test_daemon_start(&d, bin, sets) != 0) {
    expect(0, "collectived starts", bin);
    return;
  }
  setenv("COLLECTIVED_SOCKET", d.socket, 1);
  setenv("COLLECTIVED_NCCL_HOST_ONLY", "1", 1);
  ncclUniqueId id;
  EXPECT_OK(p_ncclGetUniqueId(&id), 1, "ncclGetUniqueId from a real daemon");
  ncclComm_t c = NULL;
  EXPECT_OK(p_ncclCommInitRank(&c, 1, id, 0), c != NULL, "ncclCommInitRank, 1 rank");
  int n = 0, r = -1, dev = 7;
  ncclResult_t state = ncclInternalError;
  p_ncclCommCount(c, &n);
  p_ncclCommUserRank(c, &r);
  p_ncclCommCuDevice(c, &dev);
  p_ncclCommGetAsyncError(c, &state);
  expect(n == 1 && r == 0 && dev == -1 && state == ncclSuccess,
         "count 1, rank 0, no device, no error", NULL);
  groups_and_refusals(c);
  ncclComm_t child = NULL, none = (ncclComm_t)1;
  EXPECT_OK(p_ncclCommSplit(c, 0, 0, &child, NULL), child != NULL, "ncclCommSplit, one color");
  EXPECT_OK(p_ncclCommSplit(c, NCCL_SPLIT_NOCOLOR, 0, &none, NULL), none == NULL,
            "ncclCommSplit with NCCL_SPLIT_NOCOLOR gives NULL");
  expect(p_ncclCommDestroy(child) == ncclSuccess, "destroy the split", NULL);
  nonblocking();
  ncclComm_t all[2] = {NULL, NULL};
  EXPECT_OK(p_ncclCommInitAll(all, 2, NULL), all[0] && all[1],
            "ncclCommInitAll, 2 ranks in one process");
  for (int i = 0; i < 2; ++i) p_ncclCommDestroy(all[i]);
  /* nccl-tests' way with several GPUs per process: the inits of one thread in a group. */
  ncclComm_t g[2] = {NULL, NULL};
  int gn = 0;
  EXPECT_OK(p_ncclGetUniqueId(&id), 1, "ncclGetUniqueId");
  p_ncclGroupStart();
  const ncclResult_t g0 = p_ncclCommInitRank(&g[0], 2, id, 0);
  const ncclResult_t g1 = p_ncclCommInitRank(&g[1], 2, id, 1);
  EXPECT_OK(p_ncclGroupEnd(), g0 == ncclSuccess && g1 == ncclSuccess && g[0] && g[1],
            "2 ranks' ncclCommInitRank in one thread's group, done at ncclGroupEnd");
  p_ncclCommCount(g[1], &gn);
  expect(gn == 2, "... count 2", NULL);
  for (int i = 0; i < 2; ++i) p_ncclCommDestroy(g[i]);
  ncclUniqueId ids[2];
  p_ncclGetUniqueId(&ids[0]);
  p_ncclGetUniqueId(&ids[1]);
  ncclComm_t sc = NULL;
  EXPECT_OK(p_ncclCommInitRankScalable(&sc, 1, 0, 2, ids, NULL), sc,
            "ncclCommInitRankScalable with 2 ids");
  p_ncclCommDestroy(sc);
  EXPECT_OK(p_ncclCommFinalize(c), p_ncclCommDestroy(c) == ncclSuccess, "finalize and destroy");
  if (g_failed) test_daemon_dump_log(&d);
  test_daemon_stop(&d);
  /* The process's connection outlives its daemon: a new one is reached anew. */
  if (test_daemon_start(&d, bin, sets) != 0) {
    expect(0, "collectived starts again", bin);
    return;
  }
  setenv("COLLECTIVED_SOCKET", d.socket, 1);
  EXPECT_OK(p_ncclGetUniqueId(&id), 1, "ncclGetUniqueId after the daemon was replaced");
  EXPECT_OK(p_ncclCommInitRank(&c, 1, id, 0), c != NULL, "... and ncclCommInitRank on it");
  p_ncclCommDestroy(c);
  test_daemon_stop(&d);
}

/* A fresh process (the library reads NCCL_DEBUG once): its stderr must have
 * the INFO line and the ignored variables, once each. */
static void environment(const char* self, const char* lib, const char* bin) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "NCCL_DEBUG=INFO NCCL_IB_HCA=mlx5_0 NCCL_FOO=1 NCCL_VERSION=2.28.3-1 %s --env-child %s %s 2>&1", self, lib,
           bin);
  FILE* p = popen(cmd, "r");
  char out[8192] = {0};
  size_t got = p ? fread(out, 1, sizeof out - 1, p) : 0;
  out[got] = '\0';
  if (p) pclose(p);
  expect(strstr(out, "NCCL INFO collectived libnccl 2.28.9") != NULL,
         "NCCL_DEBUG=INFO: one line names the library and the daemon", out);
  expect(strstr(out, "NCCL_IB_HCA=mlx5_0 is ignored") && strstr(out, "verbs.hcas") &&
             strstr(out, "NCCL_FOO=1 is ignored") && !strstr(out, "NCCL_DEBUG=INFO is ignored") &&
             !strstr(out, "NCCL_VERSION"),
         "other NCCL_* variables are logged as ignored, with the profile key", out);
  printf("%s", out);
}

static int env_child(void) {
  ncclUniqueId id;
  p_ncclGetUniqueId(&id); /* fails (no daemon there): the environment is read anyway */
  p_ncclGetUniqueId(&id);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s LIBNCCL COLLECTIVED\n", argv[0]);
    return 2;
  }
  const int child = strcmp(argv[1], "--env-child") == 0;
  const char* lib = argv[child ? 2 : 1];
  const char* bin = argv[child ? 3 : 2];
  void* h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) {
    printf("FAIL - dlopen(%s, RTLD_NOW): %s\n", lib, dlerror());
    return 1;
  }
#define LOAD(f) p_##f = (__typeof__(&f))dlsym(h, #f);
  NCCL_CALLS(LOAD)
  if (child) return env_child();
  expect(1, "dlopen(RTLD_NOW) resolves every symbol", NULL);
  int v = 0;
  expect(p_ncclGetVersion(&v) == ncclSuccess && v == NCCL_VERSION_CODE && v == 22809,
         "ncclGetVersion is 22809", NULL);
  int strings = 1;
  for (int r = 0; r <= ncclNumResults; ++r) strings = strings && p_ncclGetErrorString(r) != NULL;
  expect(strings && strcmp(p_ncclGetErrorString(ncclSuccess), "no error") == 0 &&
             strcmp(p_ncclGetErrorString(ncclInProgress), "NCCL operation in progress") == 0,
         "ncclGetErrorString for every code", NULL);
  without_daemon();
  with_daemon(bin);
  environment(argv[0], lib, bin);
  printf("%s\n", g_failed ? "nccl_cpu_test: FAILED" : "nccl_cpu_test: all passed");
  return g_failed;
}
