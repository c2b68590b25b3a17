#include "engine/algorithms/selector.h"

#include <algorithm>
#include <string>

#include "engine/algorithms/segments.h"

namespace collectived::engine::algorithms {

namespace {

/// An all-reduce or reduce-scatter of at least this many bytes per rank (the
/// all-reduce's buffer, the reduce-scatter's output) on at least
/// kRingMinNodes nodes takes the ring where pairwise_max_nodes would allow
/// pairwise (auto only).
constexpr std::uint64_t kRingMinBytes = std::uint64_t{8} << 20;
constexpr int kRingMinNodes = 4;

/// Up to this many bytes per rank (and direct_max_bytes), a reduce-scatter
/// is pairwise on any number of nodes (scatter_pairwise).
constexpr std::uint64_t kPairwiseScatterMaxBytes = std::uint64_t{16} << 10;

/// From this many bytes of output per node, an all-gather over three or more
/// nodes takes the ring instead of the pairwise exchange (all_gather_kind).
/// Pairwise keeps every link of a node busy at once, which small transfers
/// need; for large ones the N-1 streams per node at once cost more than they
/// give (a real network adds the incast of N-1 senders on each receiver).
/// With one TCP stream per peer the ring is ahead from 2 MiB per node
/// (docs/architecture.md, "Communicators across nodes").
constexpr std::uint64_t kRingAllGatherMinBytes = std::uint64_t{2} << 20;

}  // namespace

bool use_direct(std::uint64_t bytes, const NodeAlgorithmOptions& o) {
  if (o.algorithm != AlgorithmOverride::automatic) {
    return o.algorithm == AlgorithmOverride::direct;  // an override
  }
  return bytes <= o.direct_max_bytes;
}

bool use_pairwise(int nodes, const NodeAlgorithmOptions& o) {
  if (o.algorithm != AlgorithmOverride::automatic) {
    return o.algorithm == AlgorithmOverride::pairwise;  // an override
  }
  return nodes <= o.pairwise_max_nodes;
}

/// The ring's steps forward what was just reduced, still in cache, where
/// pairwise sends every segment of the input and of the result from memory;
/// with one rank on the node it also reduces the input where it is
/// (ring_reduce_scatter). That wins from 8 MiB on 4 nodes; below it each ring
/// step is one chunk (no pipelining), and on 3 nodes the two are even, so
/// those keep pairwise (docs/architecture.md).
bool large_pairwise(std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o) {
  return use_pairwise(nodes, o) &&
         !(o.algorithm == AlgorithmOverride::automatic && nodes >= kRingMinNodes &&
           bytes >= kRingMinBytes);
}

/// Pairwise on up to pairwise_max_nodes nodes, and at every node count for
/// the smallest operations: one round of the ring's bytes instead of its N-1
/// sequential steps, which wins up to 16 KiB per rank (above it, N-1 senders
/// at once on each receiver cost more). From kRingMinBytes per rank on
/// kRingMinNodes nodes it takes the ring, as the all-reduce does
/// (large_pairwise): with one rank on the node the ring reduces the input
/// where it is and the last step straight into the output.
bool scatter_pairwise(std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o) {
  const bool small = o.algorithm == AlgorithmOverride::automatic &&
                     bytes <= std::min<std::uint64_t>(o.direct_max_bytes, kPairwiseScatterMaxBytes);
  return small || large_pairwise(bytes, nodes, o);
}

/// Up to direct_max_bytes: recursive doubling for the all-reduce on any
/// number of nodes, binomial trees for the broadcast and the reduce on more
/// than pairwise_max_nodes. The direct exchange's one round has every node
/// send the whole buffer N-1 times, and the chain reduce takes N-1 hops.
/// Recursive doubling sends fewer messages for the same bytes, which wins
/// from 3 nodes; the broadcast and reduce trees only break even up to 8
/// nodes, so those keep direct and chain where the exchange is small and take
/// the trees where it grows (docs/architecture.md). On 2 nodes recursive
/// doubling is the direct exchange.
bool use_tree(OpKind kind, std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o) {
  if (o.algorithm == AlgorithmOverride::tree) return true;
  if (o.algorithm != AlgorithmOverride::automatic || bytes > o.direct_max_bytes) return false;
  return kind == OpKind::all_reduce || nodes > o.pairwise_max_nodes;
}

bool serves(NodeAlgorithm a, OpKind kind) {
  using A = NodeAlgorithm;
  if (a == A::none) return true;
  switch (kind) {
    case OpKind::all_reduce:
      return a == A::recursive_doubling || a == A::direct || a == A::pairwise || a == A::ring;
    case OpKind::all_gather: return a == A::direct || a == A::pairwise || a == A::ring;
    case OpKind::reduce_scatter: return a == A::pairwise || a == A::ring;
    case OpKind::broadcast: return a == A::tree || a == A::direct || a == A::chain;
    case OpKind::reduce: return a == A::tree || a == A::chain;
    default: return a == A::exchange;
  }
}

GatherKind all_gather_kind(std::uint64_t total, int nodes, const NodeAlgorithmOptions& o) {
  if (use_direct(total, o)) return GatherKind::direct;
  if (!use_pairwise(nodes, o)) return GatherKind::ring;
  // Two nodes: the ring and the pairwise exchange are the same transfers.
  const std::uint64_t per_node = total / static_cast<std::uint64_t>(nodes);
  if (o.algorithm == AlgorithmOverride::automatic && nodes >= 3 &&
      per_node >= kRingAllGatherMinBytes) {
    return GatherKind::ring;
  }
  return GatherKind::pairwise;
}

}  // namespace collectived::engine::algorithms

