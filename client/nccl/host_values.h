// Host-side element access by NCCL type: the size, and one element read or
// written as a double (float16 and bfloat16 through ipc/half.h). Shared by
// nccl-perf and the GPU test (tests/nccl), which check results on the host.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "client/nccl/nccl.h"
#include "ipc/half.h"

namespace collectived::client::nccl {

inline std::size_t host_type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    default:
      return 8;
  }
}

namespace detail {
template <typename T>
void put(char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename T>
T get(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
}  // namespace detail

/// Element `i` of `base` (type `t`) set to `v`, converted as a C cast does.
inline void host_store(ncclDataType_t t, void* base, std::size_t i, double v) {
  using detail::put;
  char* p = static_cast<char*>(base) + i * host_type_size(t);
  switch (t) {
    case ncclInt8: put(p, static_cast<std::int8_t>(v)); break;
    case ncclUint8: put(p, static_cast<std::uint8_t>(v)); break;
    case ncclInt32: put(p, static_cast<std::int32_t>(v)); break;
    case ncclUint32: put(p, static_cast<std::uint32_t>(v)); break;
    case ncclInt64: put(p, static_cast<std::int64_t>(v)); break;
    case ncclUint64: put(p, static_cast<std::uint64_t>(v)); break;
    case ncclFloat16: put(p, f32_to_f16(static_cast<float>(v))); break;
    case ncclBfloat16: put(p, f32_to_bf16(static_cast<float>(v))); break;
    case ncclFloat32: put(p, static_cast<float>(v)); break;
    default: put(p, v); break;
  }
}

/// Element `i` of `base` (type `t`) as a double.
inline double host_load(ncclDataType_t t, const void* base, std::size_t i) {
  using detail::get;
  const char* p = static_cast<const char*>(base) + i * host_type_size(t);
  switch (t) {
    case ncclInt8: return get<std::int8_t>(p);
    case ncclUint8: return get<std::uint8_t>(p);
    case ncclInt32: return get<std::int32_t>(p);
    case ncclUint32: return get<std::uint32_t>(p);
    case ncclInt64: return static_cast<double>(get<std::int64_t>(p));
    case ncclUint64: return static_cast<double>(get<std::uint64_t>(p));
    case ncclFloat16: return f16_to_f32(get<std::uint16_t>(p));
    case ncclBfloat16: return bf16_to_f32(get<std::uint16_t>(p));
    case ncclFloat32: return get<float>(p);
    default: return get<double>(p);
  }
}

}  // namespace collectived::client::nccl
