#include "engine/reduce.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/dtype.h"
#include "ipc/error.h"

using namespace collectived;
using namespace collectived::engine;

namespace {

using Bytes = std::vector<unsigned char>;

// ---- Independent references for the conversions ----

// binary16 via GCC's _Float16 (libgcc soft-fp on x86-64 without AVX512-FP16).
std::uint16_t gcc_f32_to_f16(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  return std::bit_cast<std::uint16_t>(h);
}
float gcc_f16_to_f32(std::uint16_t bits) {
  return static_cast<float>(std::bit_cast<_Float16>(bits));
}

bool f16_is_nan(std::uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; }
bool bf16_is_nan(std::uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0; }

// bfloat16 by choosing the nearer of the two bfloat16 neighbours in double
// arithmetic (differences of floats of nearby magnitude are exact in double).
std::uint16_t ref_f32_to_bf16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  if (std::isinf(f)) return static_cast<std::uint16_t>(u >> 16);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);  // toward zero
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);   // away from zero
  const auto value = [](std::uint16_t b) -> double {
    if ((b & 0x7fffu) == 0x7f80u) return std::copysign(std::ldexp(1.0, 128), (b & 0x8000u) ? -1.0 : 1.0);
    return static_cast<double>(std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16));
  };
  const double x = f;
  const double dlo = std::fabs(x - value(lo));
  const double dhi = std::fabs(value(hi) - x);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1u) == 0 ? lo : hi;
}

