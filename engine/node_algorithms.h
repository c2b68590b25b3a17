// Collectives between nodes: what each daemon does for one operation of a
// communicator whose ranks live on several nodes.
//
// Every algorithm is hierarchical. A daemon first combines its own ranks'
// buffers (they are all mapped into it), then exchanges one contribution per
// node with the other daemons, then writes every local rank's output. Between
// nodes the algorithms are:
//   - pairwise reduce-scatter + all-gather (up to pairwise_max_nodes nodes):
//     every node sends each other node its share at once, in chunks, and
//     reduces (or copies) what arrives; every node sends 2(N-1)/N of the
//     data in one step;
//   - ring reduce-scatter + ring all-gather (more nodes; the same bytes in
//     N-1 steps, each to one neighbour), pipelined in chunks so that the
//     reduction of one chunk overlaps the transfer of the next; an
//     all-gather over 3 or more nodes takes the ring from 2 MiB of output
//     per node, in chunks 8x tcp.chunk_bytes (engine/algorithms/selector.cc
//     and ring.cc say why);
//   - direct exchange (latency: one round, every node sends its whole
//     contribution to every other node and reduces them in node order);
//   - chains for broadcast and reduce (pipelined in chunks, each link carries
//     the data once).
// The choice is made per operation from its size (NodeAlgorithmOptions).
//
// Reduction order across nodes: local ranks in rank order, then nodes in ring
// (or node) order. Every rank gets bit-identical results; floating-point
// results may differ in the last bits from the single-node rank order.
//
// The code here knows nothing of sockets: it talks to the other nodes through
// a NodeChannel (engine/node_channel.h), which the engine implements over the
// daemons' transport and the tests implement in memory. This header is the
// API; each algorithm has its own file under engine/algorithms/, the selector
// (which algorithm, the plan on the wire) is engine/algorithms/selector.cc,
// and node_algorithms.cc runs one operation: local passes around the
// algorithm the selector chose.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/algorithm_options.h"
#include "engine/dtype.h"
#include "engine/node_channel.h"
#include "engine/op.h"

