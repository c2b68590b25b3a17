// The selector, alone: which algorithm an operation takes by kind, size,
// nodes and the profile's override, and the plan that travels on the wire.
// The algorithms themselves run in engine/node_algorithms_test.cc.
#include "engine/algorithms/selector.h"

#include <doctest/doctest.h>

using namespace collectived;
using namespace collectived::engine;

TEST_CASE("the algorithm choice follows the size and the profile's override") {
  NodeAlgorithmOptions o;
  CHECK(node_algorithm(OpKind::all_reduce, 8, 4, o) == "recursive_doubling");
  CHECK(node_algorithm(OpKind::all_reduce, 8, 2, o) == "recursive_doubling");
  CHECK(node_algorithm(OpKind::all_gather, 8, 4, o) == "direct");
  CHECK(node_algorithm(OpKind::all_reduce, 1 << 20, 4, o) == "pairwise");
  CHECK(node_algorithm(OpKind::all_reduce, 1 << 20, 5, o) == "ring");
  // All-reduce: the ring from 8 MiB per rank on 4 nodes or more, pairwise
  // below it and on 3 nodes.
  CHECK(node_algorithm(OpKind::all_reduce, 8 << 20, 4, o) == "ring");
  CHECK(node_algorithm(OpKind::all_reduce, (8 << 20) - 4, 4, o) == "pairwise");
  CHECK(node_algorithm(OpKind::all_reduce, 64 << 20, 3, o) == "pairwise");
  CHECK(node_algorithm(OpKind::all_reduce, 64 << 20, 2, o) == "pairwise");
  // Reduce-scatter (bytes of each rank's output): the same rule.
  CHECK(node_algorithm(OpKind::reduce_scatter, 8 << 20, 4, o) == "ring");
  CHECK(node_algorithm(OpKind::reduce_scatter, (8 << 20) - 4, 4, o) == "pairwise");
  CHECK(node_algorithm(OpKind::reduce_scatter, 64 << 20, 3, o) == "pairwise");
  CHECK(node_algorithm(OpKind::reduce_scatter, 8, 4, o) == "pairwise");
  CHECK(node_algorithm(OpKind::reduce_scatter, 16 << 10, 64, o) == "pairwise");  // small: one round
  CHECK(node_algorithm(OpKind::reduce_scatter, (16 << 10) + 1, 5, o) == "ring");
  CHECK(node_algorithm(OpKind::all_gather, 1 << 20, 3, o) == "pairwise");
  // All-gather (bytes of the whole output): the ring from 2 MiB per node
  // on 3 nodes or more; on 2 the pairwise exchange is the same transfers.
  CHECK(node_algorithm(OpKind::all_gather, 6 << 20, 3, o) == "ring");
  CHECK(node_algorithm(OpKind::all_gather, (6 << 20) - 3, 3, o) == "pairwise");
  CHECK(node_algorithm(OpKind::all_gather, 8 << 20, 4, o) == "ring");
  CHECK(node_algorithm(OpKind::all_gather, (8 << 20) - 4, 4, o) == "pairwise");
  CHECK(node_algorithm(OpKind::all_gather, 64 << 20, 2, o) == "pairwise");
  CHECK(node_algorithm(OpKind::all_gather, 64 << 20, 4, o) == "ring");
  CHECK(node_algorithm(OpKind::broadcast, 1 << 20, 4, o) == "chain");
  CHECK(node_algorithm(OpKind::all_reduce, 1 << 20, 1, o) == "none");
  // Small operations on more nodes than pairwise_max_nodes: the trees.
  CHECK(node_algorithm(OpKind::all_reduce, 256 << 10, 5, o) == "recursive_doubling");
  CHECK(node_algorithm(OpKind::all_reduce, (256 << 10) + 1, 5, o) == "ring");
  CHECK(node_algorithm(OpKind::all_reduce, (256 << 10) + 1, 4, o) == "pairwise");
  CHECK(node_algorithm(OpKind::broadcast, 8, 5, o) == "tree");
  CHECK(node_algorithm(OpKind::broadcast, 8, 4, o) == "direct");
  CHECK(node_algorithm(OpKind::reduce, 8, 5, o) == "tree");
  CHECK(node_algorithm(OpKind::reduce, 8, 4, o) == "chain");
  CHECK(node_algorithm(OpKind::reduce, 1 << 20, 5, o) == "chain");
  CHECK(node_algorithm(OpKind::all_gather, 8, 64, o) ==
        "direct");  // one block per node: no more bytes
  o.algorithm = AlgorithmOverride::tree;
  CHECK(node_algorithm(OpKind::all_reduce, 64 << 20, 2, o) == "recursive_doubling");
  CHECK(node_algorithm(OpKind::broadcast, 64 << 20, 2, o) == "tree");
  CHECK(node_algorithm(OpKind::reduce, 8, 2, o) == "tree");
  CHECK(node_algorithm(OpKind::all_gather, 8, 4, o) == "ring");
  CHECK(node_algorithm(OpKind::reduce_scatter, 8, 4, o) == "ring");
  o.algorithm = AlgorithmOverride::direct;
  CHECK(node_algorithm(OpKind::all_reduce, 1 << 20, 4, o) == "direct");
  o.algorithm = AlgorithmOverride::ring;
  CHECK(node_algorithm(OpKind::all_reduce, 8, 4, o) == "ring");
  CHECK(node_algorithm(OpKind::reduce_scatter, 1 << 20, 2, o) == "ring");
  o.algorithm = AlgorithmOverride::pairwise;
  CHECK(node_algorithm(OpKind::all_reduce, 8, 8, o) == "pairwise");
  CHECK(node_algorithm(OpKind::all_reduce, 64 << 20, 4, o) == "pairwise");
  CHECK(node_algorithm(OpKind::reduce_scatter, 64 << 20, 4, o) == "pairwise");
  CHECK(node_algorithm(OpKind::all_gather, 64 << 20, 4, o) == "pairwise");
}

