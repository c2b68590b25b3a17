// MpsControl's view of the node's MPS control daemon, without a GPU: the
// control endpoint in CUDA_MPS_PIPE_DIRECTORY is a FIFO in older drivers and
// a Unix socket in CUDA 13's nvidia-cuda-mps-control (seen on the GPU
// machine: "Starting control daemon using socket /tmp/nvidia-mps/control").
#include "engine/gpu/mps.h"

#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "engine/log.h"

namespace gpu = collectived::engine::gpu;
using collectived::engine::Logger;

namespace {

struct PipeDir {
  std::string path;
  PipeDir() {
    char tmpl[] = "/tmp/mps_test.XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
    ::setenv("CUDA_MPS_PIPE_DIRECTORY", path.c_str(), 1);
  }
  ~PipeDir() {
    ::unsetenv("CUDA_MPS_PIPE_DIRECTORY");
    std::filesystem::remove_all(path);
  }
  std::string control() const { return path + "/control"; }
};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE(
    "the control endpoint: a Unix socket (CUDA 13) or a FIFO counts, anything else does not") {
  PipeDir dir;
  Logger log(collectived::config::LogLevel::error);
  CHECK(gpu::MpsControl::pipe_directory() == dir.path);
  CHECK_FALSE(gpu::MpsControl::running());
  CHECK(contains(gpu::MpsControl(log, "external").reason(),
                 "but no MPS control daemon answers at " + dir.path));

  // A listening Unix socket, as nvidia-cuda-mps-control -d of CUDA 13 makes it.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, dir.control().c_str(), sizeof addr.sun_path - 1);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  CHECK(gpu::MpsControl::running());
  CHECK(contains(gpu::MpsControl(log, "external").reason(),
                 "external (gpu.mps: external): an MPS control daemon answers"));
  // managed finds it and neither starts nor (at exit) stops one.
  CHECK(contains(gpu::MpsControl(log, "managed").reason(), "already answered at " + dir.path));
  CHECK(contains(gpu::MpsControl(log, "off").reason(), "though an MPS control daemon answers"));
  ::close(fd);
  std::filesystem::remove(dir.control());

  // A FIFO, as older drivers make it.
  REQUIRE(::mkfifo(dir.control().c_str(), 0600) == 0);
  CHECK(gpu::MpsControl::running());
  std::filesystem::remove(dir.control());

  // A regular file is not a control daemon.
  {
    FILE* f = std::fopen(dir.control().c_str(), "w");
    REQUIRE(f != nullptr);
    std::fclose(f);
  }
  CHECK_FALSE(gpu::MpsControl::running());
  CHECK(contains(gpu::MpsControl(log, "off").reason(), "processes sharing a GPU time-slice it"));
}
