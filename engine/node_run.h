// What the runner between nodes needs of one operation beyond its NodePlan
// (the plan is what travels on the wire and is checked for mismatches),
// decided once, with the plan, when the operation's description is set
// (Engine::Impl::plan_node_run), and carried with it: nothing downstream
// decides again from sizes or predicates.
#pragma once

#include <cstdint>

#include "engine/node_algorithms.h"

namespace collectived::engine {

struct NodeRun {
  NodePlan plan;
  /// The runner reads the local input piece by piece, each read announced
  /// (reads_input_in_pieces): a staged GPU operation may then start before
  /// its inputs are all in host memory.
  bool in_pieces = false;
  /// Staged GPU operations: where in its input the runner reads first
  /// (first_input_read), so that the copies in start there. 0 otherwise.
  std::uint64_t first_read = 0;
};

}  // namespace collectived::engine