TEST_CASE("an operation's plan: its algorithm, and the chunk where it cuts transfers") {
  NodeAlgorithmOptions o;
  o.chunk_bytes = 1 << 20;
  // all-gather: counted per rank here, chosen by the whole output (4 MiB per
  // node of 4: the ring).
  const NodePlan ring = node_plan(OpKind::all_gather, 1 << 20, DType::float32, 4, 4, o);
  CHECK(ring.str() == "ring in chunks of 1048576 bytes");
  CHECK(ring.name() == "ring");
  CHECK(node_plan(OpKind::all_gather, (1 << 19) - 1, DType::float32, 4, 4, o).str() ==
        "pairwise in chunks of 1048576 bytes");
  const NodePlan direct = node_plan(OpKind::all_gather, 2, DType::float64, 4, 4, o);
  CHECK(direct.str() == "direct");  // one message each: no chunk
  CHECK(direct.chunk == 0);
  CHECK(node_plan(OpKind::broadcast, 1 << 20, DType::uint8, 4, 4, o).str() ==
        "chain in chunks of 1048576 bytes");
  CHECK(node_plan(OpKind::barrier, 0, DType::uint8, 4, 4, o).str() == "exchange");
  CHECK(node_plan(OpKind::all_reduce, 1 << 20, DType::uint8, 4, 1, o).str() == "none");
  CHECK(node_plan(OpKind::all_reduce, 2, DType::float64, 4, 8, o).str() == "recursive_doubling");
  CHECK(node_plan(OpKind::reduce, 2, DType::float64, 4, 8, o).str() == "tree");
  CHECK(NodePlan{}.str() == "an unknown algorithm");
  CHECK(NodePlan{}.name() == "unknown");
  CHECK(!NodePlan{}.known());
  // On the wire: the values stay what they were when plans were added.
  CHECK(static_cast<int>(NodeAlgorithm::none) == 1);
  CHECK(static_cast<int>(NodeAlgorithm::recursive_doubling) == 7);
  CHECK(static_cast<int>(NodeAlgorithm::tree) == 8);
  // A value this build does not know (a newer daemon's) is named, not trusted.
  NodePlan newer;
  newer.algorithm = static_cast<NodeAlgorithm>(200);
  CHECK(newer.known());
  CHECK(newer.str() == "an unknown algorithm");
  CHECK(!(newer == ring));
  // The same options give the same plan; an override or another chunk does not.
  CHECK(node_plan(OpKind::all_gather, 1 << 20, DType::float32, 4, 4, o) == ring);
  NodeAlgorithmOptions other = o;
  other.chunk_bytes = 512 << 10;
  CHECK(!(node_plan(OpKind::all_gather, 1 << 20, DType::float32, 4, 4, other) == ring));
  other = o;
  other.algorithm = AlgorithmOverride::pairwise;
  CHECK(!(node_plan(OpKind::all_gather, 1 << 20, DType::float32, 4, 4, other) == ring));
  other = o;
  other.chunk_bytes = 512 << 10;  // the direct exchange does not chunk: the chunk is not compared
  CHECK(node_plan(OpKind::all_gather, 2, DType::float64, 4, 4, other) == direct);
}

TEST_CASE("the runner's check agrees with the planner: every plan it makes serves its kind") {
  const OpKind kinds[] = {OpKind::all_reduce, OpKind::all_gather, OpKind::reduce_scatter,
                          OpKind::broadcast,  OpKind::reduce,     OpKind::all_to_all,
                          OpKind::barrier};
  for (AlgorithmOverride forced : {AlgorithmOverride::automatic, AlgorithmOverride::ring,
                                   AlgorithmOverride::pairwise, AlgorithmOverride::direct,
                                   AlgorithmOverride::tree}) {
    NodeAlgorithmOptions o;
    o.algorithm = forced;
    for (OpKind k : kinds) {
      for (int nodes : {1, 2, 3, 4, 5, 8}) {
        for (std::uint64_t bytes : {std::uint64_t{0}, std::uint64_t{8}, std::uint64_t{1} << 20,
                                    std::uint64_t{64} << 20}) {
          CAPTURE(to_string(forced));
          CAPTURE(to_string(k));
          CAPTURE(nodes);
          CAPTURE(bytes);
          CHECK(algorithms::serves(choose_node_algorithm(k, bytes, nodes, o), k));
        }
      }
    }
  }
  // And it refuses what a plan for another kind names.
  CHECK_FALSE(algorithms::serves(NodeAlgorithm::chain, OpKind::all_reduce));
  CHECK_FALSE(algorithms::serves(NodeAlgorithm::recursive_doubling, OpKind::broadcast));
  CHECK_FALSE(algorithms::serves(NodeAlgorithm::unknown, OpKind::reduce));
}
