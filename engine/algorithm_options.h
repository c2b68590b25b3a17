// The options of the algorithms between nodes (the profile's collectives.*
// and chunking), as the daemon hands them to the engine
// (Engine::set_node_algorithms). Plain data: the daemon includes this, never
// the algorithms themselves (engine/node_algorithms.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace collectived::engine {

/// collectives.algorithm, the profile's override of the choice between
/// nodes: parsed once, where the daemon reads the profile.
enum class AlgorithmOverride : std::uint8_t { automatic, ring, pairwise, direct, tree };

/// "auto" -> automatic, "ring", "pairwise", "direct", "tree"; nullopt otherwise.
std::optional<AlgorithmOverride> parse_algorithm_override(std::string_view name);
/// The profile's spelling ("auto" for automatic).
std::string_view to_string(AlgorithmOverride forced);

struct NodeAlgorithmOptions {
  /// Transfers are cut in chunks of this size (a multiple of 64 bytes).
  std::size_t chunk_bytes = std::size_t{1} << 20;
  /// Operations up to this many bytes per node are small: recursive
  /// doubling (all-reduce), the direct exchange (all-gather, broadcast),
  /// trees on many nodes (broadcast, reduce); larger ones pairwise, ring or
  /// chain.
  std::size_t direct_max_bytes = std::size_t{256} << 10;
  /// Above direct_max_bytes, communicators over at most this many nodes use
  /// the pairwise algorithms (every node exchanges with every other at once:
  /// the ring's bytes in one step instead of N-1), larger ones the ring;
  /// below it, broadcast and reduce take trees on more nodes than this.
  int pairwise_max_nodes = 4;
  /// By size and nodes (automatic), or the profile's override.
  AlgorithmOverride algorithm = AlgorithmOverride::automatic;
  /// How long an operation waiting for its local ranks' input pieces reads
  /// their ready words itself before it sleeps until the completion thread
  /// wakes it: as long as the event loop polls before sleeping
  /// (workers.event_loop_spin_us).
  std::chrono::microseconds input_poll{100};
};

}  // namespace collectived::engine
