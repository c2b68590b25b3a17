// Reference semantics of the collectives (client/collective.h, engine/reduce.h)
// for programs that check results: deterministic inputs per (rank, element,
// salt) and the expected reduction of them, computed here independently of
// the daemon. Shared by the integration tests (tests/support/collective_check.h)
// and the soak client, which does not link doctest.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "client/collective.h"
#include "ipc/half.h"

namespace collectived::test::reference {

/// Deterministic input element `i` of `rank`, as raw bits.
inline std::uint64_t input_bits(collective_dtype_t d, collective_redop_t op, int rank,
                                std::size_t i, std::uint64_t salt) {
  std::uint64_t r = salt * 0x9e3779b97f4a7c15ull +
                    static_cast<std::uint64_t>(rank) * 0xbf58476d1ce4e5b9ull +
                    i * 0x94d049bb133111ebull;
  r = (r ^ (r >> 30)) * 0xbf58476d1ce4e5b9ull;
  r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
  r ^= r >> 31;
  auto fp = [&](double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(r >> 11) / static_cast<double>(1ull << 53);
  };
  // Products of floats stay in [0.5, 2) so that they neither overflow nor vanish.
  const double f = op == COLLECTIVE_PROD ? fp(0.5, 2.0) : fp(-100.0, 100.0);
  switch (d) {
    case COLLECTIVE_FLOAT16: return f32_to_f16(static_cast<float>(f));
    case COLLECTIVE_BFLOAT16: return f32_to_bf16(static_cast<float>(f));
    case COLLECTIVE_FLOAT32: return std::bit_cast<std::uint32_t>(static_cast<float>(f));
    case COLLECTIVE_FLOAT64: return std::bit_cast<std::uint64_t>(f);
    default: {
      const std::size_t bits = 8 * collective_dtype_size(d);
      return bits == 64 ? r : r & ((std::uint64_t{1} << bits) - 1);
    }
  }
}

inline void put(collective_dtype_t d, void* base, std::size_t i, std::uint64_t bits) {
  switch (collective_dtype_size(d)) {
    case 1: static_cast<std::uint8_t*>(base)[i] = static_cast<std::uint8_t>(bits); break;
    case 2: static_cast<std::uint16_t*>(base)[i] = static_cast<std::uint16_t>(bits); break;
    case 4: static_cast<std::uint32_t*>(base)[i] = static_cast<std::uint32_t>(bits); break;
    default: static_cast<std::uint64_t*>(base)[i] = bits; break;
  }
}

inline std::uint64_t get(collective_dtype_t d, const void* base, std::size_t i) {
  switch (collective_dtype_size(d)) {
    case 1: return static_cast<const std::uint8_t*>(base)[i];
    case 2: return static_cast<const std::uint16_t*>(base)[i];
    case 4: return static_cast<const std::uint32_t*>(base)[i];
    default: return static_cast<const std::uint64_t*>(base)[i];
  }
}

template <typename T>
std::uint64_t int_reduce(collective_redop_t op, const std::vector<std::uint64_t>& in) {
  using U = std::make_unsigned_t<T>;
  U acc = static_cast<U>(in[0]);
  for (std::size_t k = 1; k < in.size(); ++k) {
    const U v = static_cast<U>(in[k]);
    switch (op) {
      case COLLECTIVE_SUM:
      case COLLECTIVE_AVG: acc = static_cast<U>(acc + v); break;
      case COLLECTIVE_PROD: acc = static_cast<U>(acc * v); break;
      case COLLECTIVE_MIN: acc = static_cast<T>(v) < static_cast<T>(acc) ? v : acc; break;
      case COLLECTIVE_MAX: acc = static_cast<T>(v) > static_cast<T>(acc) ? v : acc; break;
    }
  }
  if (op == COLLECTIVE_AVG) acc = static_cast<U>(static_cast<T>(acc) / static_cast<T>(in.size()));
  return static_cast<std::uint64_t>(acc);
}

template <typename A>
A float_reduce(collective_redop_t op, const std::vector<A>& in) {
  A acc = in[0];
  for (std::size_t k = 1; k < in.size(); ++k) {
    const A v = in[k];
    switch (op) {
      case COLLECTIVE_SUM:
      case COLLECTIVE_AVG: acc = acc + v; break;
      case COLLECTIVE_PROD: acc = acc * v; break;
      case COLLECTIVE_MIN: acc = v < acc ? v : acc; break;
      case COLLECTIVE_MAX: acc = v > acc ? v : acc; break;
    }
  }
  if (op == COLLECTIVE_AVG) acc = acc / static_cast<A>(in.size());
  return acc;
}

/// Reduction of raw inputs in rank order, as raw result bits.
inline std::uint64_t reduce(collective_dtype_t d, collective_redop_t op,
                            const std::vector<std::uint64_t>& in) {
  switch (d) {
    case COLLECTIVE_INT8: return int_reduce<std::int8_t>(op, in);
    case COLLECTIVE_UINT8: return int_reduce<std::uint8_t>(op, in);
    case COLLECTIVE_INT32: return int_reduce<std::int32_t>(op, in);
    case COLLECTIVE_UINT32: return int_reduce<std::uint32_t>(op, in);
    case COLLECTIVE_INT64: return int_reduce<std::int64_t>(op, in);
    case COLLECTIVE_UINT64: return int_reduce<std::uint64_t>(op, in);
    case COLLECTIVE_FLOAT16:
    case COLLECTIVE_BFLOAT16: {
      std::vector<float> f;
      for (auto b : in) {
        f.push_back(d == COLLECTIVE_FLOAT16 ? f16_to_f32(static_cast<std::uint16_t>(b))
                                            : bf16_to_f32(static_cast<std::uint16_t>(b)));
      }
      const float r = float_reduce(op, f);
      return d == COLLECTIVE_FLOAT16 ? f32_to_f16(r) : f32_to_bf16(r);
    }
    case COLLECTIVE_FLOAT32: {
      std::vector<float> f;
      for (auto b : in) f.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(b)));
      return std::bit_cast<std::uint32_t>(float_reduce(op, f));
    }
    case COLLECTIVE_FLOAT64: {
      std::vector<double> f;
      for (auto b : in) f.push_back(std::bit_cast<double>(b));
      return std::bit_cast<std::uint64_t>(float_reduce(op, f));
    }
  }
  return 0;
}

