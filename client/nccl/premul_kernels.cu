// ncclRedOpCreatePreMulSum's factor: out[i] = in[i] * scalar, one kernel per
// element type, on the caller's stream before the sum (client/nccl/premul.cc).
// Built into a fatbin that libnccl carries and loads with cuModuleLoadData,
// as libcollective does with its own kernels: no CUDA runtime is linked.
// The product follows engine/reduce.h's rules (float16 and bfloat16 in
// float, rounded once; integers wrap).
#include "engine/gpu/reduce_ops.cuh"

namespace {

using collectived::engine::gpu::kernels::combine;
using collectived::engine::gpu::kernels::RedOp;
using collectived::engine::gpu::kernels::Traits;
using u64 = unsigned long long;

/// `device`: the scalar in device memory, read as the kernel runs
/// (ncclScalarDevice); else the bits of the host value given at creation.
template <typename T>
__device__ void premul(const void* in, void* out, u64 n, const void* device, u64 bits) {
  T s;
  if (device != nullptr) {
    s = *static_cast<const T*>(device);
  } else {
    memcpy(&s, &bits, sizeof(T));
  }
  using A = typename Traits<T>::Acc;
  const A f = Traits<T>::load(s);
  const T* src = static_cast<const T*>(in);
  T* dst = static_cast<T*>(out);
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  for (u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = Traits<T>::store(combine<T, RedOp::prod>(Traits<T>::load(src[i]), f));
  }
}

}  // namespace

// Names in collective_dtype_t order (client/collective.h).
#define COLLECTIVED_PREMUL(name, T)                                                      \
  extern "C" __global__ void collectived_nccl_premul_##name(const void* in, void* out,   \
                                                            u64 n, const void* device,   \
                                                            u64 bits) {                  \
    premul<T>(in, out, n, device, bits);                                                 \
  }
COLLECTIVED_PREMUL(int8, signed char)
COLLECTIVED_PREMUL(uint8, unsigned char)
COLLECTIVED_PREMUL(int32, int)
COLLECTIVED_PREMUL(uint32, unsigned int)
COLLECTIVED_PREMUL(int64, long long)
COLLECTIVED_PREMUL(uint64, unsigned long long)
COLLECTIVED_PREMUL(float16, __half)
COLLECTIVED_PREMUL(bfloat16, __nv_bfloat16)
COLLECTIVED_PREMUL(float32, float)
COLLECTIVED_PREMUL(float64, double)
