// Passes over buffers that may leave the thread that serves the peers: a
// pass over a whole buffer goes to the worker pool from kOffloadBytes
// (offload), and a pass over one chunk started there (compute_async) is
// waited for by a PendingPass, also when the operation fails, since it
// writes into the ranks' buffers.
#pragma once

#include <cstdint>
#include <utility>

#include "engine/node_channel.h"

namespace collectived::engine::algorithms {

/// A pass started with NodeChannel::compute_async: waited for at the latest
/// when this goes (an operation that fails meanwhile), since the pass writes
/// into the ranks' buffers; wait() rethrows what it threw, the destructor
/// swallows it (the operation's own error is the one to report).
struct PendingPass {
  PendingPass(NodeChannel& c, NodeChannel::Ticket t) : ch(c), ticket(std::move(t)) {}
  PendingPass(const PendingPass&) = delete;
  PendingPass& operator=(const PendingPass&) = delete;
  void wait() {
    auto t = std::move(ticket);
    ticket = nullptr;
    ch.compute_wait(t);
  }
  ~PendingPass() {
    if (!ticket) return;
    try {
      ch.compute_wait(ticket);
    } catch (...) {
    }
  }
  NodeChannel& ch;
  NodeChannel::Ticket ticket;
};

/// Passes over whole buffers from this size on run through NodeChannel::compute.
/// Below it the hand-off each way costs more than the pass, and 8 MiB take a
/// few ms on the event loop, well within heartbeats.
inline constexpr std::uint64_t kOffloadBytes = std::uint64_t{8} << 20;

/// Runs `work`, a pass over `bytes`, on the worker pool (NodeChannel::compute)
/// where it is large, inline otherwise; per-chunk work stays where the chunk is.
template <typename Work>
void offload(NodeChannel& ch, std::uint64_t bytes, const Work& work) {
  if (bytes >= kOffloadBytes) {
    ch.compute(work);
  } else {
    work();
  }
}

}  // namespace collectived::engine::algorithms
