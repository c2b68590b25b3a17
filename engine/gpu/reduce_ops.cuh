// The reductions of engine/reduce.h on the GPU (nvcc, C++17): element
// traits (float16/bfloat16 accumulated in float, rounded once), combine in
// rank order, avg's division, and 16-byte packs. Shared by the daemon's
// kernels (engine/gpu/kernels.cu) and the kernels libcollective launches on
// the caller's stream (client/direct_kernels.cu), so both give the host
// kernels' results bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "engine/gpu/kernels.h"

namespace collectived::engine::gpu::kernels {

template <typename T>
struct Traits {
  using Acc = T;
  __device__ static Acc load(T v) { return v; }
  __device__ static T store(Acc a) { return a; }
};
template <>
struct Traits<__half> {
  using Acc = float;
  __device__ static Acc load(__half v) { return __half2float(v); }
  __device__ static __half store(Acc a) { return __float2half_rn(a); }
};
template <>
struct Traits<__nv_bfloat16> {
  using Acc = float;
  __device__ static Acc load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(Acc a) { return __float2bfloat16_rn(a); }
};

// The order and rules of engine/reduce.h: acc = src[0]; acc = op(acc, src[k]).
template <typename T, RedOp O>
__device__ __forceinline__ typename Traits<T>::Acc combine(typename Traits<T>::Acc acc,
                                                            typename Traits<T>::Acc x) {
  using Acc = typename Traits<T>::Acc;
  if constexpr (O == RedOp::sum || O == RedOp::avg) {
    if constexpr (std::is_integral_v<Acc>) {
      using U = std::make_unsigned_t<Acc>;
      return static_cast<Acc>(static_cast<U>(static_cast<U>(acc) + static_cast<U>(x)));
    } else {
      return acc + x;
    }
  } else if constexpr (O == RedOp::prod) {
    if constexpr (std::is_integral_v<Acc>) {
      using U = std::make_unsigned_t<Acc>;
      return static_cast<Acc>(static_cast<U>(static_cast<U>(acc) * static_cast<U>(x)));
    } else {
      return acc * x;
    }
  } else if constexpr (O == RedOp::min) {
    return (x < acc) ? x : acc;
  } else {
    return (x > acc) ? x : acc;
  }
}

template <typename T, RedOp O>
__device__ __forceinline__ T finish(typename Traits<T>::Acc acc, std::uint32_t divisor) {
  using Acc = typename Traits<T>::Acc;
  if constexpr (O == RedOp::avg) {
    if constexpr (std::is_integral_v<Acc>) {
      if constexpr (std::is_signed_v<Acc>) {
        return static_cast<T>(static_cast<long long>(acc) / static_cast<long long>(divisor));
      } else {
        return static_cast<T>(static_cast<unsigned long long>(acc) /
                              static_cast<unsigned long long>(divisor));
      }
    } else {
      return Traits<T>::store(acc / static_cast<Acc>(divisor));
    }
  } else {
    return Traits<T>::store(acc);
  }
}

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

}  // namespace collectived::engine::gpu::kernels
