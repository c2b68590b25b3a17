// collectived's libnccl.so.2 on a GPU (label gpu): N ranks (2 or 3, the
// argument) as forked processes, all on GPU 0, one daemon; each rank calls
// NCCL's API through client/nccl/nccl.h and libnccl.so.2 (linked by soname:
// LD_LIBRARY_PATH chooses the library) and checks every result against a
// host reference (gpu_reference.h). Then a rank is killed mid-job and the
// others' ncclCommGetAsyncError must report it, naming the rank.
// Without a GPU it exits 77 (skipped).
//
// usage: nccl_gpu_test [NRANKS] [--daemon COLLECTIVED]
//   the daemon binary also comes from $COLLECTIVED_BIN; extra profile
//   overrides from $NCCL_TEST_DAEMON_SET (space-separated KEY=VALUE).
#include "tests/nccl/nccl_gpu_test.h"

#include <sys/mman.h>

#include <sstream>
#include <vector>

#ifndef COLLECTIVED_BIN_DEFAULT
#define COLLECTIVED_BIN_DEFAULT "collectived"
#endif

using namespace ncclt;

namespace {

/// In a child: CUDA must not be initialized in the parent of the ranks.
int gpu_count(std::string& why) {
  int pipefd[2];
  if (pipe(pipefd) != 0) return 0;
  const pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    char msg[256];
    const int len = std::snprintf(msg, sizeof msg, "%d %s", e == cudaSuccess ? n : 0,
                                  e == cudaSuccess ? "" : cudaGetErrorString(e));
    [[maybe_unused]] auto w = write(pipefd[1], msg, static_cast<std::size_t>(len));
    _exit(0);
  }
  close(pipefd[1]);
  char buf[256] = {0};
  [[maybe_unused]] auto r = read(pipefd[0], buf, sizeof buf - 1);
  close(pipefd[0]);
  waitpid(pid, nullptr, 0);
  const char* sp = std::strchr(buf, ' ');
  why = sp ? sp + 1 : "";
  return std::atoi(buf);
}

/// Forks one process per rank running `body`; true when all exit 0.
bool run_ranks(Shared* sh, int n, int (*body)(Shared*, int, int), const char* what) {
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(420);  // a hang fails the rank, with SIGALRM
      _exit(body(sh, r, n));
    }
    sh->pids[r] = pid;
    pids.push_back(pid);
  }
  bool ok = true;
  for (int r = 0; r < n; ++r) {
    int status = 0;
    waitpid(pids[static_cast<std::size_t>(r)], &status, 0);
    const bool killed_victim =
        sh->victim == r && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    if (killed_victim) continue;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::printf("FAIL %s: rank %d %s %d\n", what, r,
                  WIFEXITED(status) ? "exited with" : "was killed by signal",
                  WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      ok = false;
    }
  }
  return ok;
}

/// The failure case's parent side: kills the victim once the others have
/// submitted the operation it will never join.
void kill_victim(Shared* sh, int n) {
  const double until = now_s() + 120;
  while (now_s() < until && (sh->victim_ready.load() == 0 || sh->submitted.load() < n - 1)) {
    usleep(1000);
  }
  usleep(200000);
  kill(sh->pids[sh->victim], SIGKILL);
  sh->killed_at = now_s();
  sh->victim_dead.store(1);
}

}  // namespace

int main(int argc, char** argv) {
  int n = 2;
  std::string daemon_bin =
      std::getenv("COLLECTIVED_BIN") ? std::getenv("COLLECTIVED_BIN") : COLLECTIVED_BIN_DEFAULT;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--daemon") == 0 && i + 1 < argc) {
      daemon_bin = argv[++i];
    } else {
      n = std::atoi(argv[i]);
    }
  }
  if (n < 2 || n > kMaxRanks) {
    std::fprintf(stderr, "usage: nccl_gpu_test [2..%d] [--daemon COLLECTIVED]\n", kMaxRanks);
    return 2;
  }
  std::string why;
  if (gpu_count(why) == 0) {
    std::printf("SKIPPED: no GPU on this machine (%s); the GPU tests (ctest -L gpu) need one\n",
                why.empty() ? "the driver sees no device" : why.c_str());
    return 77;
  }
  std::vector<std::string> sets = {"deadlines.operation_ms=10000", "log.level=info"};
  if (const char* extra = std::getenv("NCCL_TEST_DAEMON_SET")) {
    std::istringstream in(extra);
    for (std::string kv; in >> kv;) sets.push_back(kv);
  }
  std::vector<const char*> cset;
  for (const auto& s : sets) cset.push_back(s.c_str());
  cset.push_back(nullptr);
  test_daemon d;
  if (test_daemon_start(&d, daemon_bin.c_str(), cset.data()) != 0) {
    std::printf("FAIL: collectived (%s) did not start\n", daemon_bin.c_str());
    return 1;
  }
  setenv("COLLECTIVED_SOCKET", d.socket, 1);
  void* mem =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  auto* sh = new (mem) Shared();
  std::printf("nccl_gpu_test: %d ranks on GPU 0, daemon %s\n", n, d.socket);
  const double t0 = now_s();
  bool ok = run_ranks(sh, n, rank_main, "the calls");
  std::printf("nccl_gpu_test: the calls: %s in %.1f s\n", ok ? "passed" : "FAILED", now_s() - t0);
  sh->~Shared();
  sh = new (mem) Shared();
  sh->victim = n - 1;
  std::fflush(nullptr);
  const pid_t killer = fork();
  if (killer == 0) {
    kill_victim(sh, n);
    _exit(0);
  }
  const bool failure_ok = run_ranks(sh, n, failure_rank, "a killed rank");
  waitpid(killer, nullptr, 0);
  std::printf("nccl_gpu_test: a killed rank: %s\n", failure_ok ? "passed" : "FAILED");
  if (!ok || !failure_ok) test_daemon_dump_log(&d);
  test_daemon_stop(&d);
  return ok && failure_ok ? 0 : 1;
}
