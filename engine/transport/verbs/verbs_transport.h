// The RDMA verbs transport, as the engine sees it: devices opened from the
// profile, one reliable-connected pair per peer daemon, writes of registered
// buffer ranges with a tag, tagged receive completions, errors that name the
// peer node. Free of <infiniband/verbs.h> (pimpl), so the engine and the
// daemon never include verbs headers.
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

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "config/profile.h"

namespace collectived::verbs {

class IbverbsLibrary;

using Clock = std::chrono::steady_clock;

/// The transport's settings, from the profile (verbs.*, memory.host_pool_bytes).
struct Options {
  std::vector<config::VerbsHca> hcas;  ///< empty: every active port
  int gid_index = -1;                  ///< -1: discover (RoCE v2 IPv4-mapped preferred)
  std::uint32_t mtu = 0;               ///< bytes; 0: the port's active MTU
  std::uint32_t qps_per_connection = 1;
  std::uint32_t retry_count = 7;       ///< 0..7
  std::uint32_t timeout = 20;          ///< 0..31: 4.096 us * 2^timeout per try
  std::uint64_t pool_bytes = 64ull << 20;
  std::uint64_t slot_bytes = 512ull << 10;
  std::uint32_t slots_per_peer = 16;
  std::uint32_t mr_cache_entries = 1024;
  /// Client-memory pieces at least this large are written in place; 0 = never
  /// (VerbsNodeTransport).
  std::uint64_t in_place_min_bytes = 16 * 1024;
  /// Progress thread: busy-poll this long after the last completion, then
  /// sched_yield() until yield_us, then sleep on the completion channel.
  std::uint32_t spin_us = 50;
  std::uint32_t yield_us = 1000;
  /// A waiting caller polls the completion queue itself this long before sleeping.
  std::uint32_t wait_poll_us = 0;

  static Options from_profile(const config::Profile& profile);
};

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

/// A registered local memory range, usable as a write source (and, for pool
/// memory, as a destination of local copies). Copies share the registration.
class Buffer {
 public:
  Buffer() = default;
  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  std::uint32_t lkey() const { return lkey_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  friend class Device;
  friend class Pair;
  std::shared_ptr<const void> owner_;  // the MR or pool block
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::uint32_t lkey_ = 0;
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

struct DeviceStats {
  std::uint64_t pool_bytes = 0;         ///< registered once at open
  std::uint64_t pool_in_use = 0;
  std::uint64_t mr_cache_entries = 0;
  std::uint64_t mr_cache_hits = 0;
  std::uint64_t mr_cache_misses = 0;    ///< registrations made
};

/// One opened HCA port with its protection domain, registered pool, MR cache,
/// completion channel and progress thread.
class Device {
 public:
  /// Opens the port `hca` (name, port), or the first active port when `hca` is
  /// empty (Options::hcas picks otherwise). Throws Error (not_found,
  /// unavailable, system) saying which device and why.
  static std::unique_ptr<Device> open(std::shared_ptr<const IbverbsLibrary> lib,
                                      const Options& options, std::string local_node,
                                      std::optional<config::VerbsHca> hca = std::nullopt);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  /// A block of the registered pool (registered once at open).
  Buffer allocate(std::size_t size);
  /// A registration covering [data, data + size), from the MR cache or new.
  Buffer register_memory(void* data, std::size_t size);
  /// Drops cached registrations overlapping the range (call before unmapping it).
  void invalidate(void* data, std::size_t size);
  /// An object that calls invalidate(data, size) when destroyed (a no-op once
  /// the device is gone): attach it to the owner of the memory, which drops it
  /// before the memory is unmapped (engine::HostRegion).
  std::shared_ptr<void> invalidator(void* data, std::size_t size);

  /// Connects to `peer_node` over `channel` (both sides call it). Throws naming the peer.
  std::unique_ptr<Pair> connect(ExchangeChannel& channel, const std::string& peer_node,
                                Clock::time_point deadline);

  /// "rxe0 port 1 (Ethernet, RoCE v2 gid 1 0000:...:0a63:0001, mtu 1024)".
  std::string describe() const;
  const std::string& name() const;
  std::uint32_t port() const;
  DeviceStats stats() const;

  struct Impl;

 private:
  explicit Device(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Opens every port the options name (or every active port): one Device each.
/// Throws when none can be opened, with every port's reason.
std::vector<std::unique_ptr<Device>> open_devices(std::shared_ptr<const IbverbsLibrary> lib,
                                                  const Options& options,
                                                  const std::string& local_node);

}  // namespace collectived::verbs
