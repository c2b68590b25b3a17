// The CUDA allocations a GPU buffer lies in. Usually one; with PyTorch's
// expandable segments (cuMemCreate chunks, each its own allocation, mapped
// back to back into one reserved range) a tensor may span several, which the
// client then registers with the daemon as one registration of several
// pieces (client/gpu.cc), checks for staleness piece by piece, and its own
// kernels and staging copies read through as one range.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/gpu/cuda_driver.h"
#include "ipc/fd.h"

namespace collectived::client {

// The CUDA driver loader (engine/gpu/cuda_driver.h), a leaf library the client links.
namespace gpu = engine::gpu;

/// One allocation under a buffer: where it starts, from the first one's
/// base; its bytes; its CU_POINTER_ATTRIBUTE_BUFFER_ID (a new one after the
/// memory there was freed, or unmapped and another allocation mapped).
struct GpuPiece {
  std::uint64_t offset = 0, size = 0, buffer_id = 0;
  bool operator==(const GpuPiece&) const = default;
};

/// The allocation(s) under [p, p + bytes): `base` is the first one's, `size`
/// all of theirs, `pieces` one per allocation, in address order.
struct GpuExtent {
  gpu::cu::DevicePtr base = 0;
  std::uint64_t size = 0;
  std::vector<GpuPiece> pieces;
  std::uint64_t buffer_id() const { return pieces.front().buffer_id; }
};

/// The allocation holding `p` and, where [p, p + bytes) runs past its end,
/// the allocations mapped right after it, each virtual-memory memory
/// (cuMemCreate: not cudaMalloc, not pool memory) of the same GPU, until the
/// buffer is covered. Throws Error(invalid_argument), naming the `which`
/// buffer, where it runs past the end of mapped memory or into memory of
/// another kind or GPU. `p` must be device memory the driver knows.
GpuExtent gpu_extent(const gpu::CudaDriver& cu, gpu::cu::DevicePtr p, std::uint64_t bytes,
                     const char* which);

/// Whether `registered` (the pieces of a registration made at `now.base`)
/// are still the allocations there: `now`'s pieces equal its first ones
/// (same places, sizes and buffer ids), and every piece past those is still
/// mapped as it was. False also where the registration is shorter than `now`.
bool gpu_pieces_current(const gpu::CudaDriver& cu, const std::vector<GpuPiece>& registered,
                        const GpuExtent& now);

/// The virtual-memory allocation mapped at `at` exported as a POSIX file
/// descriptor (cuMemExportToShareableHandle), for SCM_RIGHTS. Throws
/// Error(invalid_argument) naming `where` and the flag to set where it
/// cannot be exported.
UniqueFd export_vmm_fd(const gpu::CudaDriver& cu, gpu::cu::DevicePtr at, const std::string& where);

}  // namespace collectived::client