float ref_bf16_to_f32(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::uint32_t bits_of(float f) { return std::bit_cast<std::uint32_t>(f); }
float float_of(std::uint32_t u) { return std::bit_cast<float>(u); }

// ---- Scalar reference for reductions, element by element ----

template <class S>
S get(const unsigned char* p, std::size_t i) {
  S v;
  std::memcpy(&v, p + i * sizeof(S), sizeof(S));
  return v;
}
template <class S>
void put(unsigned char* p, std::size_t i, S v) {
  std::memcpy(p + i * sizeof(S), &v, sizeof(S));
}

template <class S>
void ref_int(RedOp op, const std::vector<const unsigned char*>& srcs, std::size_t count,
             std::size_t divisor, unsigned char* out) {
  constexpr bool kSigned = std::is_signed_v<S>;
  constexpr int kBits = static_cast<int>(sizeof(S) * 8);
  const auto trunc = [](std::uint64_t v) { return static_cast<S>(v); };  // mod 2^bits
  for (std::size_t i = 0; i < count; ++i) {
    S acc = get<S>(srcs[0], i);
    for (std::size_t k = 1; k < srcs.size(); ++k) {
      const S x = get<S>(srcs[k], i);
      // Arithmetic in 64-bit unsigned, truncated: same as wrapping in `bits`.
      const std::uint64_t ua = static_cast<std::uint64_t>(acc), ux = static_cast<std::uint64_t>(x);
      switch (op) {
        case RedOp::sum:
        case RedOp::avg: acc = trunc(ua + ux); break;
        case RedOp::prod: acc = trunc(ua * ux); break;
        case RedOp::min:
          if constexpr (kSigned) {
            acc = static_cast<std::int64_t>(x) < static_cast<std::int64_t>(acc) ? x : acc;
          } else {
            acc = ux < ua ? x : acc;
          }
          break;
        case RedOp::max:
          if constexpr (kSigned) {
            acc = static_cast<std::int64_t>(x) > static_cast<std::int64_t>(acc) ? x : acc;
          } else {
            acc = ux > ua ? x : acc;
          }
          break;
      }
    }
    if (op == RedOp::avg) {
      if constexpr (kSigned) {
        acc = static_cast<S>(static_cast<std::int64_t>(acc) / static_cast<std::int64_t>(divisor));
      } else {
        acc = static_cast<S>(static_cast<std::uint64_t>(acc) / divisor);
      }
    }
    static_assert(kBits <= 64);
    put<S>(out, i, acc);
  }
}

// S: storage, A: accumulator; load/store are the test's own conversions.
template <class S, class A, class Load, class Store>
void ref_float(RedOp op, const std::vector<const unsigned char*>& srcs, std::size_t count,
               std::size_t divisor, unsigned char* out, Load load, Store store) {
  for (std::size_t i = 0; i < count; ++i) {
    A acc = load(get<S>(srcs[0], i));
    for (std::size_t k = 1; k < srcs.size(); ++k) {
      const A x = load(get<S>(srcs[k], i));
      switch (op) {
        case RedOp::sum:
        case RedOp::avg: acc = acc + x; break;
        case RedOp::prod: acc = acc * x; break;
        case RedOp::min: acc = (x < acc) ? x : acc; break;
        case RedOp::max: acc = (x > acc) ? x : acc; break;
      }
    }
    if (op == RedOp::avg) acc = acc / static_cast<A>(divisor);
    put<S>(out, i, store(acc));
  }
}

Bytes reference(DType dt, RedOp op, const std::vector<const unsigned char*>& srcs,
                std::size_t count, std::size_t divisor) {
  Bytes out(count * dtype_size(dt));
  unsigned char* o = out.data();
  const auto same_f = [](float x) { return x; };
  const auto same_d = [](double x) { return x; };
  switch (dt) {
    case DType::int8: ref_int<std::int8_t>(op, srcs, count, divisor, o); break;
    case DType::uint8: ref_int<std::uint8_t>(op, srcs, count, divisor, o); break;
    case DType::int32: ref_int<std::int32_t>(op, srcs, count, divisor, o); break;
    case DType::uint32: ref_int<std::uint32_t>(op, srcs, count, divisor, o); break;
    case DType::int64: ref_int<std::int64_t>(op, srcs, count, divisor, o); break;
    case DType::uint64: ref_int<std::uint64_t>(op, srcs, count, divisor, o); break;
    case DType::float16:
      ref_float<std::uint16_t, float>(op, srcs, count, divisor, o, gcc_f16_to_f32, gcc_f32_to_f16);
      break;
    case DType::bfloat16:
      ref_float<std::uint16_t, float>(op, srcs, count, divisor, o, ref_bf16_to_f32,
                                      ref_f32_to_bf16);
      break;
    case DType::float32: ref_float<float, float>(op, srcs, count, divisor, o, same_f, same_f); break;
    case DType::float64:
      ref_float<double, double>(op, srcs, count, divisor, o, same_d, same_d);
      break;
  }
  return out;
}

bool element_is_nan(DType dt, const unsigned char* p) {
  switch (dt) {
    case DType::float16: return f16_is_nan(get<std::uint16_t>(p, 0));
    case DType::bfloat16: return bf16_is_nan(get<std::uint16_t>(p, 0));
    case DType::float32: return std::isnan(get<float>(p, 0));
    case DType::float64: return std::isnan(get<double>(p, 0));
    default: return false;
  }
}

/// Index of the first element that differs (bit-exactly; two NaNs count as
/// equal since the payload of a NaN from arithmetic depends on operand order,
/// which the compiler may commute), or SIZE_MAX.
std::size_t first_mismatch(DType dt, const unsigned char* got, const unsigned char* want,
                           std::size_t count) {
  const std::size_t size = dtype_size(dt);
  for (std::size_t i = 0; i < count; ++i) {
    const unsigned char* g = got + i * size;
    const unsigned char* w = want + i * size;
    if (std::memcmp(g, w, size) == 0) continue;
    if (element_is_nan(dt, g) && element_is_nan(dt, w)) continue;
    return i;
  }
  return SIZE_MAX;
}

// ---- Test data ----

/// Values that make results interesting: full-range integers (sums and products
/// wrap), floats with random mantissas over a modest exponent range (sums and
/// products round) and, now and then, specials (+-0, +-Inf, NaN, subnormals).
void fill_random(DType dt, unsigned char* p, std::size_t count, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(0, 99);
  for (std::size_t i = 0; i < count; ++i) {
    const std::uint64_t r = rng();
    const bool special = pick(rng) < 3;
    switch (dt) {
      case DType::int8:
      case DType::uint8: put<std::uint8_t>(p, i, static_cast<std::uint8_t>(r)); break;
      case DType::int32:
      case DType::uint32: put<std::uint32_t>(p, i, static_cast<std::uint32_t>(r)); break;
      case DType::int64:
      case DType::uint64: put<std::uint64_t>(p, i, r); break;
      case DType::float16: {
        // Any bit pattern: covers subnormals, Inf, NaN (1/32 of patterns).
        put<std::uint16_t>(p, i, static_cast<std::uint16_t>(r));
        break;
      }
      case DType::bfloat16:
      case DType::float32:
      case DType::float64: {
        double v;
        if (special) {
          static constexpr double kSpecials[] = {0.0,
                                                 -0.0,
                                                 std::numeric_limits<double>::infinity(),
                                                 -std::numeric_limits<double>::infinity(),
                                                 std::numeric_limits<double>::quiet_NaN(),
                                                 1e-40,
                                                 -3e-42,
                                                 1e-310,
                                                 65504.0,
                                                 3.3e38};
          v = kSpecials[r % std::size(kSpecials)];
        } else {
          const double mant = static_cast<double>(r >> 11) * 0x1p-53;  // [0, 1)
          const int exp = static_cast<int>((r >> 3) % 24) - 12;
          v = std::ldexp(1.0 + mant, exp) * ((r & 1) ? -1.0 : 1.0);
        }
        if (dt == DType::float64) {
          put<double>(p, i, v);
        } else if (dt == DType::float32) {
          put<float>(p, i, static_cast<float>(v));
        } else {
          put<std::uint16_t>(p, i, ref_f32_to_bf16(static_cast<float>(v)));
        }
        break;
      }
    }
  }
}

constexpr DType kAllDTypes[] = {DType::int8,   DType::uint8,   DType::int32,    DType::uint32,
                                DType::int64,  DType::uint64,  DType::float16,  DType::bfloat16,
                                DType::float32, DType::float64};
constexpr RedOp kAllOps[] = {RedOp::sum, RedOp::prod, RedOp::min, RedOp::max, RedOp::avg};

/// Runs `fn` once per kernel variant this CPU supports, then restores the best.
template <class Fn>
void for_each_isa(Fn&& fn) {
  const ReduceIsa best = set_reduce_isa(ReduceIsa::avx2_f16c);
  for (int i = 0; i <= static_cast<int>(best); ++i) {
    const ReduceIsa isa = set_reduce_isa(static_cast<ReduceIsa>(i));
    REQUIRE(isa == static_cast<ReduceIsa>(i));
    CAPTURE(to_string(isa));
    fn();
  }
  set_reduce_isa(best);
}

constexpr std::size_t kGuard = 64;  // bytes after each buffer that must stay untouched
constexpr unsigned char kGuardByte = 0xa5;

}  // namespace

