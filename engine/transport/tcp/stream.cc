#include "engine/transport/tcp/stream.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <optional>

namespace collectived::engine::transport::tcp {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

// What one read of a stream with copy threads takes at most into its frame
// decoder (read_next).
constexpr std::size_t kFrameReadBytes = 8 * 1024;

}  // namespace

// --- PeerStream ------------------------------------------------------------------

PeerStream::PeerStream(tcp::socket socket, std::uint64_t max_frame_bytes)
    : socket_(std::move(socket)),
      decoder_(ipc::Limits::for_max_frame(max_frame_bytes)),
      close_timer_(socket_.get_executor()),
      last_received_(PeerClock::now()),
      last_answer_(last_received_) {
  boost::system::error_code ec;
  const auto remote = socket_.remote_endpoint(ec);
  if (!ec) remote_text_ = endpoint_text(remote);
  const auto local = socket_.local_endpoint(ec);
  if (!ec) local_text_ = endpoint_text(local);
}

namespace {
/// A BulkIo result as the error code Asio would have given.
boost::system::error_code bulk_error(int err) {
  if (err == 0) return {};
  if (err < 0) return asio::error::eof;
  return boost::system::error_code(err, boost::system::system_category());
}

// Asio's transfer_all() moves at most 64 KiB per system call (its default
// maximum transfer size): a 1 MiB chunk then costs 16 sendmsg or recv calls
// and as many trips through the reactor.
// Whole pieces let the kernel take, in one call, what its socket buffer holds.
struct TransferAllLarge {
  std::size_t operator()(const boost::system::error_code& ec, std::size_t /*done*/) const {
    return ec ? 0 : std::size_t{1} << 30;
  }
};
}  // namespace

void PeerStream::start() { read_next(); }

bool PeerStream::set_max_frame(std::uint64_t max_frame_bytes) {
  // Only between frames, and only from inside a message handler, when no read
  // is in progress (the read targets the decoder's buffer).
  if (decoder_.buffered_bytes() != 0) return false;
  decoder_ = ipc::FrameDecoder(ipc::Limits::for_max_frame(max_frame_bytes));
  return true;
}

void PeerStream::read_next() {
  // With copy threads, frames are read in small slices: a chunk's raw bytes
  // follow its frame, and whatever of them a read takes into the decoder is
  // copied again from there (drain) on this thread, one chunk after the
  // other, before a copy thread takes the rest: with 64 KiB reads, half of
  // every 128 KiB piece of a message spread over the streams passed through
  // the event loop twice. Reading kFrameReadBytes, the raw bytes go from the
  // socket straight to where they belong. Without copy threads this thread
  // copies every byte anyway, and the larger read is the faster one.
  auto space = decoder_.read_space();
  if (bulk_ != nullptr && space.size() > kFrameReadBytes) space = space.first(kFrameReadBytes);
  socket_.async_read_some(asio::buffer(space.data(), space.size()),
                          [self = shared_from_this()](const boost::system::error_code& ec,
                                                      std::size_t n) { self->on_read(ec, n); });
}

bool PeerStream::read_done(const boost::system::error_code& ec, std::size_t n) {
  if (closed_) {
    // A raw read ended by the close: its buffers (and a placement's hold on
    // the receiver's memory) go now, not with the stream object.
    raw_ = Raw{};
    return false;
  }
  if (ec) {
    fail(Code::unavailable, ec == asio::error::eof || ec == asio::error::connection_reset
                                ? "the connection was closed by the other side"
                                : "read failed: " + ec.message(),
         false);
    return false;
  }
  bytes_received_ += n;
  last_received_ = PeerClock::now();
  return true;
}

void PeerStream::on_read(const boost::system::error_code& ec, std::size_t n) {
  if (!read_done(ec, n)) return;
  decoder_.commit(n);
  drain();
}

