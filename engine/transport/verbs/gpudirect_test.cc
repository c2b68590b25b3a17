#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "engine/transport/verbs/gpudirect.h"
#include "engine/transport/verbs/ibverbs_library.h"
#include "ipc/error.h"

namespace v = collectived::engine::transport::verbs;

namespace {
struct TempDir {
  std::filesystem::path root =
      std::filesystem::temp_directory_path() / ("gdr-sysfs-" + std::to_string(::getpid()));
  TempDir() { std::filesystem::remove_all(root); std::filesystem::create_directories(root); }
  ~TempDir() { std::filesystem::remove_all(root); }
  void write(const std::string& rel, const std::string& text) const {
    std::filesystem::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  }
};
bool contains(const std::string& s, std::string_view p) { return s.find(p) != std::string::npos; }
}  // namespace

TEST_CASE("no peer memory, no libibverbs: host staging, and the reason says why") {
  TempDir sys;
  const v::GpuDirectStatus s = v::detect_gpudirect(nullptr, std::nullopt, sys.root.string());
  CHECK(!s.enabled);
  CHECK(s.route == "host staging");
  CHECK(contains(s.reason, "nvidia_peermem"));
  CHECK(contains(s.reason, "no libibverbs"));
}

TEST_CASE("nvidia_peermem loaded: peer memory route, naming the module and version") {
  TempDir sys;
  sys.write("module/nvidia_peermem/version", "535.104.05\n");
  const v::GpuDirectStatus s = v::detect_gpudirect(nullptr, std::nullopt, sys.root.string());
  CHECK(s.enabled);
  CHECK(s.peer_memory);
  CHECK(s.route == "peer memory");
  CHECK(contains(s.reason, "535.104.05"));
}

TEST_CASE("MLNX_OFED nv_peer_mem is recognised too") {
  TempDir sys;
  sys.write("kernel/mm/memory_peers/nv_mem/version", "1.3-0\n");
  CHECK(v::detect_gpudirect(nullptr, std::nullopt, sys.root.string()).peer_memory);
}

TEST_CASE("dma-buf: needs ibv_reg_dmabuf_mr and the CUDA driver's export") {
  std::shared_ptr<const v::IbverbsLibrary> lib;
  try {
    lib = v::IbverbsLibrary::load();
  } catch (const collectived::Error& e) {
    MESSAGE("libibverbs absent: " << e.what());
    return;
  }
  TempDir sys;
  const v::GpuDirectStatus yes = v::detect_gpudirect(lib.get(), true, sys.root.string());
  CHECK(yes.enabled == lib->has_dmabuf());
  if (lib->has_dmabuf()) CHECK(yes.route == "dma-buf");
  const v::GpuDirectStatus no = v::detect_gpudirect(lib.get(), false, sys.root.string());
  CHECK(!no.enabled);
  CHECK(contains(no.reason, "does not export dma-bufs"));
  const v::GpuDirectStatus unknown = v::detect_gpudirect(lib.get(), std::nullopt, sys.root.string());
  CHECK(contains(unknown.reason, "unknown"));
}