// ---------------------------------------------------------------------------
// Names
// ---------------------------------------------------------------------------

TEST_CASE("dtype and op names, sizes and wire values") {
  const std::size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 2, 4, 8};
  const char* names[] = {"int8", "uint8", "int32", "uint32", "int64",
                         "uint64", "half", "bfloat16", "float", "double"};
  for (int i = 0; i < kDTypeCount; ++i) {
    const DType dt = static_cast<DType>(i);
    CHECK(dtype_size(dt) == sizes[i]);
    CHECK(to_string(dt) == names[i]);
    CHECK(dtype_from_name(names[i]) == dt);
    CHECK(dtype_from_int(static_cast<std::uint32_t>(i)) == dt);
  }
  CHECK(dtype_from_int(10) == std::nullopt);
  CHECK(dtype_from_int(0xffffffffu) == std::nullopt);
  CHECK(dtype_from_name("float16") == DType::float16);
  CHECK(dtype_from_name("float32") == DType::float32);
  CHECK(dtype_from_name("float64") == DType::float64);
  CHECK(dtype_from_name("bf16") == DType::bfloat16);
  CHECK(dtype_from_name("half") == DType::float16);
  CHECK(dtype_from_name("float") == DType::float32);
  CHECK(dtype_from_name("double") == DType::float64);
  CHECK(dtype_from_name("") == std::nullopt);
  CHECK(dtype_from_name("Float") == std::nullopt);
  CHECK(dtype_from_name("int16") == std::nullopt);
  CHECK(dtype_size(static_cast<DType>(10)) == 0);
  CHECK(to_string(static_cast<DType>(200)) == "unknown");

  const char* ops[] = {"sum", "prod", "min", "max", "avg"};
  for (int i = 0; i < kRedOpCount; ++i) {
    const RedOp op = static_cast<RedOp>(i);
    CHECK(to_string(op) == ops[i]);
    CHECK(redop_from_name(ops[i]) == op);
    CHECK(redop_from_int(static_cast<std::uint32_t>(i)) == op);
  }
  CHECK(redop_from_int(5) == std::nullopt);
  CHECK(redop_from_name("mean") == std::nullopt);
  CHECK(to_string(static_cast<RedOp>(5)) == "unknown");
}

// ---------------------------------------------------------------------------
// float16
// ---------------------------------------------------------------------------

TEST_CASE("f16: all 65536 values convert to float exactly and back bit-identically") {
  int nans = 0;
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto h16 = static_cast<std::uint16_t>(h);
    const float f = f16_to_f32(h16);
    // Same float bits as GCC's conversion (NaNs made quiet the same way).
    REQUIRE_MESSAGE(bits_of(f) == bits_of(gcc_f16_to_f32(h16)), "half " << hex(h));
    const std::uint16_t back = f32_to_f16(f);
    if (f16_is_nan(h16)) {
      ++nans;
      REQUIRE(std::isnan(f));
      REQUIRE(f16_is_nan(back));
      REQUIRE(back == (h16 | 0x0200u));  // payload and sign kept, made quiet
    } else {
      REQUIRE_MESSAGE(back == h16, "half " << hex(h));
    }
  }
  CHECK(nans == 2 * 1023);
  CHECK(f16_to_f32(0x3c00) == 1.0f);
  CHECK(f16_to_f32(0x7bff) == 65504.0f);
  CHECK(f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(f16_to_f32(0x0400) == std::ldexp(1.0f, -14));
  CHECK(bits_of(f16_to_f32(0x8000)) == 0x80000000u);
  CHECK(f16_to_f32(0xfc00) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("f16: f32 -> f16 rounds to nearest even like GCC's _Float16") {
  const float tiny = std::ldexp(1.0f, -24);  // smallest half subnormal
  struct Edge {
    float f;
    std::uint16_t want;
  };
  const Edge edges[] = {
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {1.0f, 0x3c00},
      {65504.0f, 0x7bff},                       // max half
      {65519.99f, 0x7bff},                      // just below the halfway point to 2^16
      {65520.0f, 0x7c00},                       // halfway, ties to even: Inf
      {-65520.0f, 0xfc00},
      {65536.0f, 0x7c00},
      {1e30f, 0x7c00},
      {std::numeric_limits<float>::max(), 0x7c00},
      {std::numeric_limits<float>::infinity(), 0x7c00},
      {-std::numeric_limits<float>::infinity(), 0xfc00},
      {tiny, 0x0001},
      {tiny / 2, 0x0000},                       // halfway, ties to even: 0
      {-tiny / 2, 0x8000},
      {tiny / 2 * 1.0000001f, 0x0001},          // above halfway
      {tiny * 1.5f, 0x0002},                    // halfway 1..2: even 2
      {tiny * 2.5f, 0x0002},                    // halfway 2..3: even 2
      {tiny * 3.5f, 0x0004},
      {std::ldexp(1.0f, -14), 0x0400},          // min normal
      {std::ldexp(1023.5f, -24), 0x0400},       // top subnormal halfway: even 0x400
      {1.0f + std::ldexp(1.0f, -11), 0x3c00},   // halfway 1 and 1+2^-10: even
      {1.0f + 3 * std::ldexp(1.0f, -11), 0x3c02},  // halfway, odd below: up
      {1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -23), 0x3c01},
      {2049.0f, 0x6800},                        // 2048 + 1: halfway, even 2048
      {2051.0f, 0x6802},                        // 2050 + 1: halfway, up to 2052
      {std::numeric_limits<float>::denorm_min(), 0x0000},
      {-std::numeric_limits<float>::denorm_min(), 0x8000},
  };
  for (const Edge& e : edges) {
    CHECK_MESSAGE(f32_to_f16(e.f) == e.want, "float " << e.f);
    CHECK_MESSAGE(gcc_f32_to_f16(e.f) == e.want, "float " << e.f);
  }
  // NaNs: quiet, upper payload bits and sign kept.
  CHECK(f32_to_f16(float_of(0x7f800001u)) == 0x7e00);  // signalling, payload below half's
  CHECK(f32_to_f16(float_of(0xffc12345u)) == 0xfe09);
  CHECK(f32_to_f16(std::numeric_limits<float>::quiet_NaN()) == 0x7e00);

  // Every float around each half's rounding boundaries.
  std::size_t checked = 0;
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const std::uint32_t centre = bits_of(f16_to_f32(static_cast<std::uint16_t>(h)));
    for (std::uint32_t d = 0; d < 8; ++d) {
      for (const std::uint32_t u : {centre + (1u << 12) - 4 + d, centre + d, centre - d}) {
        for (const std::uint32_t s : {u, u | 0x80000000u}) {
          REQUIRE_MESSAGE(f32_to_f16(float_of(s)) == gcc_f32_to_f16(float_of(s)),
                          "float bits " << hex(s));
          ++checked;
        }
      }
    }
  }

  std::mt19937 rng(12345);
  for (int i = 0; i < 2'000'000; ++i) {
    const std::uint32_t u = rng();
    REQUIRE_MESSAGE(f32_to_f16(float_of(u)) == gcc_f32_to_f16(float_of(u)),
                    "float bits " << hex(u));
  }
  // Random values in the half range (random bits are mostly out of it).
  for (int i = 0; i < 2'000'000; ++i) {
    const std::uint32_t u = (rng() & 0x87ffffffu) + (96u << 23);  // exponents 2^-31 .. 2^32
    REQUIRE_MESSAGE(f32_to_f16(float_of(u)) == gcc_f32_to_f16(float_of(u)),
                    "float bits " << hex(u));
  }
  CHECK(checked > 0);
}

