// Framing of control messages over a Unix stream socket.
//
// A frame is a 16-byte little-endian header followed by the payload, a Cap'n
// Proto message as a flat array (segment table + segments, 8-byte multiple):
//
//   u32 magic "CDF1" | u32 payload bytes | u32 descriptors | u32 reserved (0)
//
// Descriptors are sent by SCM_RIGHTS in the same sendmsg() as the frame's
// first byte. The kernel hands them to the receiver together with the first
// byte of that sendmsg's data, i.e. at or before the frame they belong to, so
// the decoder keeps received descriptors in arrival order and gives each
// completed frame as many as its header declares.
#pragma once

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ipc/error.h"
#include "ipc/fd.h"
#include "ipc/protocol.capnp.h"

namespace collectived::ipc {

inline constexpr std::uint32_t kFrameMagic = 0x31464443;  // "CDF1" in little-endian
inline constexpr std::size_t kHeaderBytes = 16;
/// Most descriptors one frame may carry (a VMM allocation may need several).
inline constexpr std::uint32_t kMaxFdsPerFrame = 8;
/// Most descriptors held for frames not yet complete.
inline constexpr std::size_t kMaxPendingFds = 32;

/// Bounds applied to every frame a reader accepts.
struct Limits {
  std::uint64_t max_frame_bytes = 1 << 20;
  /// Cap'n Proto traversal limit in words: bounds the work a reader does on one
  /// message, including amplification by far pointers.
  std::uint64_t traversal_limit_words = (1 << 20) / 8 * 2;
  /// Cap'n Proto nesting limit: bounds recursion on deep structures.
  int nesting_limit = 16;

  static Limits for_max_frame(std::uint64_t max_frame_bytes);
};

/// First-segment size for the small messages of the hot path (collectives and
/// their answers, ~100-300 bytes): Cap'n Proto's default first segment is
/// 8 KiB, zero-filled on every message.
inline constexpr unsigned kSmallMessageWords = 64;

/// Encodes `message` as one frame that declares `nfds` descriptors.
std::vector<std::byte> encode_frame(capnp::MessageBuilder& message, std::uint32_t nfds = 0);

/// Convenience: a frame holding an ErrorReply for request `id`.
std::vector<std::byte> encode_error(std::uint64_t id, Code code, std::string_view message);

/// One received frame: the decoded message and the descriptors that came with it.
class IncomingFrame {
 public:
  IncomingFrame(kj::Array<capnp::word> words, std::vector<UniqueFd> fds, const Limits& limits);
  IncomingFrame(const IncomingFrame&) = delete;
  IncomingFrame& operator=(const IncomingFrame&) = delete;

  /// The message. Throws Error(protocol) when the segment table was invalid;
  /// accessors may throw kj::Exception on malformed content, which callers
  /// turn into Code::protocol (see with_protocol_checks). Either way the
  /// framing is intact, so the connection can go on.
  wire::Message::Reader message();
  /// The message read as another root type (the peer protocol, ipc/peer.capnp);
  /// same checks as message().
  template <typename Root>
  typename Root::Reader root();
  std::vector<UniqueFd>& fds() { return fds_; }
  std::size_t payload_bytes() const { return words_.size() * sizeof(capnp::word); }

 private:
  kj::Array<capnp::word> words_;
  std::vector<UniqueFd> fds_;
  std::optional<capnp::FlatArrayMessageReader> reader_;
  std::string malformed_;  // why reader_ could not be built
};

/// Incremental frame parser fed by whatever reads the socket (Asio in the
/// daemon, blocking reads in the client). Throws Error(Code::protocol) when the
/// stream can no longer be trusted (bad magic, oversize, descriptor mismatch):
/// the connection must then be closed.
class FrameDecoder {
 public:
  explicit FrameDecoder(Limits limits);

  /// Space to receive into (never empty).
  std::span<std::byte> read_space();
  /// Records that `n` bytes were written at the start of read_space().
  void commit(std::size_t n);
  /// Records descriptors received by the same read.
  void add_fds(std::vector<UniqueFd> fds);

  /// The next complete frame, or nullptr when more bytes are needed.
  std::unique_ptr<IncomingFrame> next();
  /// Moves up to out.size() buffered bytes that follow the last frame into
  /// `out` (unframed bytes that a frame announced); returns how many.
  std::size_t take(std::span<std::byte> out);

  /// True while part of a frame is buffered (a disconnect now is mid-request).
  bool mid_frame() const { return end_ > begin_; }
  std::size_t buffered_bytes() const { return end_ - begin_; }
  const Limits& limits() const { return limits_; }

 private:
  Limits limits_;
  std::vector<std::byte> buf_;
  std::size_t begin_ = 0;
  std::size_t end_ = 0;
  std::deque<UniqueFd> pending_fds_;
};

/// Decodes one whole frame held in `bytes` (a ring slot). Throws
/// Error(protocol) unless `bytes` is exactly one frame without descriptors.
std::unique_ptr<IncomingFrame> decode_frame(std::span<const std::byte> bytes,
                                            const Limits& limits);

/// Result of one non-blocking receive.
struct RecvResult {
  std::size_t bytes = 0;
  bool eof = false;
  bool would_block = false;
};

/// recvmsg() into `space`, collecting SCM_RIGHTS descriptors (close-on-exec).
/// Throws Error(system) on socket errors, Error(protocol) if descriptors were
/// truncated.
RecvResult recv_some(int fd, std::span<std::byte> space, std::vector<UniqueFd>& fds_out);

/// Sends a whole frame on a blocking or non-blocking socket, the descriptors
/// with its first byte, waiting (poll) at most until `deadline`.
void send_frame(int fd, std::span<const std::byte> frame, std::span<const int> fds,
                std::chrono::steady_clock::time_point deadline);

/// Runs `fn`, turning Cap'n Proto decoding failures (kj::Exception) into
/// Error(Code::protocol) with `context`.
template <typename Fn>
auto with_protocol_checks(std::string_view context, Fn&& fn) -> decltype(fn());

[[noreturn]] void throw_malformed(std::string_view context, const char* description);

}  // namespace collectived::ipc

#include <kj/exception.h>

namespace collectived::ipc {
template <typename Fn>
auto with_protocol_checks(std::string_view context, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const kj::Exception& e) {
    throw_malformed(context, e.getDescription().cStr());
  }
}

template <typename Root>
typename Root::Reader IncomingFrame::root() {
  if (!reader_) throw_malformed("segment table", malformed_.c_str());
  return reader_->getRoot<Root>();
}
}  // namespace collectived::ipc
