// What every algorithm between nodes shares for one operation: the channel,
// this node's number among n, the operation's tags, how transfers are cut in
// chunks, the ready-to-receive handshake, and the notices to the channel
// about the local rank's input (need) and output (final). Each algorithm
// (ring.h, pairwise.h, direct.h, chain.h, tree.h, recursive_doubling.h,
// exchange.h) is a few functions over a Context; the runner
// (engine/node_algorithms.cc) makes one per operation. Every node runs the
// same code from the same operation, so both ends of each message agree on
// its tag and size.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "engine/algorithms/segments.h"
#include "engine/node_algorithms.h"
#include "engine/reduce.h"
#include "ipc/error.h"

namespace collectived::engine::algorithms {

// Tags: [phase:8][step:16][chunk:24] above the operation's base. Step
// kReadyStep of a phase is its ready-to-receive messages (Context::tell_ready).
inline constexpr std::uint64_t kReadyStep = 0xFFFF;
inline std::uint64_t tag_of(std::uint64_t base, std::uint64_t phase, std::uint64_t step,
                            std::uint64_t chunk) {
  return base + (phase << 40) + (step << 24) + chunk;
}

inline void expect_size(const NodePayload& m, std::uint64_t want, int from) {
  if (m.size != want) {
    throw Error(Code::mismatch, "node " + std::to_string(from) + " sent " + std::to_string(m.size) +
                                    " bytes where " + std::to_string(want) + " were expected");
  }
}

inline void reduce2(DType dtype, RedOp op, std::byte* dst, const std::byte* incoming,
                    std::uint64_t bytes) {
  const void* srcs[2] = {incoming, dst};
  reduce(dtype, op, dst, srcs, 2, bytes / dtype_size(dtype), 1);
}

inline void copy_bytes(std::byte* dst, const std::byte* src, std::uint64_t bytes) {
  if (bytes != 0 && dst != src) std::memmove(dst, src, bytes);
}

/// The smallest segment whose pairwise all-gather waits for ready to receive
/// (Context::all_gather_waits), and the smallest broadcast whose chain does
/// (Context::broadcast_waits).
inline constexpr std::uint64_t kAllGatherReadyBytes = std::uint64_t{512} << 10;

class Context {
 public:
  Context(NodeChannel& ch, const NodeAlgorithmOptions& o, std::uint64_t base)
      : ch_(ch),
        n_(ch.nodes()),
        i_(ch.node()),
        chunk_(std::max<std::size_t>(o.chunk_bytes, 64) & ~std::size_t{63}),
        base_(base) {}
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  NodeChannel& ch() const { return ch_; }
  /// How many nodes, and which one this is.
  int n() const { return n_; }
  int i() const { return i_; }
  /// The tag of chunk `chunk` of step `step` of `phase` (tag_of).
  std::uint64_t tag(std::uint64_t phase, std::uint64_t step, std::uint64_t chunk) const {
    return tag_of(base_, phase, step, chunk);
  }
  int mod(long x) const { return static_cast<int>(((x % n_) + n_) % n_); }

  /// Whether the buffers the next calls write are the node's one rank's
  /// output with nothing written after them (NodeChannel::written): each
  /// chunk is told as it becomes final.
  void tell_final(bool on) { tell_ = on; }
  void final(const std::byte* p, std::uint64_t len) {
    if (tell_ && len != 0) ch_.written(p, len);
  }
  /// Whether the input is read in pieces (reads_input_in_pieces): every read
  /// of it waits for its bytes first (NodeChannel::reading).
  void guard_input(bool on) { guard_ = on; }
  void need(const std::byte* p, std::uint64_t len) {
    if (guard_ && len != 0) ch_.reading(p, len);
  }
  void need(std::byte* buf, const Segment& seg, std::uint64_t from, std::uint64_t to) {
    if (!guard_) return;
    for_pieces(buf, seg, from, to,
               [&](std::byte* p, std::uint64_t, std::uint64_t len) { need(p, len); });
  }