inline double as_double(collective_dtype_t d, std::uint64_t bits) {
  switch (d) {
    case COLLECTIVE_FLOAT16: return f16_to_f32(static_cast<std::uint16_t>(bits));
    case COLLECTIVE_BFLOAT16: return bf16_to_f32(static_cast<std::uint16_t>(bits));
    case COLLECTIVE_FLOAT32: return std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    case COLLECTIVE_FLOAT64: return std::bit_cast<double>(bits);
    default: return static_cast<double>(bits);
  }
}

/// Across nodes, reductions run in another order than rank order (node by
/// node): float results may differ from reduce() by rounding. True if `got`
/// is within a few ulps of the inputs' magnitude (the rule of
/// tests/support/collective_check.cc); integers, min and max are exact.
inline bool close_enough(collective_dtype_t d, collective_redop_t op, std::uint64_t got,
                         std::uint64_t want, const std::vector<std::uint64_t>& in) {
  if (got == want) return true;
  if (op == COLLECTIVE_MIN || op == COLLECTIVE_MAX) return false;
  double eps = 0;
  switch (d) {
    case COLLECTIVE_FLOAT16: eps = 1.0 / 1024; break;
    case COLLECTIVE_BFLOAT16: eps = 1.0 / 128; break;
    case COLLECTIVE_FLOAT32: eps = 1.0 / (1 << 23); break;
    case COLLECTIVE_FLOAT64: eps = 1.0 / (1ull << 52); break;
    default: return false;
  }
  const double g = as_double(d, got), w = as_double(d, want);
  double scale = 0;
  if (op == COLLECTIVE_PROD) {
    scale = w < 0 ? -w : w;
  } else {
    for (auto b : in) {
      const double v = as_double(d, b);
      scale += v < 0 ? -v : v;
    }
    if (op == COLLECTIVE_AVG) scale /= static_cast<double>(in.size());
  }
  const double diff = g > w ? g - w : w - g;
  return diff <= 4.0 * eps * scale * static_cast<double>(in.size()) + 1e-30;
}

}  // namespace collectived::test::reference
