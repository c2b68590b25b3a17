// The bytes of one message received from another node, and the size from
// which a receiver may have them placed in its own buffer. A leaf: both the
// transports (engine/transport/transport.h) and the algorithms between nodes
// (engine/node_channel.h) use these, and the algorithms must not include a
// transport header.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <span>

namespace collectived::engine {

/// The bytes of one received message. Not zero-filled on allocation: whoever
/// fills it writes every byte before anyone reads it. Storage is aligned for
/// any scalar type (Cap'n Proto words are read in place).
class MessageBytes {
 public:
  MessageBytes() = default;
  explicit MessageBytes(std::size_t size)
      : data_(size ? new std::byte[size] : nullptr), size_(size) {}
  /// A copy of `bytes` (tests, small control messages).
  static MessageBytes copy_of(std::span<const std::byte> bytes) {
    MessageBytes m(bytes.size());
    if (!bytes.empty()) std::memcpy(m.data(), bytes.data(), bytes.size());
    return m;
  }

  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  std::unique_ptr<std::byte[]> data_;
  std::size_t size_ = 0;
};

/// Payloads smaller than this are never placed (a hand-off to place them
/// costs more than the copy it saves); receivers need not post for them.
inline constexpr std::size_t kPlaceMinBytes = 64 * 1024;

}  // namespace collectived::engine