void PeerStream::drain() {
  try {
    while (!closed_) {
      if (raw_.done) {
        // Raw chunk bytes: what the decoder read already, then the rest
        // straight from the socket into the reassembly buffer.
        const std::size_t got = decoder_.take({raw_.dest, static_cast<std::size_t>(raw_.remaining)});
        raw_.dest += got;
        raw_.remaining -= got;
        if (raw_.remaining > 0) {
          auto self = shared_from_this();
          if (bulk_ != nullptr && raw_.offload && raw_.remaining >= BulkIo::kMinBytes) {
            ++bulk_busy_;
            bulk_->read(socket_.native_handle(), raw_.dest, raw_.remaining,
                        [self, ex = socket_.get_executor()](int err, std::size_t n) {
                          asio::post(ex, [self, err, n] {
                            self->bulk_finished();
                            self->on_raw_read(bulk_error(err), n);
                          });
                        });
            return;
          }
          asio::async_read(socket_, asio::buffer(raw_.dest, raw_.remaining), TransferAllLarge{},
                           [self](const boost::system::error_code& ec, std::size_t n) {
                             self->on_raw_read(ec, n);
                           });
          return;
        }
        finish_raw();
        continue;
      }
      auto frame = decoder_.next();
      if (!frame) break;
      auto sink = sink_.lock();
      if (!sink) {
        close();
        return;
      }
      ipc::with_protocol_checks("peer message", [&] {
        sink->on_stream_message(*this, frame->root<peerwire::PeerMessage>());
      });
    }
  } catch (const Error& e) {
    // Bad framing or a message that breaks the protocol: the stream cannot be
    // trusted any more. The other side learns why.
    fail(e.code() == Code::ok ? Code::protocol : e.code(), e.what(), true);
    return;
  }
  if (!closed_) read_next();
}

void PeerStream::on_raw_read(const boost::system::error_code& ec, std::size_t n) {
  if (!read_done(ec, n)) return;
  raw_.remaining = 0;
  drain();
}

void PeerStream::bulk_finished() {
  if (--bulk_busy_ == 0 && closed_) {
    boost::system::error_code ignored;
    socket_.close(ignored);
  }
}

void PeerStream::expect_raw(std::byte* dest, std::uint64_t bytes, std::shared_ptr<void> owner,
                            std::function<void()> done, bool offload) {
  // drain() reads them (and calls `done`) before it decodes another frame.
  raw_ = Raw{dest, bytes, std::move(owner), std::move(done), offload};
}

void PeerStream::finish_raw() {
  Raw r = std::move(raw_);
  raw_ = Raw{};
  if (r.done) r.done();
}

void PeerStream::send_frame(std::vector<std::byte> frame) {
  if (closed_ || closing_) return;
  control_.push_back(std::move(frame));
  if (!writing_) write_next();
}

void PeerStream::send_chunk(Chunk chunk) {
  if (closed_ || closing_) return;
  data_.push_back(std::move(chunk));
  if (!writing_) write_next();
}

