// Reduction kernels. Layout of the work: the element range is cut into tiles of
// kReduceTileElems; for each tile an accumulator on the stack (<= 16 KiB, plus
// as much again for the converted result) takes src[0] combined with src[1] in
// one pass, then every further source, then is copied to every destination.
// Every source byte is read once and every destination byte written once; the
// accumulator stays in L1. Large calls write with streaming stores.
//
// Each (dtype, op) kernel is one always-inlined body of plain loops, compiled
// twice: as is (SSE2, the x86-64 baseline) and in a function with
// __attribute__((target("avx2"))), so GCC vectorizes it once per ISA. float16
// on AVX2 CPUs (all of which have F16C) has its own kernel with vcvtph2ps /
// vcvtps2ph. The variant is chosen from cpuid at first use (and can be forced
// for tests). Explicit dispatch rather than target_clones/ifunc: it works the
// same in static and shared links, and tests can run every variant.
//
// Source elements are loaded with memcpy, so pointers with any alignment work
// (the vector code uses unaligned loads).
//
// This file is compiled with -O3 (engine/CMakeLists.txt); nothing here may
// depend on -ffast-math, which would change results.
#include "engine/reduce.h"

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "ipc/error.h"

namespace collectived::engine {

namespace {

#define CD_ALWAYS_INLINE inline __attribute__((always_inline))

// ---- Element traits: storage type S, accumulator type A, conversions ----

template <class T>
struct Plain {
  using S = T;
  using A = T;
  static constexpr bool kConverts = false;
  static CD_ALWAYS_INLINE A load(S x) { return x; }
  static CD_ALWAYS_INLINE S store(A x) { return x; }
};

struct Half {
  using S = std::uint16_t;
  using A = float;
  static constexpr bool kConverts = true;
  static CD_ALWAYS_INLINE A load(S x) { return f16_to_f32(x); }
  static CD_ALWAYS_INLINE S store(A x) { return f32_to_f16(x); }
};

struct BFloat {
  using S = std::uint16_t;
  using A = float;
  static constexpr bool kConverts = true;
  // Without bf16_to_f32's quieting of signalling NaNs: unobservable here, since
  // f32_to_bf16 makes every NaN result quiet, and it saves three vector ops.
  static CD_ALWAYS_INLINE A load(S x) { return std::bit_cast<float>(static_cast<std::uint32_t>(x) << 16); }
  static CD_ALWAYS_INLINE S store(A x) { return f32_to_bf16(x); }
};

template <DType D>
struct TraitsOf;
template <> struct TraitsOf<DType::int8> : Plain<std::int8_t> {};
template <> struct TraitsOf<DType::uint8> : Plain<std::uint8_t> {};
template <> struct TraitsOf<DType::int32> : Plain<std::int32_t> {};
template <> struct TraitsOf<DType::uint32> : Plain<std::uint32_t> {};
template <> struct TraitsOf<DType::int64> : Plain<std::int64_t> {};
template <> struct TraitsOf<DType::uint64> : Plain<std::uint64_t> {};
template <> struct TraitsOf<DType::float16> : Half {};
template <> struct TraitsOf<DType::bfloat16> : BFloat {};
template <> struct TraitsOf<DType::float32> : Plain<float> {};
template <> struct TraitsOf<DType::float64> : Plain<double> {};

// ---- Operators on the accumulator type ----

template <RedOp O, class A>
CD_ALWAYS_INLINE A combine(A acc, A x) {
  if constexpr (O == RedOp::sum || O == RedOp::avg) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(acc) + static_cast<U>(x)));
    } else {
      return acc + x;
    }
  } else if constexpr (O == RedOp::prod) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      // 8-bit operands promote to int; 255 * 255 cannot overflow it.
      return static_cast<A>(static_cast<U>(static_cast<U>(acc) * static_cast<U>(x)));
    } else {
      return acc * x;
    }
  } else if constexpr (O == RedOp::min) {
    return (x < acc) ? x : acc;
  } else {
    static_assert(O == RedOp::max);
    return (x > acc) ? x : acc;
  }
}

template <class A>
CD_ALWAYS_INLINE A divide(A sum, std::size_t divisor) {
  if constexpr (std::is_floating_point_v<A>) {
    return sum / static_cast<A>(divisor);
  } else if constexpr (std::is_unsigned_v<A>) {
    return static_cast<A>(static_cast<std::uint64_t>(sum) / static_cast<std::uint64_t>(divisor));
  } else {
    const auto v = static_cast<std::int64_t>(sum);
    if (divisor > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max())) {
      // |v| <= 2^63 <= divisor: the quotient is 0, or -1 for INT64_MIN / 2^63.
      return static_cast<A>(v == std::numeric_limits<std::int64_t>::min() &&
                                    divisor == (std::size_t{1} << 63)
                                ? -1
                                : 0);
    }
    return static_cast<A>(v / static_cast<std::int64_t>(divisor));
  }
}

