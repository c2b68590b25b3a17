// A verbs pair: the reliable-connected connection to one peer daemon, made
// by a device (verbs/device.h); writes of registered buffer ranges with a
// tag, tagged receive completions, errors that name the peer node. Free of
// <infiniband/verbs.h> (pimpl), so the engine and the daemon never include
// verbs headers.
//
// Data path (docs/architecture.md, "Verbs transport"): each side of a pair
// owns `slots_per_peer` receive slots of `slot_bytes` in its registered pool;
// the peer writes into them by RDMA WRITE WITH IMMEDIATE (the immediate names
// the slot), one slot per write, a small header in front of the payload
// (tag, offset, total). A slot is a credit: the writer holds one per write in
// flight and gets it back when the reader releases the slot (a zero-length
// WRITE WITH IMMEDIATE carrying the freed slot range). A progress thread per
// device polls the completion queues (busy poll, then yield, then sleep on
// the completion channel).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/transport/verbs/buffer.h"
#include "engine/transport/verbs/options.h"

namespace collectived::engine::transport::verbs {

/// The byte channel a pair exchanges its queue-pair parameters over: the
/// authenticated peer connection in the daemon, a socket in tests. Whole
/// messages; both sides send, then receive.
class ExchangeChannel {
 public:
  virtual ~ExchangeChannel() = default;
  virtual void send(std::span<const std::byte> message) = 0;
  /// The next whole message; throws Error (timeout, remote) naming the peer.
  virtual std::vector<std::byte> receive(Clock::time_point deadline) = 0;
};

/// Where a write's bytes sit in the message they belong to: a message may be
/// sent in parts (pipelines forward pieces as they arrive).
struct MessagePart {
  std::uint64_t offset = 0;  ///< of this write's first byte in the message
  std::uint64_t total = 0;   ///< the message's size; 0: this write is the whole message
};

/// One received piece (at most slot_bytes), still in its receive slot: read it,
/// then release() it so the sender gets the slot back.
struct Chunk {
  std::uint64_t tag = 0;
  std::uint64_t offset = 0;  ///< in the message
  std::uint64_t total = 0;   ///< the message's size
  std::span<const std::byte> data;
  std::uint32_t slot = 0;
  std::uint64_t generation = 0;  ///< connection generation (a rebuild invalidates chunks)
  /// Set when the chunk was copied out of its slot (see Pair::next_chunk); data points into it.
  std::shared_ptr<const void> spilled;
};

struct PairStats {
  std::uint64_t writes_posted = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t chunks_received = 0;
  std::uint64_t credit_messages = 0;
  std::uint64_t credit_stalls = 0;  ///< writes that waited for a free remote slot
  std::uint64_t rebuilds = 0;
  std::uint64_t spilled_chunks = 0;  ///< copied out of their slots (received out of order)
};

/// A connection to one peer node: `qps_per_connection` RC queue pairs and the
/// receive slots. Thread-safe. After an error (QP error, dead peer) every
/// waiting and later call throws an Error naming the peer, until rebuild().
class Pair {
 public:
  ~Pair();
  Pair(const Pair&) = delete;
  Pair& operator=(const Pair&) = delete;

  const std::string& peer() const;
  /// Posts a write of `length` bytes at `offset` in `buffer` to the peer under
  /// `tag`, split into slot-sized RDMA WRITEs as credits allow. Returns an id
  /// for wait_written(). The buffer's range must stay unchanged until then.
  /// While rebuild() runs (once its new queue pairs exist) the write is queued
  /// and goes out when the pair is connected.
  std::uint64_t post_write(std::uint64_t tag, const Buffer& buffer, std::size_t offset,
                           std::size_t length, MessagePart part = {});
  /// The same, with `prefix_length` bytes at `prefix_offset` of `prefix` in
  /// front of them: the first slot-sized write gathers both (a message's head
  /// from a staging buffer and its payload from another registration, in one
  /// write rather than two). `part` places the prefix's first byte.
  std::uint64_t post_write(std::uint64_t tag, const Buffer& prefix, std::size_t prefix_offset,
                           std::size_t prefix_length, const Buffer& buffer, std::size_t offset,
                           std::size_t length, MessagePart part = {});
  /// Waits until write `id` completed locally (the source may be reused).
  void wait_written(std::uint64_t id, Clock::time_point deadline);
  /// Whether write `id` completed locally, without waiting; throws as
  /// wait_written does when it never will (the pair broke, it was dropped).
  bool written(std::uint64_t id) const;

  /// The next received chunk with `tag` (nullopt: any tag); throws timeout at the deadline.
  /// While it waits for one tag, chunks of other tags that hold slots are copied
  /// out ("spilled") and their slots released: otherwise messages received out of
  /// order could hold every credit and the awaited one could never arrive.
  Chunk next_chunk(std::optional<std::uint64_t> tag, Clock::time_point deadline);
  /// Gives a chunk's slot back to the sender (no-op for a chunk of an older generation).
  void release(const Chunk& chunk);
  /// Receives the whole message `tag` into `destination` (its size must equal the message's).
  void receive(std::uint64_t tag, std::span<std::byte> destination, Clock::time_point deadline);

  /// Whether the connection works (no error since the last (re)build).
  bool healthy() const;
  /// The error that broke the connection ("" when healthy).
  std::string error() const;
  /// Marks the connection failed from outside (the peer connection died, the
  /// daemon stops): every waiter throws `reason`.
  void fail(const std::string& reason);
  /// Moves every QP to the error state (tests, administrative abort).
  void force_error();
  /// Re-creates the QPs and receive slots and reconnects over `channel`: the
  /// peer must call it too. Outstanding writes and unreleased chunks are dropped.
  void rebuild(ExchangeChannel& channel, Clock::time_point deadline);
  /// "rxe0:1 qpn 17,18 -> n1 qpn 19,20, mtu 1024, 16 slots of 512 KiB".
  std::string describe() const;
  PairStats stats() const;

  struct Impl;

 private:
  friend class Device;
  explicit Pair(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

}  // namespace collectived::engine::transport::verbs