void PeerStream::write_next() {
  if (closed_) return;
  std::vector<asio::const_buffer> buffers;
  current_message_.reset();
  current_written_ = nullptr;
  if (!control_.empty()) {
    current_frame_ = std::move(control_.front());
    control_.pop_front();
    buffers.push_back(asio::buffer(current_frame_));
  } else if (!data_.empty()) {
    Chunk c = std::move(data_.front());
    data_.pop_front();
    // A small frame describing the chunk, then its bytes in place: one
    // gathered write, no copy.
    capnp::MallocMessageBuilder b(ipc::kSmallMessageWords);
    auto d = b.initRoot<peerwire::PeerMessage>().initData();
    d.setChannel(c.channel);
    d.setSeq(c.seq);
    d.setOffset(c.offset);
    const auto& head = c.message->head;
    if (c.head_in_frame) {
      d.setTotal(c.message->size() - head.size());
      d.setHead(capnp::Data::Reader(reinterpret_cast<const kj::byte*>(head.data()), head.size()));
    } else {
      d.setTotal(c.message->size());
    }
    d.setRaw(c.length);
    d.setStreaming(c.offload);
    current_frame_ = ipc::encode_frame(b);
    buffers.push_back(asio::buffer(current_frame_));
    // The bytes [offset, offset + length) of head ++ payload (of the payload
    // alone when the head is in the frame).
    std::uint64_t pos = 0;
    const std::uint64_t from = c.offset, to = c.offset + c.length;
    auto add = [&](std::span<const std::byte> piece) {
      const std::uint64_t a = std::max(from, pos), e = std::min(to, pos + piece.size());
      if (a < e) buffers.push_back(asio::buffer(piece.data() + (a - pos), e - a));
      pos += piece.size();
    };
    if (!c.head_in_frame) add(head);
    for (const auto& piece : c.message->payload) {
      if (pos >= to) break;
      add(piece);
    }
    current_message_ = std::move(c.message);
    current_offload_ = c.offload;
    current_written_ = std::move(c.written);
  } else {
    writing_ = false;
    if (closing_) close();
    return;
  }
  writing_ = true;
  auto self = shared_from_this();
  if (bulk_ != nullptr && current_message_ && current_offload_ &&
      asio::buffer_size(buffers) >= BulkIo::kMinBytes) {
    std::vector<iovec> iov;
    iov.reserve(buffers.size());
    for (const auto& b : buffers) iov.push_back(iovec{const_cast<void*>(b.data()), b.size()});
    ++bulk_busy_;
    bulk_->write(socket_.native_handle(), std::move(iov),
                 [self, ex = socket_.get_executor()](int err, std::size_t n) {
                   asio::post(ex, [self, err, n] {
                     self->bulk_finished();
                     self->on_written(bulk_error(err), n);
                   });
                 });
    return;
  }
  asio::async_write(socket_, buffers, TransferAllLarge{},
                    [self](const boost::system::error_code& ec, std::size_t n) {
                      self->on_written(ec, n);
                    });
}

void PeerStream::on_written(const boost::system::error_code& ec, std::size_t n) {
  if (closed_) return;
  if (ec) {
    fail(Code::unavailable, "write failed: " + ec.message(), false);
    return;
  }
  bytes_sent_ += n;
  current_message_.reset();
  if (auto written = std::move(current_written_)) {
    current_written_ = nullptr;
    written();
  }
  write_next();
}

void PeerStream::close_after(std::vector<std::byte> last) {
  if (closed_ || closing_) return;
  data_.clear();
  if (!writing_ && control_.empty()) {
    // Idle: try at once, so that the frame leaves even if the event loop
    // stops right after (daemon shutdown).
    const ssize_t n = ::send(socket_.native_handle(), last.data(), last.size(),
                             MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n == static_cast<ssize_t>(last.size())) {
      bytes_sent_ += last.size();
      close();
      return;
    }
    if (n > 0) {
      bytes_sent_ += static_cast<std::uint64_t>(n);
      last.erase(last.begin(), last.begin() + n);
    }
  }
  control_.push_back(std::move(last));
  closing_ = true;
  close_timer_.expires_after(std::chrono::seconds(1));
  close_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (!ec) self->close();
  });
  if (!writing_) write_next();
}

void PeerStream::close() {
  if (closed_) return;
  closed_ = true;
  writing_ = false;
  boost::system::error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  // A transfer on a bulk thread ends on the shutdown; the descriptor is
  // closed once it has (bulk_finished), never under it.
  if (bulk_busy_ == 0) socket_.close(ignored);
  close_timer_.cancel();
  control_.clear();
  data_.clear();
  current_written_ = nullptr;
  // A pending raw read is cancelled with the socket; its handler only sees
  // closed_. Its buffer stays alive (owner) until then.
}

void PeerStream::fail(Code code, const std::string& why, bool tell_peer) {
  if (closed_) return;
  auto self = shared_from_this();
  if (tell_peer) {
    close_after(encode_peer_error(code, why));
  } else {
    close();
  }
  if (auto sink = sink_.lock()) sink->on_stream_closed(*this, code, why);
}

}  // namespace collectived::engine::transport::tcp