// ---------------------------------------------------------------------------
// bfloat16
// ---------------------------------------------------------------------------

TEST_CASE("bf16: all 65536 values convert to float exactly and back bit-identically") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto b16 = static_cast<std::uint16_t>(b);
    const float f = bf16_to_f32(b16);
    const std::uint16_t back = f32_to_bf16(f);
    if (bf16_is_nan(b16)) {
      REQUIRE(std::isnan(f));
      REQUIRE(bits_of(f) == ((b << 16) | 0x00400000u));  // made quiet
      REQUIRE(back == (b16 | 0x0040u));
    } else {
      REQUIRE(bits_of(f) == b << 16);
      REQUIRE_MESSAGE(back == b16, "bf16 " << hex(b));
    }
  }
}

TEST_CASE("bf16: f32 -> bf16 rounds to nearest even (reference in double arithmetic)") {
  struct Edge {
    std::uint32_t f;
    std::uint16_t want;
  };
  const Edge edges[] = {
      {0x3f800000u, 0x3f80},  // 1
      {0x3f808000u, 0x3f80},  // halfway, even below
      {0x3f818000u, 0x3f82},  // halfway, odd below: up
      {0x3f808001u, 0x3f81},  // above halfway
      {0x3f807fffu, 0x3f80},  // below halfway
      {0xbf808000u, 0xbf80},  // negative halfway
      {0xbf818000u, 0xbf82},
      {0x7f7fffffu, 0x7f80},  // float max rounds to Inf
      {0x7f7f7fffu, 0x7f7f},
      {0x7f7f8000u, 0x7f80},  // halfway to 2^128, odd below: Inf
      {0xff7fffffu, 0xff80},
      {0x7f800000u, 0x7f80},
      {0xff800000u, 0xff80},
      {0x00000000u, 0x0000},
      {0x80000000u, 0x8000},
      {0x00008000u, 0x0000},  // subnormal halfway, even below
      {0x00018000u, 0x0002},  // subnormal halfway, odd below
      {0x007fffffu, 0x0080},  // largest subnormal rounds to min normal
      {0x7f800001u, 0x7fc0},  // signalling NaN, low payload lost: made quiet
      {0x7fc00000u, 0x7fc0},
      {0xffc12345u, 0xffc1},
      {0x7fff0000u, 0x7fff},
  };
  for (const Edge& e : edges) {
    CHECK_MESSAGE(f32_to_bf16(float_of(e.f)) == e.want, "float bits " << hex(e.f));
    CHECK_MESSAGE(ref_f32_to_bf16(float_of(e.f)) == e.want, "float bits " << hex(e.f));
  }
  // Around every rounding boundary.
  for (std::uint32_t b = 0; b < 65536; ++b) {
    for (const std::uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const std::uint32_t u = (b << 16) | low;
      REQUIRE_MESSAGE(f32_to_bf16(float_of(u)) == ref_f32_to_bf16(float_of(u)),
                      "float bits " << hex(u));
    }
  }
  std::mt19937 rng(777);
  for (int i = 0; i < 2'000'000; ++i) {
    const std::uint32_t u = rng();
    REQUIRE_MESSAGE(f32_to_bf16(float_of(u)) == ref_f32_to_bf16(float_of(u)),
                    "float bits " << hex(u));
  }
}

