// Recursive doubling between nodes for the all-reduce: log2 N rounds of the
// whole buffer with one partner each, where the direct exchange sends it N-1
// times per node in one round. For small all-reduces on 3 or more nodes (on 2
// it is the direct exchange).
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/algorithms/context.h"

namespace collectived::engine::algorithms {

/// Recursive doubling all-reduce of `bytes` at `buf`. With N = p + r (p the
/// largest power of two up to N), node 2k < 2r first hands its contribution
/// to node 2k+1 and gets the result back from it at the end; the p others
/// take part as virtual nodes 0..p-1 in node order. Each combination puts
/// the lower nodes' value first on both ends, so every node reduces the same
/// expression: the same bits.
void recursive_doubling_all_reduce(Context& c, std::byte* buf, std::uint64_t bytes, DType dtype,
                                   RedOp op, std::uint64_t phase);

}  // namespace collectived::engine::algorithms