// ---- Tile loops (inlined into the multiversioned kernels) ----

template <class S>
CD_ALWAYS_INLINE S load_at(const unsigned char* p, std::size_t i) {
  S v;
  std::memcpy(&v, p + i * sizeof(S), sizeof(S));
  return v;
}

template <class Tr>
CD_ALWAYS_INLINE void tile_load(typename Tr::A* __restrict acc, const unsigned char* __restrict s0,
                                std::size_t n) {
  using S = typename Tr::S;
  for (std::size_t i = 0; i < n; ++i) acc[i] = Tr::load(load_at<S>(s0, i));
}

template <class Tr, RedOp O>
CD_ALWAYS_INLINE void tile_first(typename Tr::A* __restrict acc, const unsigned char* __restrict s0,
                                 const unsigned char* __restrict s1, std::size_t n) {
  using S = typename Tr::S;
  for (std::size_t i = 0; i < n; ++i) {
    acc[i] = combine<O>(Tr::load(load_at<S>(s0, i)), Tr::load(load_at<S>(s1, i)));
  }
}

template <class Tr, RedOp O>
CD_ALWAYS_INLINE void tile_combine(typename Tr::A* __restrict acc,
                                   const unsigned char* __restrict s, std::size_t n) {
  using S = typename Tr::S;
  for (std::size_t i = 0; i < n; ++i) acc[i] = combine<O>(acc[i], Tr::load(load_at<S>(s, i)));
}

template <class Tr, RedOp O>
CD_ALWAYS_INLINE void tile_finish(typename Tr::S* __restrict out,
                                  const typename Tr::A* __restrict acc, std::size_t n,
                                  std::size_t divisor) {
  if constexpr (O == RedOp::avg) {
    for (std::size_t i = 0; i < n; ++i) out[i] = Tr::store(divide(acc[i], divisor));
  } else {
    for (std::size_t i = 0; i < n; ++i) out[i] = Tr::store(acc[i]);
  }
}

struct Args {
  void* const* dsts;
  std::size_t ndst;
  const void* const* srcs;
  std::size_t nsrc;
  std::size_t count;
  std::size_t divisor;
  bool streaming;  ///< write destinations with non-temporal stores
};

/// Copies one finished tile to a destination. Streaming stores (SSE2, so any
/// x86-64) skip the read-for-ownership of the destination's cache lines and
/// leave the caches to the sources; the kernel ends with an sfence.
CD_ALWAYS_INLINE void store_tile(unsigned char* d, const unsigned char* s, std::size_t bytes,
                                 bool streaming) {
  if (!streaming) {
    std::memcpy(d, s, bytes);
    return;
  }
  std::size_t head = (0u - reinterpret_cast<std::uintptr_t>(d)) & 15u;
  head = std::min(head, bytes);
  std::memcpy(d, s, head);
  std::size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
  std::memcpy(d + i, s + i, bytes - i);
}

CD_ALWAYS_INLINE void store_all(const Args& a, std::size_t offset, const void* result,
                                std::size_t bytes) {
  for (std::size_t j = 0; j < a.ndst; ++j) {
    store_tile(static_cast<unsigned char*>(a.dsts[j]) + offset,
               static_cast<const unsigned char*>(result), bytes, a.streaming);
  }
}

CD_ALWAYS_INLINE const unsigned char* src_at(const Args& a, std::size_t k, std::size_t offset) {
  return static_cast<const unsigned char*>(a.srcs[k]) + offset;
}

/// The portable kernel: plain C++ loops that GCC vectorizes for whatever
/// target the function it is inlined into has.
template <DType D, RedOp O>
CD_ALWAYS_INLINE void kernel_body(const Args& a) {
  using Tr = TraitsOf<D>;
  using S = typename Tr::S;
  using A = typename Tr::A;
  constexpr std::size_t kTile = kReduceTileElems;
  constexpr bool kNeedsOut = Tr::kConverts || O == RedOp::avg;

  alignas(64) A acc[kTile];
  alignas(64) S out[kNeedsOut ? kTile : 1];

  for (std::size_t base = 0; base < a.count; base += kTile) {
    const std::size_t n = std::min(kTile, a.count - base);
    const std::size_t offset = base * sizeof(S);

    if (a.nsrc == 1) {
      tile_load<Tr>(acc, src_at(a, 0, offset), n);
    } else {
      tile_first<Tr, O>(acc, src_at(a, 0, offset), src_at(a, 1, offset), n);
      for (std::size_t k = 2; k < a.nsrc; ++k) tile_combine<Tr, O>(acc, src_at(a, k, offset), n);
    }

    const void* result = acc;
    if constexpr (kNeedsOut) {
      tile_finish<Tr, O>(out, acc, n, a.divisor);
      result = out;
    }
    store_all(a, offset, result, n * sizeof(S));
  }
  if (a.streaming) _mm_sfence();
}