namespace collectived::engine {

/// The chunk in which a transfer of `total` bytes (a segment, or a chain's
/// buffer) travels, given the profile's `chunk` (NodeAlgorithmOptions): that
/// chunk, except that a transfer of two to four chunks is cut into four
/// (whole pages, never above `chunk`). Two chunks keep only two of tcp's
/// four streams busy and pipeline one reduction (4 MiB operations took nearly
/// as long as 16 MiB ones), while cutting every transfer finer slows 1 and
/// 16 MiB (docs/architecture.md). Sender and receiver compute it from the
/// same total, so they agree on every chunk's tag and size.
std::uint64_t transfer_chunk(std::uint64_t total, std::uint64_t chunk);

/// An algorithm between nodes. The values are on the wire (OpData's
/// planAlgorithm): append, never renumber.
enum class NodeAlgorithm : std::uint8_t {
  unknown = 0,  ///< a message without a plan (point-to-point, a daemon before plans)
  none = 1,     ///< one node: nothing between nodes
  direct,
  pairwise,
  ring,
  chain,
  exchange,
  recursive_doubling,
  tree,
};
/// "ring", "recursive_doubling", ...; "unknown" for unknown and for values
/// this build does not know (a newer daemon's).
std::string_view to_string(NodeAlgorithm algorithm);

/// Which algorithm an operation of `bytes` per rank (for all-gather: of the
/// whole output) uses between `nodes` nodes.
NodeAlgorithm choose_node_algorithm(OpKind kind, std::uint64_t bytes, int nodes,
                                    const NodeAlgorithmOptions& options);
/// to_string(choose_node_algorithm(...)): for logs, status and tests.
std::string node_algorithm(OpKind kind, std::uint64_t bytes, int nodes,
                           const NodeAlgorithmOptions& options);

/// Whether run_node_collective, for an operation of this shape, calls
/// NodeChannel::reading before every read of its local rank's input, piece
/// by piece in the order it reads them, so that the input may still be
/// arriving when it starts: one rank on the node, and the direct or pairwise
/// all-reduce and all-gather, the pairwise reduce-scatter, or a broadcast.
/// `bytes`: count x element size of one rank.
bool reads_input_in_pieces(OpKind kind, std::uint64_t bytes, int nranks, int local_ranks, int nodes,
                           const NodeAlgorithmOptions& options);

/// What shapes an operation's messages between nodes: its algorithm
/// (node_algorithm) and, where it cuts transfers in chunks, the profile's
/// chunk. Nodes whose plans differ send messages the others never look for
/// (other tags, other sizes): every data message carries its sender's plan,
/// and a receiver whose own differs fails the operation at once
/// (Code::mismatch, naming both) instead of waiting out its deadline. It
/// happens where the daemons' profiles disagree on collectives.* or
/// tcp.chunk_bytes (one edited and reloaded, not the others).
struct NodePlan {
  NodeAlgorithm algorithm = NodeAlgorithm::unknown;
  /// The chunk of the algorithms that cut transfers (pairwise, ring,
  /// chain); 0 for the others.
  std::uint64_t chunk = 0;
  bool known() const { return algorithm != NodeAlgorithm::unknown; }
  bool operator==(const NodePlan& o) const { return algorithm == o.algorithm && chunk == o.chunk; }
  /// The algorithm's name (to_string).
  std::string name() const;
  /// "ring in chunks of 1048576 bytes", "direct".
  std::string str() const;
};

/// The plan of an operation of `count` elements per rank of `dtype`, over
/// `nranks` ranks on `nodes` nodes.
NodePlan node_plan(OpKind kind, std::uint64_t count, DType dtype, int nranks, int nodes,
                   const NodeAlgorithmOptions& options);

/// Whether a reduce-scatter over `nodes` nodes with one rank on this node
/// can leave that rank's own contribution out (NodeCollective::
/// own_contribution_elsewhere): over two nodes, where it is pairwise, the
/// output is then the other node's contribution as it came, and whoever
/// combines the two reproduces the host's order (node 0's first).
bool reduce_scatter_own_elsewhere(int nodes, const NodeAlgorithmOptions& options);

/// Where, in its local rank's input, an operation that reads_input_in_pieces
/// reads first (bytes from the start): the pairwise reduce-scatter (and
/// all-reduce) sends the next node's segment first, then the others in node
/// order, its own last; the direct all-reduce and the all-gathers read from
/// the start. Staging copies the input from there on, wrapping around, so
/// that the first send does not wait for the whole input.
std::uint64_t first_input_read(OpKind kind, std::uint64_t count, DType dtype,
                               const std::vector<int>& node_of_rank, int node, int nodes,
                               const NodeAlgorithmOptions& options);

/// A local rank's buffers for one operation (null/0 where it has none).
struct LocalBuffers {
  int rank = 0;
  std::byte* send = nullptr;
  std::uint64_t send_bytes = 0;
  std::byte* recv = nullptr;
  std::uint64_t recv_bytes = 0;
};

/// One collective as this node sees it.
struct NodeCollective {
  OpKind kind = OpKind::barrier;
  DType dtype = DType::uint8;
  RedOp redop = RedOp::sum;
  std::uint64_t count = 0;  ///< per rank, as the ranks gave it
  int root = 0;
  int nranks = 0;
  std::vector<int> node_of_rank;  ///< rank -> node index
  std::vector<LocalBuffers> local;  ///< this node's ranks, ascending
  /// A reduce-scatter whose one local rank's own contribution to its segment
  /// is combined elsewhere (on its GPU, by the client: GpuSync
  /// ownSegmentOnGpu): its output gets the other nodes' contributions only,
  /// undivided for avg, and its own segment of the input is never read.
  /// Only where reduce_scatter_own_elsewhere() says so.
  bool own_contribution_elsewhere = false;
};

/// Runs `op` on this node: local combine, exchange with the other nodes over
/// `channel` by `plan.algorithm` (node_plan's, made once: the runner decides
/// nothing again), local outputs. Tags are taken from `tag_base` upwards (the
/// caller gives each operation its own base). Throws Error from the channel,
/// and Code::internal for a plan that names no algorithm of the op's kind.
void run_node_collective(NodeChannel& channel, const NodeCollective& op, const NodePlan& plan,
                         const NodeAlgorithmOptions& options, std::uint64_t tag_base = 0);
/// The same under the plan node_plan() makes for `op` here (tests).
void run_node_collective(NodeChannel& channel, const NodeCollective& op,
                         const NodeAlgorithmOptions& options, std::uint64_t tag_base = 0);

/// Every node sends `mine` to every other node; returns what each node sent,
/// by node index (this node's own entry is `mine`). Flushes before returning.
std::vector<std::vector<std::byte>> node_exchange(NodeChannel& channel,
                                                  std::span<const std::byte> mine,
                                                  std::uint64_t tag);

}  // namespace collectived::engine