  /// The chunk of a transfer of `total` bytes (transfer_chunk): both ends
  /// compute it from the same segment or buffer.
  std::uint64_t chunk_of(std::uint64_t total) const { return transfer_chunk(total, chunk_); }
  std::uint64_t chunks(std::uint64_t bytes) const {
    const std::uint64_t ck = chunk_of(bytes);
    return (bytes + ck - 1) / ck;
  }
  /// Bytes [from, to) of chunk c of a transfer of `total` bytes.
  struct ChunkSpan {
    std::uint64_t from, to;
  };
  ChunkSpan chunk_span(std::uint64_t total, std::uint64_t c) const {
    const std::uint64_t ck = chunk_of(total);
    const std::uint64_t from = std::min(total, c * ck);
    return {from, std::min(total, from + ck)};
  }

  /// Whether the receiver of the messages of a segment (or chain) of `bytes`
  /// posts buffers for them: their first chunk is large enough to be placed
  /// (kPlaceMinBytes). Sender and receiver compute the same answer.
  bool posted(std::uint64_t bytes) const {
    return std::min<std::uint64_t>(bytes, chunk_of(bytes)) >= kPlaceMinBytes;
  }
  /// Ready to receive: where a receiver posts buffers for a sender's
  /// messages (NodeChannel::post), it says so with an empty message once
  /// they are posted, and the sender waits for that before it sends them.
  /// Without it, a node that runs ahead (a broadcast's root, the first node
  /// into a pairwise all-gather) sends before the receiver's operation has
  /// started: the bytes land in a fresh buffer (new pages, each faulted in)
  /// and are copied into place later. The wait costs a one-way latency where
  /// the receiver is late, and nothing where it posted first (the usual case
  /// after the root). The message carries the operation's description like
  /// any other, so a mismatched operation is still named at once.
  void tell_ready(int to, std::uint64_t phase) {
    ch_.send(to, tag(phase, kReadyStep, 0), nullptr, 0);
  }
  void await_ready(int from, std::uint64_t phase) {
    expect_size(ch_.recv(from, tag(phase, kReadyStep, 0)), 0, from);
  }
  /// Whether a pairwise all-gather's sender waits for the receiver's ready
  /// message before it sends a segment of `bytes`: only from
  /// kAllGatherReadyBytes. Below, a late receiver copies a message that
  /// landed early (mostly warm pages) in less time than the round trip the
  /// wait costs (docs/architecture.md, "Ready to receive").
  bool all_gather_waits(std::uint64_t bytes) const {
    return posted(bytes) && bytes >= kAllGatherReadyBytes;
  }
  /// Whether a chain broadcast's sender waits for its next node's ready
  /// message: from kAllGatherReadyBytes too. The root runs ahead of the
  /// others, whose previous operation ends after its; below that size the
  /// wait's one-way trip costs more than the copy of an early message saves.
  bool broadcast_waits(std::uint64_t bytes) const {
    return posted(bytes) && bytes >= kAllGatherReadyBytes;
  }

  /// Sends the bytes of `seg` in `buf` to `to`, chunk c under tag (phase,
  /// step, c), each piece waited for first where the input is read in
  /// pieces (need).
  void send_segment(int to, std::byte* buf, const Segment& seg, std::uint64_t phase,
                    std::uint64_t step);
  /// The receiving end of send_segment: offers each chunk of `seg` in `buf`
  /// that is one contiguous range for the message `from` sends under it.
  void post_segment(int from, std::byte* buf, const Segment& seg, std::uint64_t phase,
                    std::uint64_t step);

  /// Transfers cut in chunks `factor` times the profile's while it lives
  /// (every node runs the same code, so both ends agree).
  class ScaledChunk {
   public:
    ScaledChunk(Context& c, std::size_t factor) : c_(c), saved_(c.chunk_) { c_.chunk_ *= factor; }
    ~ScaledChunk() { c_.chunk_ = saved_; }
    ScaledChunk(const ScaledChunk&) = delete;
    ScaledChunk& operator=(const ScaledChunk&) = delete;

   private:
    Context& c_;
    std::size_t saved_;
  };

 private:
  NodeChannel& ch_;
  int n_, i_;
  std::size_t chunk_;
  std::uint64_t base_;
  bool tell_ = false;
  bool guard_ = false;
};

}  // namespace collectived::engine::algorithms