template <DType D, RedOp O>
void kernel_sse2(const Args& a) {
  kernel_body<D, O>(a);
}

template <DType D, RedOp O>
__attribute__((target("avx2"))) void kernel_avx2(const Args& a) {
  kernel_body<D, O>(a);
}

// ---- float16 with F16C (vcvtph2ps / vcvtps2ph: 8 conversions per instruction) ----

#define CD_F16C_INLINE inline __attribute__((always_inline, target("avx2,f16c")))

template <RedOp O>
CD_F16C_INLINE __m256 combine8(__m256 acc, __m256 x) {
  if constexpr (O == RedOp::sum || O == RedOp::avg) {
    return _mm256_add_ps(acc, x);
  } else if constexpr (O == RedOp::prod) {
    return _mm256_mul_ps(acc, x);
  } else if constexpr (O == RedOp::min) {
    return _mm256_min_ps(x, acc);  // x < acc ? x : acc, as combine<min>
  } else {
    return _mm256_max_ps(x, acc);  // x > acc ? x : acc, as combine<max>
  }
}

CD_F16C_INLINE __m256 load8_f16(const unsigned char* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <RedOp O>
__attribute__((target("avx2,f16c"))) void kernel_f16c(const Args& a) {
  constexpr std::size_t kTile = kReduceTileElems;
  using S = std::uint16_t;
  alignas(64) float acc[kTile];
  alignas(64) S out[kTile];
  const __m256 div8 = _mm256_set1_ps(static_cast<float>(a.divisor));

  for (std::size_t base = 0; base < a.count; base += kTile) {
    const std::size_t n = std::min(kTile, a.count - base);
    const std::size_t nv = n & ~std::size_t{7};
    const std::size_t offset = base * sizeof(S);

    const unsigned char* s0 = src_at(a, 0, offset);
    if (a.nsrc == 1) {
      for (std::size_t i = 0; i < nv; i += 8) _mm256_store_ps(acc + i, load8_f16(s0 + 2 * i));
      for (std::size_t i = nv; i < n; ++i) acc[i] = f16_to_f32(load_at<S>(s0, i));
    } else {
      const unsigned char* s1 = src_at(a, 1, offset);
      for (std::size_t i = 0; i < nv; i += 8) {
        _mm256_store_ps(acc + i, combine8<O>(load8_f16(s0 + 2 * i), load8_f16(s1 + 2 * i)));
      }
      for (std::size_t i = nv; i < n; ++i) {
        acc[i] = combine<O>(f16_to_f32(load_at<S>(s0, i)), f16_to_f32(load_at<S>(s1, i)));
      }
      for (std::size_t k = 2; k < a.nsrc; ++k) {
        const unsigned char* s = src_at(a, k, offset);
        for (std::size_t i = 0; i < nv; i += 8) {
          _mm256_store_ps(acc + i, combine8<O>(_mm256_load_ps(acc + i), load8_f16(s + 2 * i)));
        }
        for (std::size_t i = nv; i < n; ++i) acc[i] = combine<O>(acc[i], f16_to_f32(load_at<S>(s, i)));
      }
    }

    for (std::size_t i = 0; i < nv; i += 8) {
      __m256 v = _mm256_load_ps(acc + i);
      if constexpr (O == RedOp::avg) v = _mm256_div_ps(v, div8);
      _mm_store_si128(reinterpret_cast<__m128i*>(out + i),
                      _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    for (std::size_t i = nv; i < n; ++i) {
      float v = acc[i];
      if constexpr (O == RedOp::avg) v = divide(v, a.divisor);
      out[i] = f32_to_f16(v);
    }
    store_all(a, offset, out, n * sizeof(S));
  }
  if (a.streaming) _mm_sfence();
}

// ---- Dispatch ----

using KernelFn = void (*)(const Args&);
using OpTable = std::array<KernelFn, kRedOpCount>;
using Table = std::array<OpTable, kDTypeCount>;

template <template <DType, RedOp> class K, DType D>
constexpr OpTable ops_of() {
  return {K<D, RedOp::sum>::run, K<D, RedOp::prod>::run, K<D, RedOp::min>::run,
          K<D, RedOp::max>::run, K<D, RedOp::avg>::run};
}

template <template <DType, RedOp> class K>
constexpr Table table_of() {
  return {ops_of<K, DType::int8>(),    ops_of<K, DType::uint8>(),   ops_of<K, DType::int32>(),
          ops_of<K, DType::uint32>(),  ops_of<K, DType::int64>(),   ops_of<K, DType::uint64>(),
          ops_of<K, DType::float16>(), ops_of<K, DType::bfloat16>(), ops_of<K, DType::float32>(),
          ops_of<K, DType::float64>()};
}

template <DType D, RedOp O>
struct Sse2 {
  static constexpr KernelFn run = &kernel_sse2<D, O>;
};
template <DType D, RedOp O>
struct Avx2 {
  static constexpr KernelFn run = &kernel_avx2<D, O>;
};

constexpr Table kSse2 = table_of<Sse2>();
constexpr Table kAvx2 = table_of<Avx2>();
constexpr OpTable kF16c = {&kernel_f16c<RedOp::sum>, &kernel_f16c<RedOp::prod>,
                           &kernel_f16c<RedOp::min>, &kernel_f16c<RedOp::max>,
                           &kernel_f16c<RedOp::avg>};

ReduceIsa best_isa() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2")) return ReduceIsa::sse2;
  // cpuid leaf 1, ecx bit 29 (clang before 16 has no "f16c" for __builtin_cpu_supports).
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || (ecx & bit_F16C) == 0) return ReduceIsa::avx2;
  return ReduceIsa::avx2_f16c;
}

ReduceIsa supported_isa() {
  static const ReduceIsa isa = best_isa();
  return isa;
}

std::atomic<ReduceIsa>& current_isa() {
  static std::atomic<ReduceIsa> isa{supported_isa()};
  return isa;
}

KernelFn find_kernel(DType dtype, RedOp op) {
  const auto d = static_cast<std::size_t>(dtype);
  const auto o = static_cast<std::size_t>(op);
  if (d >= kDTypeCount || o >= kRedOpCount) return nullptr;
  switch (current_isa().load(std::memory_order_relaxed)) {
    case ReduceIsa::sse2: return kSse2[d][o];
    case ReduceIsa::avx2: return kAvx2[d][o];
    case ReduceIsa::avx2_f16c: return dtype == DType::float16 ? kF16c[o] : kAvx2[d][o];
  }
  return nullptr;
}

[[noreturn]] void invalid(const std::string& what) {
  throw Error(Code::invalid_argument, "reduce: " + what);
}

}  // namespace

