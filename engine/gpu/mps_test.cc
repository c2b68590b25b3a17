// MpsControl's view of the node's MPS control daemon, without a GPU: the
// control endpoint in CUDA_MPS_PIPE_DIRECTORY is a FIFO in older drivers and
// a Unix socket in CUDA 13's nvidia-cuda-mps-control (seen on the GPU
// machine: "Starting control daemon using socket /tmp/nvidia-mps/control").
#include "engine/gpu/mps.h"

#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "engine/log.h"
#include "ipc/fd.h"
#include "tests/support/harness.h"

namespace gpu = collectived::engine::gpu;
using collectived::UniqueFd;
using collectived::engine::Logger;
using collectived::test::TempDir;

namespace {

/// A private CUDA_MPS_PIPE_DIRECTORY for the test's lifetime.
struct PipeDir {
  TempDir dir;
  PipeDir() { ::setenv("CUDA_MPS_PIPE_DIRECTORY", dir.path().c_str(), 1); }
  ~PipeDir() { ::unsetenv("CUDA_MPS_PIPE_DIRECTORY"); }
  const std::string& path() const { return dir.path(); }
  std::string control() const { return dir.file("control"); }
};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE(
    "the control endpoint: a Unix socket (CUDA 13) or a FIFO counts, anything else does not") {
  PipeDir dir;
  Logger log(collectived::config::LogLevel::error);
  CHECK(gpu::MpsControl::pipe_directory() == dir.path());
  CHECK_FALSE(gpu::MpsControl::running());
  CHECK(contains(gpu::MpsControl(log, "external").reason(),
                 "but no MPS control daemon answers at " + dir.path()));

  // A listening Unix socket, as nvidia-cuda-mps-control -d of CUDA 13 makes it.
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(fd.get() >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, dir.control().c_str(), sizeof addr.sun_path - 1);
  REQUIRE(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(fd.get(), 1) == 0);
  CHECK(gpu::MpsControl::running());
  CHECK(contains(gpu::MpsControl(log, "external").reason(),
                 "external (gpu.mps: external): an MPS control daemon answers"));
  // managed finds it and neither starts nor (at exit) stops one.
  CHECK(contains(gpu::MpsControl(log, "managed").reason(), "already answered at " + dir.path()));
  CHECK(contains(gpu::MpsControl(log, "off").reason(), "though an MPS control daemon answers"));
  fd.reset();
  std::filesystem::remove(dir.control());

  // A FIFO, as older drivers make it.
  REQUIRE(::mkfifo(dir.control().c_str(), 0600) == 0);
  CHECK(gpu::MpsControl::running());
  std::filesystem::remove(dir.control());

  // A regular file is not a control daemon.
  collectived::test::write_file(dir.control(), "");
  CHECK_FALSE(gpu::MpsControl::running());
  CHECK(contains(gpu::MpsControl(log, "off").reason(), "processes sharing a GPU time-slice it"));
}