// ---------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------

TEST_CASE("reduce_multi matches the scalar reference: every dtype, op, nsrc, count, ndst, in-place") {
  constexpr std::size_t T = kReduceTileElems;
  const std::size_t counts[] = {0, 1, 7, T - 1, T, T + 1, 3 * T + 5};
  std::mt19937_64 rng(2024);
  std::size_t runs = 0;

  for_each_isa([&] {
  for (const DType dt : kAllDTypes) {
    const std::size_t size = dtype_size(dt);
    for (const RedOp op : kAllOps) {
      for (std::size_t nsrc = 1; nsrc <= 5; ++nsrc) {
        for (const std::size_t count : counts) {
          for (const std::size_t ndst : {std::size_t{1}, std::size_t{3}}) {
            for (const bool in_place : {false, true}) {
              CAPTURE(to_string(dt));
              CAPTURE(to_string(op));
              CAPTURE(nsrc);
              CAPTURE(count);
              CAPTURE(ndst);
              CAPTURE(in_place);
              const std::size_t bytes = count * size;
              const std::size_t divisor = nsrc + 1;

              std::vector<Bytes> src(nsrc, Bytes(bytes + kGuard, kGuardByte));
              for (Bytes& s : src) fill_random(dt, s.data(), count, rng);
              const std::vector<Bytes> original = src;
              std::vector<const unsigned char*> orig_ptrs;
              for (const Bytes& s : original) orig_ptrs.push_back(s.data());
              const Bytes want = reference(dt, op, orig_ptrs, count, divisor);

              std::vector<Bytes> own(ndst, Bytes(bytes + kGuard, kGuardByte));
              std::vector<void*> dsts;
              for (Bytes& d : own) dsts.push_back(d.data());
              // In place: the first destination is src[1] (src[0] with one
              // source) and, with three destinations, the last is src[0].
              if (in_place) {
                dsts[0] = src[nsrc >= 2 ? 1 : 0].data();
                if (ndst == 3 && nsrc >= 2) dsts[2] = src[0].data();
              }
              std::vector<const void*> srcs;
              for (const Bytes& s : src) srcs.push_back(s.data());

              reduce_multi(dt, op, dsts.data(), ndst, srcs.data(), nsrc, count, divisor);
              ++runs;

              for (std::size_t j = 0; j < ndst; ++j) {
                CAPTURE(j);
                const auto* got = static_cast<const unsigned char*>(dsts[j]);
                const std::size_t bad = first_mismatch(dt, got, want.data(), count);
                REQUIRE_MESSAGE(bad == SIZE_MAX, "first wrong element " << bad);
                for (std::size_t g = 0; g < kGuard; ++g) REQUIRE(got[bytes + g] == kGuardByte);
              }
              // Sources that are no destination are unchanged.
              for (std::size_t k = 0; k < nsrc; ++k) {
                const bool is_dst =
                    std::find(dsts.begin(), dsts.end(), src[k].data()) != dsts.end();
                if (!is_dst) REQUIRE(src[k] == original[k]);
              }
            }
          }
        }
      }
    }
  }
  });
  CHECK(runs % (10 * 5 * 5 * 7 * 2 * 2) == 0);
  CHECK(runs > 0);
}