void reduce_multi(DType dtype, RedOp op, void* const* dsts, std::size_t ndst,
                  const void* const* srcs, std::size_t nsrc, std::size_t count,
                  std::size_t avg_divisor) {
  const KernelFn fn = find_kernel(dtype, op);
  if (fn == nullptr) {
    invalid("unknown dtype " + std::to_string(static_cast<unsigned>(dtype)) + " or op " +
            std::to_string(static_cast<unsigned>(op)));
  }
  if (nsrc == 0) invalid("no source");
  if (ndst == 0) invalid("no destination");
  if (op == RedOp::avg && avg_divisor == 0) invalid("avg with a divisor of 0");
  if (count == 0) return;
  const bool streaming = count * dtype_size(dtype) * ndst >= kReduceStreamingBytes;
  fn(Args{dsts, ndst, srcs, nsrc, count, avg_divisor, streaming});
}

void reduce(DType dtype, RedOp op, void* dst, const void* const* srcs, std::size_t nsrc,
            std::size_t count, std::size_t avg_divisor) {
  void* const dsts[1] = {dst};
  reduce_multi(dtype, op, dsts, 1, srcs, nsrc, count, avg_divisor);
}

ReduceIsa reduce_isa() { return current_isa().load(std::memory_order_relaxed); }

ReduceIsa set_reduce_isa(ReduceIsa isa) {
  const ReduceIsa best = supported_isa();
  const ReduceIsa use = static_cast<std::uint8_t>(isa) < static_cast<std::uint8_t>(best) ? isa : best;
  current_isa().store(use, std::memory_order_relaxed);
  return use;
}

std::string_view to_string(ReduceIsa isa) {
  switch (isa) {
    case ReduceIsa::sse2: return "sse2";
    case ReduceIsa::avx2: return "avx2";
    case ReduceIsa::avx2_f16c: return "avx2+f16c";
  }
  return "unknown";
}

}  // namespace collectived::engine
