#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "engine/gpu/kernels.h"
#include "engine/gpu/reduce_ops.cuh"

namespace collectived::engine::gpu::kernels {
namespace {

constexpr int kThreads = 512;

// V elements per thread and step: 16-byte loads and stores when every pointer
// is 16-byte aligned (V = 16 / sizeof(T)), else V = 1.
template <typename T, RedOp O, int V>
__global__ void __launch_bounds__(kThreads) reduce_kernel(ReduceLaunch a) {
  using Acc = typename Traits<T>::Acc;
  using P = Pack<T, V>;
  const std::uint64_t packs = a.count / V;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < packs; i += stride) {
    Acc acc[V];
    {
      const P p = static_cast<const P*>(a.src[0])[i];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = Traits<T>::load(p.v[k]);
    }
    for (int s = 1; s < a.nsrc; ++s) {
      const P p = static_cast<const P*>(a.src[s])[i];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = combine<T, O>(acc[k], Traits<T>::load(p.v[k]));
    }
    P out;
#pragma unroll
    for (int k = 0; k < V; ++k) out.v[k] = finish<T, O>(acc[k], a.avg_divisor);
    for (int d = 0; d < a.ndst; ++d) static_cast<P*>(a.dst[d])[i] = out;
  }
}

__global__ void __launch_bounds__(kThreads) copy_kernel16(CopyLaunch a) {
  const int k = blockIdx.y;
  const std::uint64_t n = a.bytes / 16;
  const uint4* src = static_cast<const uint4*>(a.src[k]);
  uint4* dst = static_cast<uint4*>(a.dst[k]);
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    dst[i] = src[i];
  }
}

__global__ void __launch_bounds__(kThreads) copy_kernel1(CopyLaunch a) {
  const int k = blockIdx.y;
  const auto* src = static_cast<const unsigned char*>(a.src[k]);
  auto* dst = static_cast<unsigned char*>(a.dst[k]);
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < a.bytes; i += stride) {
    dst[i] = src[i];
  }
}

template <typename W>
__global__ void __launch_bounds__(kThreads) exchange_kernel(ExchangeLaunch a) {
  const int k = blockIdx.y;
  const std::uint64_t n = a.bytes / sizeof(W);
  const W* sa = static_cast<const W*>(a.src_a[k]);
  const W* sb = static_cast<const W*>(a.src_b[k]);
  W* da = static_cast<W*>(a.dst_a[k]);
  W* db = static_cast<W*>(a.dst_b[k]);
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    const W x = sa[i];
    const W y = sb[i];
    da[i] = x;
    db[i] = y;
  }
}

unsigned blocks_for(std::uint64_t items, int max_blocks) {
  std::uint64_t b = (items + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  if (b > static_cast<std::uint64_t>(max_blocks)) b = max_blocks;
  return static_cast<unsigned>(b);
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15) == 0; }

template <typename T, RedOp O>
cudaError_t reduce_typed(const ReduceLaunch& a, int max_blocks, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  bool vec = a.count % V == 0;
  for (int s = 0; s < a.nsrc && vec; ++s) vec = aligned16(a.src[s]);
  for (int d = 0; d < a.ndst && vec; ++d) vec = aligned16(a.dst[d]);
  if (vec) {
    reduce_kernel<T, O, V><<<blocks_for(a.count / V, max_blocks), kThreads, 0, stream>>>(a);
  } else {
    reduce_kernel<T, O, 1><<<blocks_for(a.count, max_blocks), kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t reduce_op(RedOp op, const ReduceLaunch& a, int max_blocks, cudaStream_t stream) {
  switch (op) {
    case RedOp::sum: return reduce_typed<T, RedOp::sum>(a, max_blocks, stream);
    case RedOp::prod: return reduce_typed<T, RedOp::prod>(a, max_blocks, stream);
    case RedOp::min: return reduce_typed<T, RedOp::min>(a, max_blocks, stream);
    case RedOp::max: return reduce_typed<T, RedOp::max>(a, max_blocks, stream);
    case RedOp::avg: return reduce_typed<T, RedOp::avg>(a, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_reduce(DType dtype, RedOp op, const ReduceLaunch& a, int max_blocks,
                          cudaStream_t stream) {
  if (a.count == 0) return cudaSuccess;
  switch (dtype) {
    case DType::int8: return reduce_op<std::int8_t>(op, a, max_blocks, stream);
    case DType::uint8: return reduce_op<std::uint8_t>(op, a, max_blocks, stream);
    case DType::int32: return reduce_op<std::int32_t>(op, a, max_blocks, stream);
    case DType::uint32: return reduce_op<std::uint32_t>(op, a, max_blocks, stream);
    case DType::int64: return reduce_op<long long>(op, a, max_blocks, stream);
    case DType::uint64: return reduce_op<unsigned long long>(op, a, max_blocks, stream);
    case DType::float16: return reduce_op<__half>(op, a, max_blocks, stream);
    case DType::bfloat16: return reduce_op<__nv_bfloat16>(op, a, max_blocks, stream);
    case DType::float32: return reduce_op<float>(op, a, max_blocks, stream);
    case DType::float64: return reduce_op<double>(op, a, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy(const CopyLaunch& a, int max_blocks, cudaStream_t stream) {
  if (a.bytes == 0 || a.n == 0) return cudaSuccess;
  bool vec = a.bytes % 16 == 0;
  for (int k = 0; k < a.n && vec; ++k) vec = aligned16(a.src[k]) && aligned16(a.dst[k]);
  const int per_pair = max_blocks / a.n > 0 ? max_blocks / a.n : 1;
  if (vec) {
    dim3 grid(blocks_for(a.bytes / 16, per_pair), a.n);
    copy_kernel16<<<grid, kThreads, 0, stream>>>(a);
  } else {
    dim3 grid(blocks_for(a.bytes, per_pair), a.n);
    copy_kernel1<<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

cudaError_t launch_exchange(const ExchangeLaunch& a, int max_blocks, cudaStream_t stream) {
  if (a.bytes == 0 || a.n == 0) return cudaSuccess;
  bool vec = a.bytes % 16 == 0;
  for (int k = 0; k < a.n && vec; ++k) {
    vec = aligned16(a.src_a[k]) && aligned16(a.dst_a[k]) && aligned16(a.src_b[k]) &&
          aligned16(a.dst_b[k]);
  }
  const int per_pair = max_blocks / a.n > 0 ? max_blocks / a.n : 1;
  if (vec) {
    dim3 grid(blocks_for(a.bytes / 16, per_pair), a.n);
    exchange_kernel<uint4><<<grid, kThreads, 0, stream>>>(a);
  } else {
    dim3 grid(blocks_for(a.bytes, per_pair), a.n);
    exchange_kernel<unsigned char><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace collectived::engine::gpu::kernels
