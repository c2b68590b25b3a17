#include "ipc/frame.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

namespace collectived::ipc {
namespace {

void put_u32(std::byte* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

std::uint32_t get_u32(const std::byte* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace

Limits Limits::for_max_frame(std::uint64_t max_frame_bytes) {
  Limits l;
  l.max_frame_bytes = max_frame_bytes;
  // Twice the frame's words: enough for any honest message, small enough that
  // a crafted one cannot make the reader walk far beyond what it received.
  l.traversal_limit_words = std::max<std::uint64_t>(max_frame_bytes / 8 * 2, 1024);
  return l;
}

std::vector<std::byte> encode_frame(capnp::MessageBuilder& message, std::uint32_t nfds) {
  kj::Array<capnp::word> words = capnp::messageToFlatArray(message);
  const std::size_t payload = words.size() * sizeof(capnp::word);
  std::vector<std::byte> out(kHeaderBytes + payload);
  put_u32(out.data(), kFrameMagic);
  put_u32(out.data() + 4, static_cast<std::uint32_t>(payload));
  put_u32(out.data() + 8, nfds);
  put_u32(out.data() + 12, 0);
  std::memcpy(out.data() + kHeaderBytes, words.begin(), payload);
  return out;
}

std::vector<std::byte> encode_error(std::uint64_t id, Code code, std::string_view text) {
  capnp::MallocMessageBuilder b(kSmallMessageWords);
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  auto e = m.initError();
  e.setCode(static_cast<wire::Code>(code));
  e.setMessage(kj::StringPtr(std::string(text).c_str()));
  return encode_frame(b);
}

IncomingFrame::IncomingFrame(kj::Array<capnp::word> words, std::vector<UniqueFd> fds,
                             const Limits& limits)
    : words_(kj::mv(words)), fds_(std::move(fds)) {
  try {
    // Validates the segment table against the received words.
    reader_.emplace(words_.asPtr(),
                    capnp::ReaderOptions{limits.traversal_limit_words, limits.nesting_limit});
  } catch (const kj::Exception& e) {
    malformed_ = e.getDescription().cStr();
  }
}

wire::Message::Reader IncomingFrame::message() {
  if (!reader_) throw_malformed("segment table", malformed_.c_str());
  return reader_->getRoot<wire::Message>();
}

void throw_malformed(std::string_view context, const char* description) {
  std::string msg = "malformed message";
  if (!context.empty()) {
    msg += " (";
    msg += context;
    msg += ")";
  }
  msg += ": ";
  msg += description;
  throw Error(Code::protocol, std::move(msg));
}

FrameDecoder::FrameDecoder(Limits limits) : limits_(limits), buf_(64 * 1024) {}

std::span<std::byte> FrameDecoder::read_space() {
  if (end_ == buf_.size()) {
    if (begin_ > 0) {
      // Move the unconsumed tail to the front instead of growing.
      std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
    }
    if (end_ == buf_.size()) buf_.resize(buf_.size() * 2);
  }
  return {buf_.data() + end_, buf_.size() - end_};
}

void FrameDecoder::commit(std::size_t n) { end_ += n; }

std::size_t FrameDecoder::take(std::span<std::byte> out) {
  const std::size_t n = std::min(out.size(), end_ - begin_);
  if (n != 0) std::memcpy(out.data(), buf_.data() + begin_, n);
  begin_ += n;
  if (begin_ == end_) begin_ = end_ = 0;
  return n;
}

void FrameDecoder::add_fds(std::vector<UniqueFd> fds) {
  for (auto& fd : fds) pending_fds_.push_back(std::move(fd));
  if (pending_fds_.size() > kMaxPendingFds) {
    throw Error(Code::protocol, "too many file descriptors sent ahead of their frames (" +
                                    std::to_string(pending_fds_.size()) + ", limit " +
                                    std::to_string(kMaxPendingFds) + ")");
  }
}

std::unique_ptr<IncomingFrame> FrameDecoder::next() {
  if (end_ - begin_ < kHeaderBytes) return nullptr;
  const std::byte* h = buf_.data() + begin_;
  const std::uint32_t magic = get_u32(h);
  const std::uint32_t payload = get_u32(h + 4);
  const std::uint32_t nfds = get_u32(h + 8);
  if (magic != kFrameMagic) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "0x%08x", magic);
    throw Error(Code::protocol, std::string("bad frame magic ") + hex +
                                    " (expected 0x31464443 \"CDF1\"): not a collectived client, "
                                    "or the stream lost sync");
  }
  if (payload > limits_.max_frame_bytes) {
    throw Error(Code::protocol, "frame of " + std::to_string(payload) +
                                    " bytes exceeds the limit of " +
                                    std::to_string(limits_.max_frame_bytes) +
                                    " bytes (client.max_frame_bytes)");
  }
  if (payload == 0 || payload % sizeof(capnp::word) != 0) {
    throw Error(Code::protocol, "frame payload of " + std::to_string(payload) +
                                    " bytes is not a positive multiple of 8");
  }
  if (nfds > kMaxFdsPerFrame) {
    throw Error(Code::protocol, "frame declares " + std::to_string(nfds) +
                                    " descriptors; at most " + std::to_string(kMaxFdsPerFrame) +
                                    " are allowed");
  }
  if (end_ - begin_ < kHeaderBytes + payload) {
    // Make sure the whole frame will fit without another round of growth.
    if (buf_.size() < kHeaderBytes + payload) {
      std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
      buf_.resize(kHeaderBytes + payload);
    }
    return nullptr;
  }
  if (pending_fds_.size() < nfds) {
    throw Error(Code::protocol, "frame declares " + std::to_string(nfds) +
                                    " descriptors but " + std::to_string(pending_fds_.size()) +
                                    " arrived with it (send them with SCM_RIGHTS in the frame's "
                                    "first sendmsg)");
  }
  // Copy into word-aligned storage: Cap'n Proto reads words in place.
  auto words = kj::heapArray<capnp::word>(payload / sizeof(capnp::word));
  std::memcpy(words.begin(), h + kHeaderBytes, payload);
  begin_ += kHeaderBytes + payload;
  if (begin_ == end_) begin_ = end_ = 0;
  std::vector<UniqueFd> fds;
  for (std::uint32_t i = 0; i < nfds; ++i) {
    fds.push_back(std::move(pending_fds_.front()));
    pending_fds_.pop_front();
  }
  return std::make_unique<IncomingFrame>(kj::mv(words), std::move(fds), limits_);
}

std::unique_ptr<IncomingFrame> decode_frame(std::span<const std::byte> bytes,
                                            const Limits& limits) {
  if (bytes.size() < kHeaderBytes) throw Error(Code::protocol, "ring slot shorter than a frame header");
  const std::uint32_t magic = get_u32(bytes.data());
  const std::uint32_t payload = get_u32(bytes.data() + 4);
  const std::uint32_t nfds = get_u32(bytes.data() + 8);
  if (magic != kFrameMagic || payload != bytes.size() - kHeaderBytes || payload == 0 ||
      payload % sizeof(capnp::word) != 0 || payload > limits.max_frame_bytes || nfds != 0) {
    throw Error(Code::protocol, "malformed frame in a ring slot");
  }
  auto words = kj::heapArray<capnp::word>(payload / sizeof(capnp::word));
  std::memcpy(words.begin(), bytes.data() + kHeaderBytes, payload);
  return std::make_unique<IncomingFrame>(kj::mv(words), std::vector<UniqueFd>{}, limits);
}

RecvResult recv_some(int fd, std::span<std::byte> space, std::vector<UniqueFd>& fds_out) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPendingFds)];
  iovec iov{space.data(), space.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return {0, false, true};
    if (errno == ECONNRESET) return {0, true, false};
    throw_errno("recvmsg on control socket");
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      const int* fds = reinterpret_cast<const int*>(CMSG_DATA(c));
      for (std::size_t i = 0; i < count; ++i) fds_out.emplace_back(fds[i]);
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    throw Error(Code::protocol, "descriptors truncated: more than " +
                                    std::to_string(kMaxPendingFds) + " sent at once");
  }
  return {static_cast<std::size_t>(n), n == 0, false};
}

void send_frame(int fd, std::span<const std::byte> frame, std::span<const int> fds,
                std::chrono::steady_clock::time_point deadline) {
  std::size_t sent = 0;
  bool fds_sent = fds.empty();
  while (sent < frame.size()) {
    iovec iov{const_cast<std::byte*>(frame.data() + sent), frame.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame)];
    if (!fds_sent) {
      if (fds.size() > kMaxFdsPerFrame) {
        throw Error(Code::invalid_argument, "at most " + std::to_string(kMaxFdsPerFrame) +
                                                " descriptors per frame");
      }
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      sent += static_cast<std::size_t>(n);
      fds_sent = true;
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      if (errno == EPIPE || errno == ECONNRESET) {
        throw Error(Code::unavailable, "the connection was closed by the other side");
      }
      throw_errno("sendmsg on control socket");
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      throw Error(Code::timeout, "sending a frame: the peer did not read for the whole deadline");
    }
    pollfd p{fd, POLLOUT, 0};
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
    ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
  }
}

}  // namespace collectived::ipc
