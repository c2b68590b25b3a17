#include "engine/dtype.h"

#include <array>

namespace collectived::engine {

namespace {

constexpr std::array<std::size_t, kDTypeCount> kSizes = {1, 1, 4, 4, 8, 8, 2, 2, 4, 8};
constexpr std::array<std::string_view, kDTypeCount> kDTypeNames = {
    "int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "bfloat16", "float", "double"};
constexpr std::array<std::string_view, kRedOpCount> kRedOpNames = {"sum", "prod", "min", "max",
                                                                   "avg"};

struct Alias {
  std::string_view name;
  DType dtype;
};
constexpr std::array<Alias, 4> kDTypeAliases = {{
    {"float16", DType::float16},
    {"float32", DType::float32},
    {"float64", DType::float64},
    {"bf16", DType::bfloat16},
}};

}  // namespace

std::size_t dtype_size(DType dtype) {
  const auto i = static_cast<std::size_t>(dtype);
  return i < kSizes.size() ? kSizes[i] : 0;
}

std::string_view to_string(DType dtype) {
  const auto i = static_cast<std::size_t>(dtype);
  return i < kDTypeNames.size() ? kDTypeNames[i] : std::string_view("unknown");
}

std::string_view to_string(RedOp op) {
  const auto i = static_cast<std::size_t>(op);
  return i < kRedOpNames.size() ? kRedOpNames[i] : std::string_view("unknown");
}

std::optional<DType> dtype_from_int(std::uint32_t value) {
  if (value >= static_cast<std::uint32_t>(kDTypeCount)) return std::nullopt;
  return static_cast<DType>(value);
}

std::optional<RedOp> redop_from_int(std::uint32_t value) {
  if (value >= static_cast<std::uint32_t>(kRedOpCount)) return std::nullopt;
  return static_cast<RedOp>(value);
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (std::size_t i = 0; i < kDTypeNames.size(); ++i) {
    if (kDTypeNames[i] == name) return static_cast<DType>(i);
  }
  for (const Alias& alias : kDTypeAliases) {
    if (alias.name == name) return alias.dtype;
  }
  return std::nullopt;
}

std::optional<RedOp> redop_from_name(std::string_view name) {
  for (std::size_t i = 0; i < kRedOpNames.size(); ++i) {
    if (kRedOpNames[i] == name) return static_cast<RedOp>(i);
  }
  return std::nullopt;
}

}  // namespace collectived::engine