// The public selector (engine/node_algorithms.h): in the engine's namespace,
// where its callers name it.
namespace collectived::engine {

using namespace algorithms;

bool reduce_scatter_own_elsewhere(int nodes, const NodeAlgorithmOptions& options) {
  return nodes == 2 && use_pairwise(nodes, options);
}

bool reads_input_in_pieces(OpKind kind, std::uint64_t bytes, int nranks, int local_ranks, int nodes,
                           const NodeAlgorithmOptions& options) {
  if (local_ranks != 1 || nodes < 2 || bytes == 0) return false;
  switch (kind) {
    case OpKind::all_reduce:
      return use_direct(bytes, options) || large_pairwise(bytes, nodes, options);
    case OpKind::all_gather:
      return all_gather_kind(bytes * static_cast<std::uint64_t>(nranks), nodes, options) !=
             GatherKind::ring;
    case OpKind::reduce_scatter: return scatter_pairwise(bytes, nodes, options);
    case OpKind::broadcast: return true;
    default: return false;
  }
}

std::uint64_t first_input_read(OpKind kind, std::uint64_t count, DType dtype,
                               const std::vector<int>& node_of_rank, int node, int nodes,
                               const NodeAlgorithmOptions& options) {
  if (nodes < 2) return 0;
  const std::size_t es = dtype_size(dtype);
  if (kind == OpKind::all_reduce && use_direct(count * es, options)) return 0;  // read whole
  const int next = (node + 1) % nodes;
  std::vector<Segment> segs;
  if (kind == OpKind::all_reduce) segs = even_segments(count, es, nodes);
  if (kind == OpKind::reduce_scatter) segs = rank_segments(node_of_rank, count * es, nodes);
  if (segs.empty() || segs[next].empty()) return 0;
  return segs[next][0].offset;
}

NodeAlgorithm choose_node_algorithm(OpKind kind, std::uint64_t bytes, int nodes,
                                    const NodeAlgorithmOptions& options) {
  using A = NodeAlgorithm;
  if (nodes <= 1) return A::none;
  switch (kind) {
    case OpKind::all_reduce:
      if (use_tree(kind, bytes, nodes, options)) return A::recursive_doubling;
      if (use_direct(bytes, options)) return A::direct;
      return large_pairwise(bytes, nodes, options) ? A::pairwise : A::ring;
    case OpKind::all_gather:
      switch (all_gather_kind(bytes, nodes, options)) {
        case GatherKind::direct: return A::direct;
        case GatherKind::pairwise: return A::pairwise;
        case GatherKind::ring: return A::ring;
      }
      return A::ring;
    case OpKind::reduce_scatter:
      return scatter_pairwise(bytes, nodes, options) ? A::pairwise : A::ring;
    case OpKind::broadcast:
      if (use_tree(kind, bytes, nodes, options)) return A::tree;
      return use_direct(bytes, options) ? A::direct : A::chain;
    case OpKind::reduce: return use_tree(kind, bytes, nodes, options) ? A::tree : A::chain;
    default: return A::exchange;
  }
}

std::string_view to_string(NodeAlgorithm algorithm) {
  switch (algorithm) {
    case NodeAlgorithm::unknown: break;
    case NodeAlgorithm::none: return "none";
    case NodeAlgorithm::direct: return "direct";
    case NodeAlgorithm::pairwise: return "pairwise";
    case NodeAlgorithm::ring: return "ring";
    case NodeAlgorithm::chain: return "chain";
    case NodeAlgorithm::exchange: return "exchange";
    case NodeAlgorithm::recursive_doubling: return "recursive_doubling";
    case NodeAlgorithm::tree: return "tree";
  }
  return "unknown";
}

std::string node_algorithm(OpKind kind, std::uint64_t bytes, int nodes,
                           const NodeAlgorithmOptions& options) {
  return std::string(to_string(choose_node_algorithm(kind, bytes, nodes, options)));
}

std::string NodePlan::name() const { return std::string(to_string(algorithm)); }

std::string NodePlan::str() const {
  if (to_string(algorithm) == "unknown") return "an unknown algorithm";
  std::string s = name();
  if (chunk != 0) s += " in chunks of " + std::to_string(chunk) + " bytes";
  return s;
}

NodePlan node_plan(OpKind kind, std::uint64_t count, DType dtype, int nranks, int nodes,
                   const NodeAlgorithmOptions& options) {
  // all-gather chooses by what each node ends up with (node_algorithm).
  const std::uint64_t bytes = count * dtype_size(dtype) *
                              (kind == OpKind::all_gather ? static_cast<std::uint64_t>(nranks) : 1);
  NodePlan plan;
  plan.algorithm = choose_node_algorithm(kind, bytes, nodes, options);
  // The algorithms that cut transfers in chunks (transfer_chunk).
  if (plan.algorithm == NodeAlgorithm::pairwise || plan.algorithm == NodeAlgorithm::ring ||
      plan.algorithm == NodeAlgorithm::chain) {
    plan.chunk = options.chunk_bytes;
  }
  return plan;
}

}  // namespace collectived::engine
