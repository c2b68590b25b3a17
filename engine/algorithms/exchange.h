// The exchange between nodes: every node sends every other node what is
// meant for it, in one round, with no reduction (NodeAlgorithm::exchange).
// The all-to-all, and node_exchange (engine/node_algorithms.h): barriers,
// zero-byte operations, and the engine's own small all-gathers.
#pragma once

#include <cstdint>

#include "engine/algorithms/context.h"

namespace collectived::engine::algorithms {

/// All-to-all of `op` (`one`: the bytes of one block, from one rank to one
/// rank): one message to each other node, with this node's ranks' blocks
/// for that node's ranks; the blocks between local ranks are copied here.
void exchange_all_to_all(Context& c, const NodeCollective& op, std::uint64_t one);

}  // namespace collectived::engine::algorithms
