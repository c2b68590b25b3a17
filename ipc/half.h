// IEEE binary16 and bfloat16 conversions, shared by the daemon's reduction
// kernels and the clients' tools (collective-perf fills and checks buffers
// with them). Header-only.
#pragma once

#include <bit>
#include <cstdint>

namespace collectived {

// ---------------------------------------------------------------------------
// Half-precision conversions. Round to nearest, ties to even; +-0, +-Inf and
// subnormals are exact; a NaN stays a NaN, made quiet, with its payload kept as
// far as it fits (the same bits as x86 F16C and GCC's _Float16 conversions).
// They are inline and branch-free (selects only) so that loops over arrays of
// them auto-vectorize; they assume the default FP environment (round to
// nearest, no flush-to-zero).
// ---------------------------------------------------------------------------

/// binary16 -> binary32 (exact).
inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t mag = static_cast<std::uint32_t>(h & 0x7fffu) << 13;  // exp+mantissa, float position
  const std::uint32_t exp = mag & 0x0f800000u;
  // Normal numbers: rebias the exponent (127 - 15).
  const std::uint32_t normal = mag + (112u << 23);
  // Inf/NaN: exponent all ones; NaN gets the quiet bit.
  const std::uint32_t infnan = (mag | 0x7f800000u) | ((mag & 0x007fe000u) != 0 ? 0x00400000u : 0u);
  // Zero and subnormals: place the mantissa under exponent 2^-14 (one extra
  // exponent step gives an implicit one of 2^-14) and subtract that one in float
  // arithmetic, which is exact.
  const std::uint32_t sub = std::bit_cast<std::uint32_t>(
      std::bit_cast<float>(mag + (113u << 23)) - std::bit_cast<float>(113u << 23));
  // Selects as bit masks: with ?: GCC moves the float subtraction into a branch
  // (it may trap) and the loop no longer vectorizes.
  const std::uint32_t is_sub = 0u - static_cast<std::uint32_t>(exp == 0);
  const std::uint32_t is_big = 0u - static_cast<std::uint32_t>(exp == 0x0f800000u);
  const std::uint32_t r = (sub & is_sub) | (infnan & is_big) | (normal & ~(is_sub | is_big));
  return std::bit_cast<float>(r | sign);
}

/// binary32 -> binary16, round to nearest even.
inline std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;  // |f|
  // Normal half results (|f| in [2^-14, 65520)): rebias the exponent and round
  // the 13 dropped bits to nearest even with an integer add; a carry out of the
  // mantissa correctly bumps the exponent, up to Inf (0x7c00) for [65520, 2^16).
  const std::uint32_t normal = (a - (112u << 23) + 0x0fffu + ((a >> 13) & 1u)) >> 13;
  // Subnormal half results and zero (|f| < 2^-14): adding 0.5 (2^-1) aligns the
  // binary16 subnormal quantum 2^-24 with the float ulp of [0.5, 1), so the FP
  // adder does the round-to-nearest-even; the low bits are the result.
  const float magic = std::bit_cast<float>(126u << 23);  // 0.5f
  const std::uint32_t sub = std::bit_cast<std::uint32_t>(std::bit_cast<float>(a) + magic) - (126u << 23);
  // Inf (exact and too large) and NaN (quiet, upper payload bits kept).
  const std::uint32_t big = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x03ffu)) : 0x7c00u;
  // Selects as bit masks (see f16_to_f32).
  const std::uint32_t is_sub = 0u - static_cast<std::uint32_t>(a < (113u << 23));
  const std::uint32_t is_big = 0u - static_cast<std::uint32_t>(a >= (143u << 23));  // 2^16
  const std::uint32_t r = (sub & is_sub) | (big & is_big) | (normal & ~(is_sub | is_big));
  return static_cast<std::uint16_t>(r | sign);
}

/// bfloat16 -> binary32 (exact; a signalling NaN gets the quiet bit).
inline float bf16_to_f32(std::uint16_t b) {
  std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  u |= (u & 0x7fffffffu) > 0x7f800000u ? 0x00400000u : 0u;
  return std::bit_cast<float>(u);
}

/// binary32 -> bfloat16, round to nearest even (overflow rounds to Inf).
inline std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (u >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace collectived
