// Element-wise reduction kernels on host memory: the arithmetic of all-reduce,
// reduce and reduce-scatter.
//
// Semantics (bit-exact; tests elsewhere compute the same reference):
//  - Sources are combined in source order: acc = src[0]; acc = op(acc, src[k]).
//  - Integers: sum and prod wrap modulo 2^bits; min/max compare as the signed or
//    unsigned type; avg = (wrapped sum, read as the element type) / avg_divisor
//    with C++ integer division (truncation toward zero, signed for signed types).
//  - float32 accumulates in float, float64 in double; float16 and bfloat16 convert
//    each input to float, accumulate in float and round once at the end (round to
//    nearest even). avg divides the float (double for float64) sum by
//    static_cast<float>(avg_divisor) (double for float64), before that rounding.
//  - Float min is acc = (x < acc) ? x : acc and max is acc = (x > acc) ? x : acc,
//    x being the next source. So a NaN in src[0] propagates (every comparison
//    with it is false), a NaN in a later source is dropped unless acc already is
//    NaN; between -0 and +0 the accumulator (the earlier source) is kept.
//
// Kernels are compiled for SSE2 (any x86-64) and AVX2, plus F16C conversions
// for float16; the best the CPU has is picked at first use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/dtype.h"

namespace collectived::engine {

/// Elements per tile: each tile is read from every source into an accumulator
/// (in L1/L2) before it is written to any destination.
inline constexpr std::size_t kReduceTileElems = 2048;

/// A call that writes at least this many bytes (count * element size * ndst)
/// writes its destinations with non-temporal (streaming) stores: no read for
/// ownership of their cache lines, and the caches are left to the sources.
inline constexpr std::size_t kReduceStreamingBytes = std::size_t{4} << 20;

/// Element-wise reduction of `nsrc` arrays of `count` elements, accumulated in
/// source order (acc = src[0]; acc = op(acc, src[1]); ...), written to each of the
/// `ndst` destinations. Any destination may be exactly the same pointer as any
/// source (in-place): every tile of elements is read from all sources before it
/// is written. Partially overlapping buffers are not supported. Pointers need
/// only byte alignment. For avg the sum is divided by `avg_divisor` (the number
/// of ranks; must be > 0).
///
/// Throws Error(invalid_argument) for a dtype or op outside the enums, nsrc == 0,
/// ndst == 0, or op == avg with avg_divisor == 0. count == 0 does nothing.
void reduce_multi(DType dtype, RedOp op, void* const* dsts, std::size_t ndst,
                  const void* const* srcs, std::size_t nsrc, std::size_t count,
                  std::size_t avg_divisor);

/// Single destination convenience.
void reduce(DType dtype, RedOp op, void* dst, const void* const* srcs, std::size_t nsrc,
            std::size_t count, std::size_t avg_divisor);

/// Instruction-set variant of the kernels.
enum class ReduceIsa : std::uint8_t {
  sse2 = 0,       ///< baseline x86-64
  avx2 = 1,       ///< AVX2 (float16 converted with integer bit operations)
  avx2_f16c = 2,  ///< AVX2, and F16C instructions for float16
};

/// The variant in use: the best the CPU supports unless set_reduce_isa() chose another.
ReduceIsa reduce_isa();

/// For tests and benchmarks: use `isa`, or the best supported one below it;
/// returns the variant now in use. Affects calls that start afterwards.
ReduceIsa set_reduce_isa(ReduceIsa isa);

/// "sse2", "avx2", "avx2+f16c".
std::string_view to_string(ReduceIsa isa);

}  // namespace collectived::engine
