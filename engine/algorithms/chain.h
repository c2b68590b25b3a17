// Chains between nodes for the broadcast and the reduce: each node passes
// the data to the next, pipelined in chunks, so that every link carries it
// once. For large operations, where the root's link is the bottleneck of a
// direct exchange or a tree.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/algorithms/context.h"

namespace collectived::engine::algorithms {

/// Pipelined chain broadcast of `bytes` at `buf` from node `root`: root,
/// root+1, ...; each chunk is received in place where the transport places
/// it, and forwarded at once.
void chain_broadcast(Context& c, std::byte* buf, std::uint64_t bytes, int root,
                     std::uint64_t phase);

/// Pipelined chain reduce toward node `root`: the chain starts at root+1 and
/// ends at root, whose `buf` then holds the reduction over all nodes.
void chain_reduce(Context& c, std::byte* buf, std::uint64_t bytes, int root, DType dtype, RedOp op,
                  std::uint64_t phase);

}  // namespace collectived::engine::algorithms
