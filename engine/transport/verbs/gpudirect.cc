#include "engine/transport/verbs/gpudirect.h"

#include <filesystem>
#include <fstream>

#include "engine/transport/verbs/ibverbs_library.h"

namespace collectived::engine::transport::verbs {

GpuDirectStatus detect_gpudirect(const IbverbsLibrary* lib, std::optional<bool> cuda_dmabuf,
                                 const std::string& sysfs_root) {
  GpuDirectStatus s;
  // Each file exists while its module is loaded; the content is the version.
  const char* kPeerFiles[] = {"kernel/mm/memory_peers/nv_mem/version",
                              "kernel/mm/memory_peers/nv_mem_nc/version",
                              "module/nvidia_peermem/version"};
  for (const char* rel : kPeerFiles) {
    const std::filesystem::path path = std::filesystem::path(sysfs_root) / rel;
    std::ifstream in(path);
    if (!in) continue;
    std::string version;
    std::getline(in, version);
    s.peer_memory = true;
    s.peer_memory_module = path.string() + (version.empty() ? "" : " (version " + version + ")");
    break;
  }
  const bool lib_dmabuf = lib != nullptr && lib->has_dmabuf();
  s.dmabuf = lib_dmabuf && cuda_dmabuf.value_or(false);

  std::string why_not_peer =
      "no peer-memory module (" + sysfs_root +
      "/module/nvidia_peermem/version and " + sysfs_root +
      "/kernel/mm/memory_peers/nv_mem{,_nc}/version absent: modprobe nvidia-peermem)";
  std::string why_not_dmabuf;
  if (lib == nullptr) {
    why_not_dmabuf = "no libibverbs";
  } else if (!lib_dmabuf) {
    why_not_dmabuf = lib->path() + " has no ibv_reg_dmabuf_mr (rdma-core < 34)";
  } else if (!cuda_dmabuf.has_value()) {
    why_not_dmabuf = "CUDA dma-buf export unknown (no GPU or no CUDA driver)";
  } else if (!*cuda_dmabuf) {
    why_not_dmabuf = "the CUDA driver/GPU does not export dma-bufs (needs driver >= 515, kernel >= 5.12)";
  }

  if (s.peer_memory) {
    s.enabled = true;
    s.route = "peer memory";
    s.reason = "GPU memory registered directly through " + s.peer_memory_module;
  } else if (s.dmabuf) {
    s.enabled = true;
    s.route = "dma-buf";
    s.reason = "GPU memory registered directly as dma-buf (ibv_reg_dmabuf_mr); " + why_not_peer;
  } else {
    s.route = "host staging";
    s.reason = "GPUDirect RDMA off, GPU data staged through the host pool: " + why_not_peer +
               "; dma-buf: " + why_not_dmabuf;
  }
  return s;
}

}  // namespace collectived::engine::transport::verbs
