// Host side of tests/nccl/nccl_gpu_test.cc: element types as NCCL names
// them, the values each rank contributes, and the expected results. Values
// are small integers, so every sum, product and scaling is exact in every
// type; only avg's division leaves a remainder, compared with a tolerance
// of the type's precision.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "client/nccl/host_values.h"
#include "client/nccl/nccl.h"

namespace ncclt {

using collectived::client::nccl::host_load;
using collectived::client::nccl::host_store;
using collectived::client::nccl::host_type_size;

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

inline bool is_float(ncclDataType_t t) {
  return t == ncclFloat16 || t == ncclBfloat16 || t == ncclFloat32 || t == ncclFloat64;
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