TEST_CASE("reduce: pinned values (wrap-around, truncating avg, float rounding, NaN in min/max)") {
  const auto run = [](DType dt, RedOp op, std::vector<Bytes> srcs, std::size_t divisor) {
    const std::size_t count = srcs[0].size() / dtype_size(dt);
    std::vector<const void*> ptrs;
    for (const Bytes& s : srcs) ptrs.push_back(s.data());
    Bytes out(srcs[0].size());
    reduce(dt, op, out.data(), ptrs.data(), ptrs.size(), count, divisor);
    return out;
  };
  const auto bytes_of = [](auto v) {
    Bytes b(sizeof(v));
    std::memcpy(b.data(), &v, sizeof(v));
    return b;
  };
  // int8: 100 + 100 wraps to -56; avg of (-56) over 3 truncates toward zero: -18.
  CHECK(run(DType::int8, RedOp::sum, {bytes_of(std::int8_t{100}), bytes_of(std::int8_t{100})}, 1) ==
        bytes_of(std::int8_t{-56}));
  CHECK(run(DType::int8, RedOp::avg, {bytes_of(std::int8_t{100}), bytes_of(std::int8_t{100})}, 3) ==
        bytes_of(std::int8_t{-18}));
  CHECK(run(DType::int8, RedOp::prod, {bytes_of(std::int8_t{-128}), bytes_of(std::int8_t{-1})}, 1) ==
        bytes_of(std::int8_t{-128}));
  CHECK(run(DType::uint8, RedOp::avg, {bytes_of(std::uint8_t{200}), bytes_of(std::uint8_t{100})}, 2) ==
        bytes_of(std::uint8_t{22}));  // 300 mod 256 = 44, / 2
  CHECK(run(DType::int32, RedOp::sum,
            {bytes_of(std::numeric_limits<std::int32_t>::max()), bytes_of(std::int32_t{1})}, 1) ==
        bytes_of(std::numeric_limits<std::int32_t>::min()));
  CHECK(run(DType::int32, RedOp::avg, {bytes_of(std::int32_t{-7}), bytes_of(std::int32_t{0})}, 2) ==
        bytes_of(std::int32_t{-3}));
  CHECK(run(DType::uint32, RedOp::min, {bytes_of(0xffffffffu), bytes_of(1u)}, 1) == bytes_of(1u));
  CHECK(run(DType::int32, RedOp::min, {bytes_of(std::int32_t{-1}), bytes_of(std::int32_t{1})}, 1) ==
        bytes_of(std::int32_t{-1}));
  CHECK(run(DType::int64, RedOp::prod,
            {bytes_of(std::int64_t{1} << 62), bytes_of(std::int64_t{4})}, 1) ==
        bytes_of(std::int64_t{0}));
  CHECK(run(DType::int64, RedOp::avg,
            {bytes_of(std::numeric_limits<std::int64_t>::min())},
            std::size_t{1} << 63) == bytes_of(std::int64_t{-1}));
  CHECK(run(DType::uint64, RedOp::max, {bytes_of(std::uint64_t{5}), bytes_of(~std::uint64_t{0})}, 1) ==
        bytes_of(~std::uint64_t{0}));
  // float: accumulated in source order in float: (1e8 + 1) + -1e8 = 0 and
  // 1e8 + (1 + -1e8) would be 8.
  CHECK(run(DType::float32, RedOp::sum, {bytes_of(1e8f), bytes_of(1.0f), bytes_of(-1e8f)}, 1) ==
        bytes_of(0.0f));
  CHECK(run(DType::float32, RedOp::avg, {bytes_of(1.0f), bytes_of(2.0f)}, 3) == bytes_of(1.0f));
  CHECK(run(DType::float64, RedOp::avg, {bytes_of(1.0), bytes_of(0.0)}, 3) == bytes_of(1.0 / 3.0));
  // half: 2048 + 1 + 1 is 2050 in float; one rounding at the end keeps it.
  CHECK(run(DType::float16, RedOp::sum,
            {bytes_of(std::uint16_t{0x6800}), bytes_of(std::uint16_t{0x3c00}),
             bytes_of(std::uint16_t{0x3c00})},
            1) == bytes_of(std::uint16_t{0x6801}));
  CHECK(run(DType::float16, RedOp::sum,
            {bytes_of(std::uint16_t{0x7bff}), bytes_of(std::uint16_t{0x7bff}),
             bytes_of(std::uint16_t{0xfbff})},
            1) == bytes_of(std::uint16_t{0x7bff}));  // no overflow in the float accumulator
  CHECK(run(DType::bfloat16, RedOp::avg,
            {bytes_of(std::uint16_t{0x3f80}), bytes_of(std::uint16_t{0x4000})}, 2) ==
        bytes_of(std::uint16_t{0x3fc0}));  // (1 + 2) / 2 = 1.5
  // min/max with NaN: a NaN in src[0] propagates, a later one is dropped.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(get<float>(run(DType::float32, RedOp::min, {bytes_of(nan), bytes_of(1.0f)}, 1).data(), 0)));
  CHECK(run(DType::float32, RedOp::min, {bytes_of(1.0f), bytes_of(nan)}, 1) == bytes_of(1.0f));
  CHECK(run(DType::float32, RedOp::max, {bytes_of(1.0f), bytes_of(nan), bytes_of(2.0f)}, 1) ==
        bytes_of(2.0f));
  CHECK(run(DType::float32, RedOp::max, {bytes_of(-0.0f), bytes_of(0.0f)}, 1) == bytes_of(-0.0f));
}

TEST_CASE("reduce: misaligned pointers") {
  constexpr std::size_t count = 3 * kReduceTileElems + 5;
  std::mt19937_64 rng(99);
  for_each_isa([&] {
  for (const DType dt : kAllDTypes) {
    const std::size_t size = dtype_size(dt);
    for (const RedOp op : kAllOps) {
      for (const std::size_t shift : {size, std::size_t{2}, std::size_t{1}, std::size_t{3}}) {
        CAPTURE(to_string(dt));
        CAPTURE(to_string(op));
        CAPTURE(shift);
        constexpr std::size_t nsrc = 3;
        std::vector<Bytes> aligned(nsrc, Bytes(count * size));
        std::vector<const unsigned char*> aligned_ptrs;
        for (Bytes& a : aligned) {
          fill_random(dt, a.data(), count, rng);
          aligned_ptrs.push_back(a.data());
        }
        const Bytes want = reference(dt, op, aligned_ptrs, count, nsrc);

        // Each source at a different offset from 64-byte alignment.
        std::vector<Bytes> storage(nsrc + 1, Bytes(count * size + 256));
        std::vector<const void*> srcs;
        for (std::size_t k = 0; k < nsrc; ++k) {
          auto base = reinterpret_cast<std::uintptr_t>(storage[k].data());
          base = (base + 63) / 64 * 64 + shift * (k + 1);
          auto* p = reinterpret_cast<unsigned char*>(base);
          std::memcpy(p, aligned[k].data(), count * size);
          srcs.push_back(p);
        }
        auto dbase = reinterpret_cast<std::uintptr_t>(storage[nsrc].data());
        dbase = (dbase + 63) / 64 * 64 + shift;
        auto* dst = reinterpret_cast<unsigned char*>(dbase);
        reduce(dt, op, dst, srcs.data(), nsrc, count, nsrc);
        REQUIRE(first_mismatch(dt, dst, want.data(), count) == SIZE_MAX);

        // In place into a misaligned source.
        void* src1 = const_cast<void*>(srcs[1]);
        reduce(dt, op, src1, srcs.data(), nsrc, count, nsrc);
        REQUIRE(first_mismatch(dt, static_cast<unsigned char*>(src1), want.data(), count) ==
                SIZE_MAX);
      }
    }
  }
  });
}

