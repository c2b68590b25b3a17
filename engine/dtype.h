// Element types and reduction operators of collectives, their names, and the
// IEEE binary16 / bfloat16 conversions the reduction kernels use.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "ipc/half.h"

namespace collectived::engine {

/// Element type. Values are stable (wire and C API).
enum class DType : std::uint8_t {
  int8 = 0,
  uint8 = 1,
  int32 = 2,
  uint32 = 3,
  int64 = 4,
  uint64 = 5,
  float16 = 6,   ///< IEEE 754 binary16
  bfloat16 = 7,  ///< upper half of a binary32
  float32 = 8,
  float64 = 9,
};

/// Reduction operator. Values are stable (wire and C API).
enum class RedOp : std::uint8_t { sum = 0, prod = 1, min = 2, max = 3, avg = 4 };

inline constexpr int kDTypeCount = 10;
inline constexpr int kRedOpCount = 5;

/// Bytes per element: 1,1,4,4,8,8,2,2,4,8. 0 for a value outside the enum.
std::size_t dtype_size(DType dtype);

/// nccl-tests spellings: "int8","uint8","int32","uint32","int64","uint64",
/// "half","bfloat16","float","double". "unknown" for a value outside the enum.
std::string_view to_string(DType dtype);

/// "sum","prod","min","max","avg". "unknown" for a value outside the enum.
std::string_view to_string(RedOp op);

/// Wire value to enum; nullopt when out of range.
std::optional<DType> dtype_from_int(std::uint32_t value);
std::optional<RedOp> redop_from_int(std::uint32_t value);

/// Accepts the to_string() names and also "float16", "float32", "float64", "bf16".
/// Case-sensitive.
std::optional<DType> dtype_from_name(std::string_view name);
std::optional<RedOp> redop_from_name(std::string_view name);

// Half-precision conversions (ipc/half.h), used here by the kernels.
using collectived::bf16_to_f32;
using collectived::f16_to_f32;
using collectived::f32_to_bf16;
using collectived::f32_to_f16;

}  // namespace collectived::engine
