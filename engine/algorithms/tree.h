// Binomial trees between nodes for the broadcast and the reduce: ceil(log2 N)
// rounds, where the direct broadcast has the root send N-1 times and the
// chain reduce takes N-1 hops. For small operations on many nodes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/algorithms/context.h"

namespace collectived::engine::algorithms {

/// Binomial-tree broadcast of `bytes` at `buf` from node `root`. Node v
/// (counted from the root) receives from v less its lowest set bit, then
/// sends to v + 2^k for each 2^k below that bit, farthest first.
void tree_broadcast(Context& c, std::byte* buf, std::uint64_t bytes, int root, std::uint64_t phase);

/// Binomial-tree reduce toward node `root` (the broadcast's tree, leaves
/// first): node v reduces what v + 1, v + 2, v + 4, ... (below its lowest
/// set bit) send, then sends to its parent; the root's `buf` then holds the
/// reduction over all nodes.
void tree_reduce(Context& c, std::byte* buf, std::uint64_t bytes, int root, DType dtype, RedOp op,
                 std::uint64_t phase);

}  // namespace collectived::engine::algorithms
