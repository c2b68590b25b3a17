#include "engine/gpu/mps.h"

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "engine/log.h"

extern char** environ;

namespace collectived::engine::gpu {

std::string MpsControl::pipe_directory() {
  const char* d = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  return d != nullptr && *d != '\0' ? d : "/tmp/nvidia-mps";
}

bool MpsControl::running() {
  // The control endpoint is a FIFO in older drivers and a Unix socket in
  // CUDA 13's nvidia-cuda-mps-control ("Starting control daemon using socket
  // .../control"): looking for a FIFO alone reported MPS as off while it ran.
  struct stat st{};
  return ::stat((pipe_directory() + "/control").c_str(), &st) == 0 &&
         (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode));
}

namespace {
// Runs nvidia-cuda-mps-control with `arg` and `stdin_text`; waits for it
// and returns its exit code when `wait`, else returns 0 once it started.
int run_control(const char* arg, const char* stdin_text, bool wait = true) {
  int in[2];
  if (::pipe(in) != 0) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_addclose(&fa, in[1]);
  char prog[] = "nvidia-cuda-mps-control";
  char a1[8] = "";
  char* argv[] = {prog, arg != nullptr ? const_cast<char*>(arg) : a1, nullptr};
  if (arg == nullptr) argv[1] = nullptr;
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, prog, &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(in[0]);
  if (rc != 0) {
    ::close(in[1]);
    return -1;
  }
  if (stdin_text != nullptr) {
    const std::string t = stdin_text;
    [[maybe_unused]] auto w = ::write(in[1], t.data(), t.size());
  }
  ::close(in[1]);
  if (!wait) return 0;
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
}  // namespace

MpsControl::MpsControl(Logger& log, std::string mode) : log_(log) {
  const std::string dir = pipe_directory();
  // CUDA contexts (the daemon's and the clients') join a control daemon that
  // answers in their pipe directory whatever gpu.mps says.
  active_ = running();
  if (mode == "off") {
    reason_ = running() ? "off (gpu.mps: off), though an MPS control daemon answers at " + dir +
                              ": clients that use it share the GPU through it"
                        : "off (gpu.mps: off): processes sharing a GPU time-slice it (a hand-off "
                          "between processes on one GPU costs ~140 us)";
    return;
  }
  if (mode == "external") {
    reason_ = running() ? "external (gpu.mps: external): an MPS control daemon answers at " + dir
                        : "external (gpu.mps: external), but no MPS control daemon answers at " +
                              dir + ": running without MPS";
    return;
  }
  // managed
  if (running()) {
    reason_ = "managed (gpu.mps: managed): an MPS control daemon already answered at " + dir +
              "; using it, and leaving it running at exit";
    return;
  }
  if (run_control("-d", nullptr) != 0) {
    reason_ = "managed (gpu.mps: managed), but nvidia-cuda-mps-control -d failed or is not "
              "installed: running without MPS";
    log_.warn("mps_start_failed", {{"pipe_directory", dir}});
    return;
  }
  for (int i = 0; i < 100 && !running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  started_ = running();
  active_ = started_;
  reason_ = started_ ? "managed (gpu.mps: managed): collectived started the MPS control daemon at " + dir
                     : "managed (gpu.mps: managed): nvidia-cuda-mps-control -d ran, but no control "
                       "pipe appeared at " + dir + ": running without MPS";
  log_.info("mps_started", {{"pipe_directory", dir}, {"running", started_}});
}

MpsControl::~MpsControl() {
  // Not waited for: "quit" waits for every MPS client to go, and this
  // process is one until it exits (its CUDA contexts live until then).
  // Waiting here hung the daemon's exit on the GPU machine; the control
  // daemon stops once this process is gone.
  if (started_) {
    run_control(nullptr, "quit\n", /*wait=*/false);
    log_.info("mps_stop_requested", {{"pipe_directory", pipe_directory()}});
  }
}

}  // namespace collectived::engine::gpu
