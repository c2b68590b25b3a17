// GPUDirect RDMA detection: can an HCA read and write GPU memory directly?
// Two kernel routes exist:
//  * peer memory: the nvidia-peermem module (or Mellanox OFED's nv_peer_mem)
//    lets ibv_reg_mr take a GPU virtual address;
//  * dma-buf: the CUDA driver exports GPU memory as a dma-buf fd
//    (cuMemGetHandleForAddressRange) that ibv_reg_dmabuf_mr registers
//    (rdma-core >= 34, kernel >= 5.12).
// This only detects and explains; registering GPU memory is the CUDA side's job.
#pragma once

#include <optional>
#include <string>

namespace collectived::engine::transport::verbs {

class IbverbsLibrary;

struct GpuDirectStatus {
  bool enabled = false;        ///< some route works: register GPU memory directly
  bool peer_memory = false;    ///< a peer-memory module is loaded
  std::string peer_memory_module;  ///< which file said so, with its version
  bool dmabuf = false;         ///< libibverbs has ibv_reg_dmabuf_mr and CUDA can export dma-bufs
  std::string route;           ///< "peer memory", "dma-buf" or "host staging"
  std::string reason;          ///< one line: why this route (and why not the others)
};

/// Detects GPUDirect RDMA. `lib` may be null (no libibverbs). `cuda_dmabuf` is
/// whether the CUDA driver supports dma-buf export (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
/// and cuMemGetHandleForAddressRange); nullopt when not known (no GPU, no driver).
GpuDirectStatus detect_gpudirect(const IbverbsLibrary* lib, std::optional<bool> cuda_dmabuf,
                                 const std::string& sysfs_root = "/sys");

}  // namespace collectived::engine::transport::verbs
