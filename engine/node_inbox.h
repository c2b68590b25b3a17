// What other nodes sent for a communicator of this node, until an operation
// takes it: data messages keyed by (seq, tag, sender node), point-to-point
// sends, failures, and the receive buffers operations posted for messages
// still on their way (placement). Guarded by the engine's mutex.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>

#include "engine/comm.h"
#include "engine/node_algorithms.h"

namespace collectived::engine::detail {

/// What other nodes sent for a communicator, before this node's operation
/// takes it.
struct NodeIn {
  NodePayload payload;
  Desc desc;
  int desc_rank = 0;
  std::uint64_t count = 0;  // p2p
  DType dtype = DType::uint8;
  NodePlan plan;              // collectives: the sender's (not known: none sent)
  Clock::time_point arrived;  // status: how long other nodes have waited on this node
};

struct Inbox {
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, NodeIn> msgs;  // (seq, tag, from node)
  /// Receive buffers operations posted for messages not here yet (same key).
  struct Posted {
    std::byte* dest = nullptr;
    std::size_t bytes = 0;
    /// Handed to the transport when it places the message (then `claimed`);
    /// its release wakes the operation (EngineChannel::retract).
    std::shared_ptr<void> token;
    bool claimed = false;
  };
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, Posted> posted;
  std::map<std::tuple<int, int, std::uint64_t>, NodeIn> p2p;  // (from rank, to rank, index)
  std::map<std::uint64_t, Result> failed;  // seq -> why it failed on another node
  std::optional<Result> broken;
  std::uint64_t bytes = 0;
  Clock::time_point expires;  // an inbox whose communicator never appears
  bool claimed = false;       // a communicator of this node uses it
  /// The executor of the communicator using it: woken when something arrives.
  std::weak_ptr<Executor> exec;
};
using InboxRef = std::pair<std::shared_ptr<Inbox>, std::weak_ptr<Comm>>;

/// Wakes the executor waiting on `in` (its message or failure arrived).
void notify(Inbox& in);

}  // namespace collectived::engine::detail