TEST_CASE("reduce: vectorized half conversions agree with GCC on every half") {
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t h = 0; h < 65536; ++h) all[h] = static_cast<std::uint16_t>(h);
  std::vector<std::uint16_t> out(65536);
  for_each_isa([&] {
    // One source, sum: the kernel converts each half to float and back. NaNs
    // come back quiet with their payload (the scalar round trip).
    const void* srcs[] = {all.data()};
    reduce(DType::float16, RedOp::sum, out.data(), srcs, 1, all.size(), 1);
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const auto h16 = static_cast<std::uint16_t>(h);
      const std::uint16_t want = f16_is_nan(h16) ? static_cast<std::uint16_t>(h16 | 0x0200u)
                                                 : gcc_f32_to_f16(gcc_f16_to_f32(h16));
      REQUIRE_MESSAGE(out[h] == want, "half " << hex(h));
    }
    // Each half plus itself, over 3: float results that need rounding, overflow
    // and subnormal results.
    const void* srcs2[] = {all.data(), all.data()};
    reduce(DType::float16, RedOp::avg, out.data(), srcs2, 2, all.size(), 3);
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const float x = gcc_f16_to_f32(static_cast<std::uint16_t>(h));
      const std::uint16_t want = gcc_f32_to_f16((x + x) / 3.0f);
      const bool both_nan = f16_is_nan(out[h]) && f16_is_nan(want);
      REQUIRE_MESSAGE((out[h] == want || both_nan), "half " << hex(h));
    }
    // Products of neighbours: overflow to Inf, underflow to subnormals and 0.
    std::vector<std::uint16_t> shifted(all.begin() + 1, all.end());
    shifted.push_back(0x3c00);
    const void* srcs3[] = {all.data(), shifted.data()};
    reduce(DType::float16, RedOp::prod, out.data(), srcs3, 2, all.size(), 1);
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const std::uint16_t want = gcc_f32_to_f16(gcc_f16_to_f32(all[h]) * gcc_f16_to_f32(shifted[h]));
      const bool both_nan = f16_is_nan(out[h]) && f16_is_nan(want);
      REQUIRE_MESSAGE((out[h] == want || both_nan), "half " << hex(h));
    }
  });
}

TEST_CASE("reduce: large calls (streaming stores) at odd alignments") {
  // Above kReduceStreamingBytes, destinations at offsets that leave a head and
  // a tail outside 16-byte alignment.
  std::mt19937_64 rng(31337);
  for (const DType dt : {DType::float32, DType::float16, DType::int8, DType::float64}) {
    const std::size_t size = dtype_size(dt);
    const std::size_t count = kReduceStreamingBytes / size / 2 + 3;  // 2 destinations: above
    constexpr std::size_t nsrc = 3, ndst = 2;
    std::vector<Bytes> src(nsrc, Bytes(count * size));
    std::vector<const unsigned char*> ptrs;
    std::vector<const void*> srcs;
    for (Bytes& b : src) {
      fill_random(dt, b.data(), count, rng);
      ptrs.push_back(b.data());
      srcs.push_back(b.data());
    }
    for (const RedOp op : {RedOp::sum, RedOp::max}) {
      const Bytes want = reference(dt, op, ptrs, count, nsrc);
      for_each_isa([&] {
        for (const std::size_t shift : {std::size_t{0}, std::size_t{2}, size + 4}) {
          CAPTURE(to_string(dt));
          CAPTURE(shift);
          std::vector<Bytes> storage(ndst, Bytes(count * size + 128, kGuardByte));
          std::vector<void*> dsts;
          for (Bytes& b : storage) {
            auto base = reinterpret_cast<std::uintptr_t>(b.data());
            base = (base + 63) / 64 * 64 + shift;
            dsts.push_back(reinterpret_cast<void*>(base));
          }
          reduce_multi(dt, op, dsts.data(), ndst, srcs.data(), nsrc, count, nsrc);
          for (std::size_t j = 0; j < ndst; ++j) {
            const auto* got = static_cast<const unsigned char*>(dsts[j]);
            REQUIRE(first_mismatch(dt, got, want.data(), count) == SIZE_MAX);
            const std::size_t before = static_cast<std::size_t>(got - storage[j].data());
            for (std::size_t g = 0; g < before; ++g) REQUIRE(storage[j][g] == kGuardByte);
            for (std::size_t g = before + count * size; g < storage[j].size(); ++g) {
              REQUIRE(storage[j][g] == kGuardByte);
            }
          }
        }
      });
    }
  }
}

TEST_CASE("reduce: kernel variants") {
  const ReduceIsa best = reduce_isa();
  MESSAGE("kernel variant in use: " << std::string(to_string(best)));
  CHECK(set_reduce_isa(ReduceIsa::sse2) == ReduceIsa::sse2);
  CHECK(reduce_isa() == ReduceIsa::sse2);
  CHECK(set_reduce_isa(ReduceIsa::avx2_f16c) == best);  // clamped to the CPU's
  CHECK(reduce_isa() == best);
  CHECK(to_string(ReduceIsa::avx2) == "avx2");
#if defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    CHECK(best == ReduceIsa::avx2_f16c);
  }
#endif
}

