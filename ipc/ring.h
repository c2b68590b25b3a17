// The shared-memory fast path between a client and its daemon: two
// single-producer single-consumer rings of fixed-size slots in one memfd,
// mapped by both. Submissions (client -> daemon) and completions (daemon ->
// client) travel as the same frames as on the socket (ipc/frame.h), so the
// rings change how bytes move, not what they say.
//
// Why: a round trip through a Unix socket costs two context switches (about
// 25 us on the development VM); a ring costs none while both sides poll, and
// one eventfd write when the other side sleeps.
//
// Sleep/wake protocol (Dekker style, all seq_cst): a side that goes to sleep
// first publishes its `*_sleeping` flag, then re-checks the ring, then sleeps
// on its eventfd; a producer first publishes the tail, then reads the flag and
// writes the eventfd if it is set. One of the two always sees the other.
//
// The daemon treats the mapping as hostile: indices and lengths are checked,
// and a slot's bytes are copied out before they are decoded.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace collectived::ipc {

inline constexpr std::uint32_t kRingMagic = 0x47524443;  // "CDRG"
inline constexpr std::uint32_t kRingVersion = 2;
inline constexpr std::uint32_t kRingSlotBytes = 512;
inline constexpr std::uint32_t kRingSlots = 256;
/// Request ids with this bit travel through the rings (both ways).
inline constexpr std::uint64_t kRingRequestBit = std::uint64_t{1} << 63;

struct RingHeader {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t slot_bytes;
  std::uint32_t slots;
  alignas(64) std::atomic<std::uint64_t> sq_head;  // daemon consumes
  alignas(64) std::atomic<std::uint64_t> sq_tail;  // client produces
  alignas(64) std::atomic<std::uint64_t> cq_head;  // client consumes
  alignas(64) std::atomic<std::uint64_t> cq_tail;  // daemon produces
  alignas(64) std::atomic<std::uint32_t> daemon_sleeping;
  alignas(64) std::atomic<std::uint32_t> client_sleeping;
  /// The request id whose completion the sleeping client waits for; 0: any.
  /// The daemon wakes a sleeping client only for that id's completion (or
  /// any, with 0), so a client waiting for the last of many queued
  /// operations sleeps through the others' completions instead of waking for
  /// each (a futex wake in the daemon, a context switch and a re-sleep in the
  /// client, per operation).
  alignas(64) std::atomic<std::uint64_t> wake_id;
  /// Set by the daemon while completions wait for room in the completion
  /// ring; a client that drains it then rings the doorbell if the daemon sleeps.
  alignas(64) std::atomic<std::uint32_t> cq_overflow;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

/// Bytes of a ring memfd: header, then the submission slots, then the
/// completion slots.
inline constexpr std::size_t ring_bytes() {
  return 4096 + 2 * std::size_t{kRingSlots} * kRingSlotBytes;
}

/// A view of one mapped ring pair. Not an owner: the mapping lives elsewhere.
class RingView {
 public:
  RingView() = default;
  explicit RingView(std::byte* base) : base_(base) {}

  RingHeader& header() const { return *reinterpret_cast<RingHeader*>(base_); }
  std::byte* sq_slot(std::uint64_t index) const {
    return base_ + 4096 + (index % kRingSlots) * kRingSlotBytes;
  }
  std::byte* cq_slot(std::uint64_t index) const {
    return base_ + 4096 + std::size_t{kRingSlots} * kRingSlotBytes +
           (index % kRingSlots) * kRingSlotBytes;
  }

  /// Initializes a fresh mapping (client side).
  void init() const {
    RingHeader& h = header();
    h.magic = kRingMagic;
    h.version = kRingVersion;
    h.slot_bytes = kRingSlotBytes;
    h.slots = kRingSlots;
    h.sq_head = h.sq_tail = h.cq_head = h.cq_tail = 0;
    h.daemon_sleeping = h.client_sleeping = 0;
    h.cq_overflow = 0;
    h.wake_id = 0;
  }

  /// True if the header describes the layout this build uses.
  bool valid() const {
    const RingHeader& h = header();
    return h.magic == kRingMagic && h.version == kRingVersion && h.slot_bytes == kRingSlotBytes &&
           h.slots == kRingSlots;
  }

  /// Largest frame a slot holds (the slot starts with a u32 length).
  static constexpr std::size_t max_frame() { return kRingSlotBytes - 4; }

  /// Producer side of either ring: copies `frame` into the next slot and
  /// publishes it. False when the ring is full.
  static bool push(std::atomic<std::uint64_t>& head, std::atomic<std::uint64_t>& tail,
                   std::byte* slot_of_tail, std::span<const std::byte> frame) {
    const std::uint64_t t = tail.load(std::memory_order_relaxed);
    if (t - head.load(std::memory_order_acquire) >= kRingSlots) return false;
    const auto n = static_cast<std::uint32_t>(frame.size());
    std::memcpy(slot_of_tail, &n, 4);
    std::memcpy(slot_of_tail + 4, frame.data(), frame.size());
    tail.store(t + 1, std::memory_order_seq_cst);
    return true;
  }

  /// Consumer side: copies the next frame out. Returns false when empty.
  /// Throws nothing; a corrupt slot yields an empty frame (the caller treats
  /// it as a protocol error), a corrupt index sets `corrupt`.
  static bool pop(std::atomic<std::uint64_t>& head, std::atomic<std::uint64_t>& tail,
                  const std::byte* slot_of_head, std::vector<std::byte>& frame, bool& corrupt) {
    const std::uint64_t h = head.load(std::memory_order_relaxed);
    const std::uint64_t t = tail.load(std::memory_order_acquire);
    if (t == h) return false;
    if (t - h > kRingSlots) {
      corrupt = true;
      return false;
    }
    std::uint32_t n = 0;
    std::memcpy(&n, slot_of_head, 4);
    if (n > max_frame()) {
      frame.clear();
    } else {
      frame.assign(slot_of_head + 4, slot_of_head + 4 + n);
    }
    head.store(h + 1, std::memory_order_release);
    return true;
  }

 private:
  std::byte* base_ = nullptr;
};

}  // namespace collectived::ipc
