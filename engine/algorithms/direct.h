// The direct exchange between nodes: one round, every node sends its whole
// contribution to every other node (the broadcast: the root to every node).
// Latency first: the choice for small operations on few nodes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/algorithms/context.h"

namespace collectived::engine::algorithms {

/// Direct all-gather: every node sends its segment to every other one.
void direct_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                       std::uint64_t phase);

/// Direct all-reduce of `bytes` at `buf`: one round, then every node reduces
/// the N contributions in node order (so all get the same bits).
void direct_all_reduce(Context& c, std::byte* buf, std::uint64_t bytes, DType dtype, RedOp op,
                       std::uint64_t phase);

/// Direct broadcast of `bytes` at `buf` from node `root`: the root sends it
/// to every other node.
void direct_broadcast(Context& c, std::byte* buf, std::uint64_t bytes, int root,
                      std::uint64_t phase);

}  // namespace collectived::engine::algorithms
