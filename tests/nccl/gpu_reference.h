// Host side of tests/nccl/nccl_gpu_test.cc: element types as NCCL names
// them, the values each rank contributes, and the expected results. Values
// are small integers, so every sum, product and scaling is exact in every
// type; only avg's division leaves a remainder, compared with a tolerance
// of the type's precision.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "client/nccl/nccl.h"

namespace ncclt {

constexpr ncclDataType_t kTypes[] = {ncclInt8,    ncclUint8,  ncclInt32,   ncclUint32,
                                     ncclInt64,   ncclUint64, ncclFloat16, ncclBfloat16,
                                     ncclFloat32, ncclFloat64};

/// The reductions under test: NCCL's five, and PreMulSum by a host (x2) and
/// a device (x3) scalar.
enum class Op { sum, prod, min, max, avg, premul_host, premul_device };
constexpr Op kOps[] = {Op::sum, Op::prod,        Op::min,          Op::max,
                       Op::avg, Op::premul_host, Op::premul_device};
constexpr double kHostScalar = 2, kDeviceScalar = 3;

inline const char* type_name(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
      return "int8";
    case ncclUint8:
      return "uint8";
    case ncclInt32:
      return "int32";
    case ncclUint32:
      return "uint32";
    case ncclInt64:
      return "int64";
    case ncclUint64:
      return "uint64";
    case ncclFloat16:
      return "float16";
    case ncclBfloat16:
      return "bfloat16";
    case ncclFloat32:
      return "float32";
    case ncclFloat64:
      return "float64";
    default:
      return "?";
  }
}

inline const char* op_name(Op op) {
  switch (op) {
    case Op::sum:
      return "sum";
    case Op::prod:
      return "prod";
    case Op::min:
      return "min";
    case Op::max:
      return "max";
    case Op::avg:
      return "avg";
    case Op::premul_host:
      return "premulsum(host x2)";
    case Op::premul_device:
      return "premulsum(device x3)";
  }
  return "?";
}

inline std::size_t type_size(ncclDataType_t t) {
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

inline bool is_float(ncclDataType_t t) {
  return t == ncclFloat16 || t == ncclBfloat16 || t == ncclFloat32 || t == ncclFloat64;
}

inline void store(ncclDataType_t t, void* base, std::size_t i, double v) {
  char* p = static_cast<char*>(base) + i * type_size(t);
  switch (t) {
    case ncclInt8:
      *reinterpret_cast<std::int8_t*>(p) = static_cast<std::int8_t>(v);
      break;
    case ncclUint8:
      *reinterpret_cast<std::uint8_t*>(p) = static_cast<std::uint8_t>(v);
      break;
    case ncclInt32:
      *reinterpret_cast<std::int32_t*>(p) = static_cast<std::int32_t>(v);
      break;
    case ncclUint32:
      *reinterpret_cast<std::uint32_t*>(p) = static_cast<std::uint32_t>(v);
      break;
    case ncclInt64:
      *reinterpret_cast<std::int64_t*>(p) = static_cast<std::int64_t>(v);
      break;
    case ncclUint64:
      *reinterpret_cast<std::uint64_t*>(p) = static_cast<std::uint64_t>(v);
      break;
    case ncclFloat16:
      *reinterpret_cast<__half*>(p) = __float2half(static_cast<float>(v));
      break;
    case ncclBfloat16:
      *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16(static_cast<float>(v));
      break;
    case ncclFloat32:
      *reinterpret_cast<float*>(p) = static_cast<float>(v);
      break;
    default:
      *reinterpret_cast<double*>(p) = v;
      break;
  }
}

inline double load(ncclDataType_t t, const void* base, std::size_t i) {
  const char* p = static_cast<const char*>(base) + i * type_size(t);
  switch (t) {
    case ncclInt8:
      return *reinterpret_cast<const std::int8_t*>(p);
    case ncclUint8:
      return *reinterpret_cast<const std::uint8_t*>(p);
    case ncclInt32:
      return *reinterpret_cast<const std::int32_t*>(p);
    case ncclUint32:
      return *reinterpret_cast<const std::uint32_t*>(p);
    case ncclInt64:
      return static_cast<double>(*reinterpret_cast<const std::int64_t*>(p));
    case ncclUint64:
      return static_cast<double>(*reinterpret_cast<const std::uint64_t*>(p));
    case ncclFloat16:
      return __half2float(*reinterpret_cast<const __half*>(p));
    case ncclBfloat16:
      return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p));
    case ncclFloat32:
      return *reinterpret_cast<const float*>(p);
    default:
      return *reinterpret_cast<const double*>(p);
  }
}

/// Rank r's element i: 1..4 (products: 1..2, so that n ranks' product fits int8).
inline double value(Op op, int r, std::size_t i) {
  if (op == Op::prod) return 1 + static_cast<double>((static_cast<std::size_t>(r) + i) % 2);
  return 1 + static_cast<double>((static_cast<std::size_t>(r) * 7 + i * 13) % 4);
}

/// The reduction over n ranks of element i.
inline double expected(ncclDataType_t t, Op op, int n, std::size_t i) {
  double acc = op == Op::prod ? 1 : (op == Op::min ? 1e300 : (op == Op::max ? -1e300 : 0));
  for (int r = 0; r < n; ++r) {
    const double v = value(op, r, i);
    switch (op) {
      case Op::prod:
        acc *= v;
        break;
      case Op::min:
        acc = std::fmin(acc, v);
        break;
      case Op::max:
        acc = std::fmax(acc, v);
        break;
      case Op::premul_host:
        acc += v * kHostScalar;
        break;
      case Op::premul_device:
        acc += v * kDeviceScalar;
        break;
      default:
        acc += v;
        break;
    }
  }
  if (op == Op::avg) acc = is_float(t) ? acc / n : std::floor(acc / n);
  return acc;
}

inline bool close_enough(ncclDataType_t t, double got, double want) {
  const double eps = t == ncclFloat16    ? 1.0 / 512
                     : t == ncclBfloat16 ? 1.0 / 64
                     : t == ncclFloat32  ? 1e-6
                                         : 0;
  return std::fabs(got - want) <= eps * std::fabs(want);
}

}  // namespace ncclt
