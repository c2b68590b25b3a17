// What every part of the CUDA executor (runtime.cc) uses: CUDA runtime
// errors as Errors that say what failed, and where a GPU addresses a span.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

#include "engine/gpu/cuda_driver.h"
#include "engine/gpu/executor.h"
#include "ipc/error.h"

namespace collectived::engine::gpu {

inline void check_rt(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) {
    throw Error(Code::system,
                what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

/// Where GPU `dev` addresses the bytes of span `sp` (its registration mapped
/// on that GPU, peer mappings included); null where the span has no memory.
inline std::byte* on_device(const Span& sp, int dev) {
  if (!sp.reg) return nullptr;
  return sp.reg->device->data_on(dev) + (sp.ptr - sp.reg->device->data());
}

}  // namespace collectived::engine::gpu