TEST_CASE("reduce: bad arguments") {
  float a = 1, b = 2;
  const void* srcs[] = {&a};
  void* dsts[] = {&b};
  const auto code_of = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.code();
    }
    return Code::ok;
  };
  CHECK(code_of([&] { reduce(DType::float32, RedOp::avg, &b, srcs, 1, 1, 0); }) ==
        Code::invalid_argument);
  CHECK(code_of([&] { reduce(DType::float32, RedOp::sum, &b, srcs, 0, 1, 1); }) ==
        Code::invalid_argument);
  CHECK(code_of([&] { reduce_multi(DType::float32, RedOp::sum, dsts, 0, srcs, 1, 1, 1); }) ==
        Code::invalid_argument);
  CHECK(code_of([&] { reduce(static_cast<DType>(10), RedOp::sum, &b, srcs, 1, 1, 1); }) ==
        Code::invalid_argument);
  CHECK(code_of([&] { reduce(DType::float32, static_cast<RedOp>(5), &b, srcs, 1, 1, 1); }) ==
        Code::invalid_argument);
  CHECK(b == 2);
  CHECK(code_of([&] { reduce(DType::float32, RedOp::sum, &b, srcs, 1, 0, 0); }) == Code::ok);
  CHECK(b == 2);
}

// ---------------------------------------------------------------------------
// Throughput (prints, asserts nothing about speed)
// ---------------------------------------------------------------------------

TEST_CASE("benchmark: 4 sources x 16 MiB into 4 destinations") {
  constexpr std::size_t kBytes = 16u << 20;
  constexpr std::size_t kSrc = 4, kDst = 4;
  std::vector<Bytes> src(kSrc, Bytes(kBytes)), dst(kDst, Bytes(kBytes));
  // Cheap, non-trivial values (no subnormals, which would be slow).
  const auto fill = [](DType dt, unsigned char* p, std::size_t count, std::size_t seed) {
    for (std::size_t i = 0; i < count; ++i) {
      const float v = static_cast<float>((i * 7 + seed * 13) % 1000) * 0.37f - 150.0f;
      if (dt == DType::float32) put<float>(p, i, v);
      if (dt == DType::float16) put<std::uint16_t>(p, i, f32_to_f16(v));
      if (dt == DType::bfloat16) put<std::uint16_t>(p, i, f32_to_bf16(v));
    }
  };
  std::vector<const void*> srcs;
  std::vector<void*> dsts;
  for (Bytes& d : dst) dsts.push_back(d.data());

  const auto best_of = [](int reps, auto&& fn) {
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      const auto t1 = std::chrono::steady_clock::now();
      best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
    }
    return best;
  };
  const auto report = [&](const char* what, double seconds) {
    const double traffic = static_cast<double>((kSrc + kDst) * kBytes) / seconds / 1e9;
    const double per_buffer = static_cast<double>(kBytes) / seconds / 1e9;
    std::printf("[bench] %-38s %7.2f ms  %6.2f GB/s memory traffic (%zu reads + %zu writes), "
                "%6.2f GB/s per buffer\n",
                what, seconds * 1e3, traffic, kSrc, kDst, per_buffer);
  };

  for (const DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
    srcs.clear();
    for (std::size_t k = 0; k < kSrc; ++k) {
      fill(dt, src[k].data(), kBytes / dtype_size(dt), k);
      srcs.push_back(src[k].data());
    }
    const std::size_t count = kBytes / dtype_size(dt);
    const double t = best_of(5, [&] {
      reduce_multi(dt, RedOp::sum, dsts.data(), kDst, srcs.data(), kSrc, count, kSrc);
    });
    report((std::string(to_string(dt)) + " sum").c_str(), t);
  }
  std::printf("[bench] kernel variant: %s\n", std::string(to_string(reduce_isa())).c_str());
  // Baseline: the same traffic with memcpy (4 x read+write of 16 MiB).
  const double t = best_of(5, [&] {
    for (std::size_t j = 0; j < kDst; ++j) std::memcpy(dsts[j], src[j].data(), kBytes);
  });
  report("memcpy baseline (4 x 16 MiB)", t);

  // In cache: 4 sources x 32 KiB into 1 destination, many times (compute bound),
  // for each kernel variant.
  constexpr std::size_t kSmall = 32u << 10;
  const std::size_t reps = 1000;
  const ReduceIsa best = reduce_isa();
  for (const DType dt : {DType::float32, DType::float16, DType::bfloat16, DType::int8}) {
    for (std::size_t k = 0; k < kSrc; ++k) fill(dt, src[k].data(), kSmall / dtype_size(dt), k);
    for (int i = 0; i <= static_cast<int>(best); ++i) {
      const ReduceIsa isa = set_reduce_isa(static_cast<ReduceIsa>(i));
      const double ts = best_of(3, [&] {
        for (std::size_t r = 0; r < reps; ++r) {
          reduce_multi(dt, RedOp::sum, dsts.data(), 1, srcs.data(), kSrc,
                       kSmall / dtype_size(dt), kSrc);
        }
      });
      std::printf("[bench] %-8s sum in cache, 4 x 32 KiB -> 1, %-9s: %6.2f GB/s of sources read\n",
                  std::string(to_string(dt)).c_str(), std::string(to_string(isa)).c_str(),
                  static_cast<double>(reps * kSrc * kSmall) / ts / 1e9);
    }
  }
  set_reduce_isa(best);
  CHECK(true);
}
