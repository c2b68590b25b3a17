// CUDA kernels of the GPU executor: element-wise reductions of any number of
// sources into any number of destinations, and lists of copies. Every pointer
// is a device address in the daemon (its own, or a peer GPU's mapped over
// NVLink), so one kernel reads the ranks' buffers directly where they live.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>


namespace collectived::engine::gpu::kernels {

/// Element types and reductions: the values of engine/dtype.h's DType and RedOp
/// (stable wire values). The kernels are C++17 (nvcc), which that header is not.
enum class DType : std::uint8_t {
  int8 = 0, uint8 = 1, int32 = 2, uint32 = 3, int64 = 4, uint64 = 5,
  float16 = 6, bfloat16 = 7, float32 = 8, float64 = 9,
};
enum class RedOp : std::uint8_t { sum = 0, prod = 1, min = 2, max = 3, avg = 4 };

/// Pointers one launch carries (kernel parameters, 1 KiB).
inline constexpr int kMaxKernelPointers = 64;

struct ReduceLaunch {
  const void* src[kMaxKernelPointers];
  void* dst[kMaxKernelPointers];
  int nsrc = 0;
  int ndst = 0;
  std::uint64_t count = 0;        ///< elements from each pointer
  std::uint32_t avg_divisor = 1;  ///< number of ranks, for avg
};

/// dst[j][i] = op(src[0][i], ..., src[nsrc-1][i]) for i < count, with the
/// semantics of engine/reduce.h (bit-exact: same order, float16/bfloat16 in
/// float rounded once). A destination may be a source (in place). Returns the
/// launch's error.
cudaError_t launch_reduce(DType dtype, RedOp op, const ReduceLaunch& args, int max_blocks,
                          cudaStream_t stream);

struct CopyLaunch {
  const void* src[kMaxKernelPointers];
  void* dst[kMaxKernelPointers];
  int n = 0;
  std::uint64_t bytes = 0;  ///< bytes of every pair
};

/// Copies `bytes` from src[k] to dst[k] for every k (pairs must not overlap).
cudaError_t launch_copy(const CopyLaunch& args, int max_blocks, cudaStream_t stream);

/// Two copies done together, element by element: for every k and byte i,
/// a = src_a[k][i] and b = src_b[k][i] are read before dst_a[k][i] = a and
/// dst_b[k][i] = b are written. In-place all-to-all: the block rank i sends to
/// rank j and the one j sends to i swap places even where a destination is
/// the other copy's source.
struct ExchangeLaunch {
  static constexpr int kMax = kMaxKernelPointers / 2;
  const void* src_a[kMax];
  void* dst_a[kMax];
  const void* src_b[kMax];
  void* dst_b[kMax];
  int n = 0;
  std::uint64_t bytes = 0;  ///< bytes of every copy
};
cudaError_t launch_exchange(const ExchangeLaunch& args, int max_blocks, cudaStream_t stream);

}  // namespace collectived::engine::gpu::kernels
