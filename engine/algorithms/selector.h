// The one place that decides which algorithm between nodes an operation
// takes: by its kind, its size and the number of nodes, and the profile's
// collectives.* (NodeAlgorithmOptions). choose_node_algorithm and node_plan
// (engine/node_algorithms.h) are built on the predicates here; the runner
// (engine/node_algorithms.cc) dispatches on the plan alone, so that the plan
// on the wire and what runs cannot drift apart.
#pragma once

#include <cstdint>

#include "engine/node_algorithms.h"

namespace collectived::engine::algorithms {

/// Up to direct_max_bytes (or the "direct" override): the direct exchange.
bool use_direct(std::uint64_t bytes, const NodeAlgorithmOptions& o);
/// Above the direct size: pairwise (one step) or ring (N-1 steps).
bool use_pairwise(int nodes, const NodeAlgorithmOptions& o);
/// An all-reduce above the direct size: pairwise, or the ring from
/// kRingMinBytes on kRingMinNodes nodes (selector.cc says why).
bool large_pairwise(std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o);
/// A reduce-scatter's: pairwise, or the ring (selector.cc says when).
bool scatter_pairwise(std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o);
/// The log-depth algorithms for small operations: recursive doubling for the
/// all-reduce, binomial trees for the broadcast and the reduce.
bool use_tree(OpKind kind, std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o);

/// Whether `a` is one of the algorithms between nodes for `kind` (what
/// choose_node_algorithm may plan for it), or none (one node).
bool serves(NodeAlgorithm a, OpKind kind);

enum class GatherKind { direct, pairwise, ring };
/// An all-gather's algorithm between nodes, for `total` bytes of output.
GatherKind all_gather_kind(std::uint64_t total, int nodes, const NodeAlgorithmOptions& o);

}  // namespace collectived::engine::algorithms
