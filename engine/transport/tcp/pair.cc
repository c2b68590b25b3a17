#include "engine/transport/tcp/pair.h"

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

namespace collectived::tcp {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

// Bounds on what one peer may make this daemon hold for reassembly.
constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{1} << 30;  // one message
// A message's head goes in every chunk's frame (protocol 3) when it is at
// most this long and the payload after it at least kPlaceMinBytes: the
// receiver then learns where the payload belongs before any of it arrives,
// whichever stream brings the first chunk (engine::kPlaceMinBytes).
constexpr std::uint64_t kMaxFrameHead = 4096;
constexpr std::uint64_t kMaxHeldBytes = std::uint64_t{2} << 30;     // all incomplete ones
// A lone message is spread over the streams from this size (start_send).
constexpr std::uint64_t kSpreadMinBytes = 512 * 1024;
// Largest frame accepted after the handshake. Chunk bytes travel after their
// frame, unframed (DataChunk.raw), so frames stay small whatever
// tcp.chunk_bytes is.
constexpr std::uint64_t kMaxPeerFrame = std::uint64_t{1} << 20;
// What one read of a stream with copy threads takes at most into its frame
// decoder (read_next).
constexpr std::size_t kFrameReadBytes = 8 * 1024;

std::uint64_t steady_ns() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        PeerClock::now().time_since_epoch())
                                        .count());
}

std::int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string ms_text(std::chrono::milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

}  // namespace

std::string_view to_string(PeerState state) {
  switch (state) {
    case PeerState::connecting: return "connecting";
    case PeerState::ready: return "ready";
    case PeerState::dead: return "dead";
  }
  return "unknown";
}

std::string endpoint_text(const tcp::endpoint& endpoint) {
  asio::ip::address a = endpoint.address();
  if (a.is_v6() && a.to_v6().is_v4_mapped()) {
    a = asio::ip::make_address_v4(asio::ip::v4_mapped, a.to_v6());
  }
  const std::string port = std::to_string(endpoint.port());
  return a.is_v6() ? "[" + a.to_string() + "]:" + port : a.to_string() + ":" + port;
}

PeerAddress parse_peer_address(const std::string& text) {
  auto bad = [&](const std::string& why) -> Error {
    return Error(Code::invalid_argument, "bad peer address \"" + text + "\": " + why +
                                             " (expected host:port, or [IPv6]:port)");
  };
  PeerAddress out;
  std::string port;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      throw bad("no ]:port after the IPv6 address");
    }
    out.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) throw bad("no port");
    out.host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (out.host.find(':') != std::string::npos) throw bad("an IPv6 address needs brackets");
  }
  if (out.host.empty()) throw bad("no host");
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](unsigned char c) { return std::isdigit(c); })) {
    throw bad("the port is not a number");
  }
  const unsigned long p = std::stoul(port);
  if (p == 0 || p > 65535) throw bad("the port is not in 1..65535");
  out.port = static_cast<std::uint16_t>(p);
  boost::system::error_code ec;
  const auto ip = asio::ip::make_address(out.host, ec);
  if (!ec) {
    out.key = endpoint_text(tcp::endpoint(ip, out.port));
    out.host = ip.to_string();
  } else {
    for (char& c : out.host) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (out.host.size() > 253) throw bad("the host name is too long");
    out.key = out.host + ":" + port;
  }
  return out;
}

// --- Socket options -------------------------------------------------------------

std::string set_congestion_control(int fd, const std::string& congestion) {
  if (congestion.empty()) return {};
  // Per socket, so that the system's default (which may pace: bbr) does not
  // apply to the peer links; see tcp.congestion_control in the profile.
  if (::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, congestion.data(),
                   static_cast<socklen_t>(congestion.size())) != 0) {
    return std::strerror(errno);
  }
  return {};
}

std::string congestion_control_of(int fd) {
  char name[16] = {};
  socklen_t len = sizeof name;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return {};
  return std::string(name, strnlen(name, std::min<std::size_t>(len, sizeof name)));
}

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

// --- Pair --------------------------------------------------------------------

Pair::Pair(asio::io_context& io, const PeerOptions& options, const Secret& secret,
                   Owner& owner, std::string key, bool outbound, std::string known_node)
    : io_(io),
      options_(options),
      secret_(secret),
      owner_(owner),
      key_(std::move(key)),
      outbound_(outbound),
      node_(std::move(known_node)),
      resolver_(io),
      connect_timer_(io),
      heartbeat_timer_(io) {}

Pair::~Pair() {
  for (auto& s : streams_) {
    if (s) s->close();
  }
}

std::string Pair::describe() const {
  return node_.empty() ? "the peer daemon at " + key_ : "node " + node_ + " (" + key_ + ")";
}

std::uint64_t Pair::max_frame() const { return kMaxPeerFrame; }

std::uint64_t Pair::bytes_sent() const {
  std::uint64_t n = 0;
  for (const auto& s : streams_) {
    if (s) n += s->bytes_sent();
  }
  return n;
}

std::uint64_t Pair::bytes_received() const {
  std::uint64_t n = 0;
  for (const auto& s : streams_) {
    if (s) n += s->bytes_received();
  }
  return n;
}

void Pair::arm_connect_deadline(std::string (*why)(const Pair&)) {
  std::weak_ptr<Pair> weak = shared_from_this();
  connect_timer_.expires_after(options_.connect_deadline);
  connect_timer_.async_wait([weak, why](const boost::system::error_code& ec) {
    auto self = weak.lock();
    if (ec || !self || self->state_ != PeerState::connecting) return;
    self->fail(Code::timeout, why(*self), false, true);
  });
}

void Pair::connect() {
  connection_id_ = random_u64();
  streams_wanted_ = std::max<std::uint32_t>(1, options_.streams_per_peer);
  streams_.resize(streams_wanted_);
  handshakes_.resize(streams_wanted_);
  // Dialing side: how far the connection got when the deadline passed.
  arm_connect_deadline([](const Pair& self) {
    return "no connection to " + self.describe() + " within " +
           ms_text(self.options_.connect_deadline) + " (deadlines.connect_ms): " +
           (self.streams_ready_ == 0 ? std::string("the daemon did not answer")
                                     : std::to_string(self.streams_ready_) + " of " +
                                           std::to_string(self.streams_wanted_) +
                                           " streams were ready");
  });
  std::weak_ptr<Pair> weak = shared_from_this();
  PeerAddress address;
  try {
    address = parse_peer_address(key_);
  } catch (const Error& e) {
    asio::post(io_, [weak, code = e.code(), why = std::string(e.what())] {
      if (auto self = weak.lock()) self->fail(code, why, false, false);
    });
    return;
  }
  // Stream 0 alone first: a refusal (secret, version) then happens once, and
  // the other streams go to the address that answered.
  resolver_.async_resolve(
      address.host, std::to_string(address.port), tcp::resolver::numeric_service,
      [weak, host = address.host](const boost::system::error_code& ec,
                                  tcp::resolver::results_type results) {
        auto self = weak.lock();
        if (!self || self->state_ != PeerState::connecting) return;
        if (ec) {
          self->fail(Code::unavailable,
                     "cannot resolve " + host + " for " + self->describe() + ": " + ec.message(),
                     false, false);
          return;
        }
        // The first address of the family this daemon listens on, else the first.
        boost::system::error_code ignored;
        self->endpoint_ = results.begin()->endpoint();
        const auto own = asio::ip::make_address(self->options_.bind_address, ignored);
        for (const auto& r : results) {
          if (r.endpoint().address().is_v4() == own.is_v4()) {
            self->endpoint_ = r.endpoint();
            break;
          }
        }
        self->open_stream(0, self->endpoint_);
      });
}

void Pair::open_stream(std::uint32_t index, const tcp::endpoint& endpoint) {
  std::weak_ptr<Pair> weak = shared_from_this();
  auto socket = std::make_shared<tcp::socket>(io_);
  boost::system::error_code ec;
  socket->open(endpoint.protocol(), ec);
  // Before connect (see set_congestion_control); the manager checked the
  // name once and cleared it where the kernel refuses it.
  if (!ec) (void)set_congestion_control(socket->native_handle(), options_.congestion_control);
  // Leave from the address this daemon listens on (the node's data-network
  // address), unless it listens everywhere or the route could not use it.
  boost::system::error_code bec;
  const auto own = asio::ip::make_address(options_.bind_address, bec);
  if (!ec && !bec && options_.port != 0 && !own.is_unspecified() &&
      own.is_v4() == endpoint.address().is_v4() &&
      own.is_loopback() == endpoint.address().is_loopback()) {
    socket->bind(tcp::endpoint(own, 0), ec);
  }
  auto failed = [weak, index](const boost::system::error_code& e) {
    auto self = weak.lock();
    if (!self || self->state_ == PeerState::dead) return;
    if (index == 0) {
      self->fail(Code::unavailable, "cannot connect to " + self->describe() + ": " + e.message(),
                 false, false);
    } else {
      self->fail(Code::unavailable,
                 "cannot open stream " + std::to_string(index) + " to " + self->describe() +
                     ": " + e.message(),
                 false, true);
    }
  };
  if (ec) {
    asio::post(io_, [failed, ec] { failed(ec); });
    return;
  }
  socket->async_connect(endpoint, [weak, socket, index, failed](const boost::system::error_code& e) {
    auto self = weak.lock();
    if (!self || self->state_ == PeerState::dead) return;
    if (e) {
      failed(e);
      return;
    }
    self->start_stream(index, std::move(*socket));
  });
}

void Pair::start_stream(std::uint32_t index, tcp::socket socket) {
  boost::system::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  auto stream = std::make_shared<PeerStream>(std::move(socket), max_frame());
  stream->set_bulk(options_.bulk);
  stream->index = index;
  streams_[index] = stream;
  PeerIdentity me = options_.local;
  if (options_.listen_any) {
    // Announce the address this connection leaves from, with the listener's port.
    const std::string& local = stream->local_text();
    me.listen_address = local.substr(0, local.rfind(':')) + ":" + std::to_string(options_.port);
  }
  handshakes_[index] = std::make_unique<Handshake>(secret_, std::move(me), connection_id_, index,
                                                   streams_wanted_, stream->remote_text());
  stream->set_sink(std::static_pointer_cast<StreamSink>(shared_from_this()));
  stream->start();
  for (auto& frame : handshakes_[index]->start()) stream->send_frame(std::move(frame));
}

void Pair::on_handshake_message(PeerStream& stream, Handshake& hs,
                                    peerwire::PeerMessage::Reader message) {
  auto frames = hs.on_message(message);
  if (hs.state() == Handshake::State::failed) {
    if (!frames.empty()) {
      stream.close_after(std::move(frames.back()));
    } else {
      stream.close();
    }
    if (node_.empty()) node_ = hs.remote().node;
    fail(hs.error_code(), hs.error(), true, false);
    return;
  }
  for (auto& f : frames) stream.send_frame(std::move(f));
  if (hs.state() != Handshake::State::done) return;
  if (stream.index == 0) {
    remote_ = hs.remote();
    node_ = remote_.node;
    for (std::uint32_t i = 1; i < streams_wanted_; ++i) open_stream(i, endpoint_);
  } else if (hs.remote().node != node_) {
    fail(Code::protocol,
         "stream " + std::to_string(stream.index) + " to " + key_ + " reached node " +
             hs.remote().node + ", stream 0 reached node " + node_,
         false, true);
    return;
  }
  if (++streams_ready_ == streams_wanted_) become_ready();
}

void Pair::attach(std::shared_ptr<PeerStream> stream, const Handshake& hs) {
  if (state_ == PeerState::dead) {
    stream->close();
    return;
  }
  if (streams_.empty()) {
    connection_id_ = hs.connection_id();
    streams_wanted_ = hs.streams();
    streams_.resize(streams_wanted_);
    remote_ = hs.remote();
    node_ = remote_.node;
    // Accepting side: the initiator's other streams must follow in time.
    arm_connect_deadline([](const Pair& self) {
      return "only " + std::to_string(self.streams_ready_) + " of " +
             std::to_string(self.streams_wanted_) + " streams of " + self.describe() +
             " arrived within " + ms_text(self.options_.connect_deadline) +
             " (deadlines.connect_ms)";
    });
  }
  const std::uint32_t index = hs.stream_index();
  if (hs.streams() != streams_wanted_ || index >= streams_wanted_ || streams_[index] ||
      hs.remote().node != node_) {
    stream->close_after(encode_peer_error(
        Code::protocol, "stream " + std::to_string(index) + " of " +
                            std::to_string(hs.streams()) + " does not fit connection " +
                            std::to_string(connection_id_) + " of " + describe() + " (" +
                            std::to_string(streams_wanted_) + " streams)"));
    return;
  }
  stream->index = index;
  streams_[index] = stream;
  stream->set_sink(std::static_pointer_cast<StreamSink>(shared_from_this()));
  stream->set_max_frame(max_frame());
  if (++streams_ready_ == streams_wanted_) become_ready();
}

void Pair::become_ready() {
  auto self = shared_from_this();
  state_ = PeerState::ready;
  connect_timer_.cancel();
  handshakes_.clear();
  ready_wall_ = std::chrono::system_clock::now();
  for (auto& s : streams_) s->answered();
  owner_.link_ready(*this);
  if (state_ != PeerState::ready) return;
  // A first heartbeat at once, so that status shows the RTT from the start.
  for (auto& s : streams_) s->send_frame(heartbeat_frame(next_heartbeat_seq_++));
  arm_heartbeat();
  for (auto& [seq, p] : pings_) {
    if (!p.sent) send_ping(seq);
  }
  while (!queued_.empty() && state_ == PeerState::ready) {
    Queued q = std::move(queued_.front());
    queued_.pop_front();
    start_send(q.channel, std::move(q.message), std::move(q.done));
  }
}

void Pair::on_stream_message(PeerStream& stream, peerwire::PeerMessage::Reader m) {
  if (state_ == PeerState::dead) return;
  if (stream.index < handshakes_.size() && handshakes_[stream.index] &&
      handshakes_[stream.index]->state() == Handshake::State::in_progress) {
    on_handshake_message(stream, *handshakes_[stream.index], m);
    return;
  }
  using W = peerwire::PeerMessage;
  switch (m.which()) {
    case W::HEARTBEAT:
      on_heartbeat(stream, m.getHeartbeat());
      return;
    case W::HEARTBEAT_ACK:
      on_heartbeat_ack(stream, m.getHeartbeatAck());
      return;
    case W::DATA:
      on_data(stream, m.getData());
      return;
    case W::ERROR: {
      const auto e = m.getError();
      Code code = code_from_wire(static_cast<std::uint16_t>(e.getCode()));
      if (code == Code::ok) code = Code::remote;
      fail(code, describe() + " closed the connection: " + e.getMessage().cStr(), false, false);
      return;
    }
    default:
      throw Error(Code::protocol, "sent a handshake message (" +
                                      std::to_string(static_cast<int>(m.which())) +
                                      ") after the handshake");
  }
}

void Pair::on_stream_closed(PeerStream& stream, Code code, const std::string& why) {
  if (state_ == PeerState::dead) return;
  fail(code,
       describe() + ": " + why + " (stream " + std::to_string(stream.index) +
           (state_ == PeerState::connecting ? ", while connecting)" : ")"),
       false, true);
}

void Pair::close(Code code, const std::string& why, bool tell_peer) {
  fail(code, why, false, tell_peer);
}

void Pair::fail(Code code, const std::string& why, bool refused, bool tell_peer) {
  if (state_ == PeerState::dead) return;
  auto self = shared_from_this();
  const PeerState was = state_;
  state_ = PeerState::dead;
  dead_code_ = code;
  dead_reason_ = why;
  connect_timer_.cancel();
  heartbeat_timer_.cancel();
  resolver_.cancel();
  for (auto& s : streams_) {
    if (!s) continue;
    if (tell_peer) {
      s->close_after(encode_peer_error(code, why, options_.local.node));
    } else {
      s->close();
    }
  }
  owner_.link_dead(*this, was, code, why, refused);
  const PeerResult result{code, why};
  auto queued = std::move(queued_);
  auto in_flight = std::move(in_flight_);
  auto pings = std::move(pings_);
  queued_.clear();
  in_flight_.clear();
  pings_.clear();
  partial_.clear();
  early_.clear();
  held_bytes_ = 0;
  for (auto& q : queued) {
    if (q.done) q.done(result);
  }
  for (auto& [id, f] : in_flight) {
    if (f.done) f.done(result);
  }
  for (auto& [seq, p] : pings) {
    p.timer->cancel();
    PingReply reply;
    reply.result = result;
    reply.node = node_;
    if (p.done) p.done(reply);
  }
}

// --- Heartbeats and pings ---------------------------------------------------------

std::vector<std::byte> Pair::heartbeat_frame(std::uint64_t seq) const {
  capnp::MallocMessageBuilder b(64);
  auto h = b.initRoot<peerwire::PeerMessage>().initHeartbeat();
  h.setSeq(seq);
  h.setSentNs(steady_ns());
  h.setWallNs(wall_ns());
  return ipc::encode_frame(b);
}

void Pair::arm_heartbeat() {
  std::weak_ptr<Pair> weak = shared_from_this();
  heartbeat_timer_.expires_after(options_.heartbeat_interval);
  heartbeat_timer_.async_wait([weak](const boost::system::error_code& ec) {
    auto self = weak.lock();
    if (ec || !self || self->state_ != PeerState::ready) return;
    self->heartbeat_tick();
  });
}

void Pair::heartbeat_tick() {
  // A stream whose heartbeats went unanswered for three intervals means the
  // peer is gone, stuck, or no longer reading (its own heartbeats arriving do
  // not count: a daemon that stopped reading would otherwise block our writes
  // forever).
  const auto interval = options_.heartbeat_interval;
  const auto now = PeerClock::now();
  for (auto& s : streams_) {
    const auto silent =
        std::chrono::duration_cast<std::chrono::milliseconds>(now - s->last_answer());
    if (silent > 3 * interval) {
      fail(Code::unavailable,
           describe() + " missed 3 heartbeats: no answer on stream " +
               std::to_string(s->index) + " for " + ms_text(silent) +
               " (deadlines.heartbeat_ms = " + std::to_string(interval.count()) + ")",
           false, true);
      return;
    }
  }
  for (auto& s : streams_) s->send_frame(heartbeat_frame(next_heartbeat_seq_++));
  arm_heartbeat();
}

void Pair::on_heartbeat(PeerStream& stream, peerwire::Heartbeat::Reader hb) {
  capnp::MallocMessageBuilder b(64);
  auto a = b.initRoot<peerwire::PeerMessage>().initHeartbeatAck();
  a.setSeq(hb.getSeq());
  a.setEchoSentNs(hb.getSentNs());
  a.setWallNs(wall_ns());
  stream.send_frame(ipc::encode_frame(b));
}

void Pair::on_heartbeat_ack(PeerStream& stream, peerwire::HeartbeatAck::Reader ack) {
  stream.answered();
  const std::uint64_t now = steady_ns();
  const std::uint64_t sent = ack.getEchoSentNs();
  const std::uint64_t rtt_ns = now > sent ? now - sent : 0;
  // The peer read its clock about half a round trip before the ack arrived.
  const std::int64_t ours = wall_ns() - static_cast<std::int64_t>(rtt_ns / 2);
  have_rtt_ = true;
  rtt_us_ = rtt_ns / 1000;
  // The peer's clock value is untrusted input: subtract in double so that a
  // corrupt or hostile value cannot overflow.
  skew_ms_ = (static_cast<double>(ack.getWallNs()) - static_cast<double>(ours)) / 1e6;
  const auto it = pings_.find(ack.getSeq());
  if (it == pings_.end() || !it->second.sent) return;
  PingDone done = std::move(it->second.done);
  it->second.timer->cancel();
  pings_.erase(it);
  PingReply reply;
  reply.node = node_;
  reply.rtt_us = rtt_us_;
  reply.skew_ms = skew_ms_;
  if (done) done(reply);
}

void Pair::ping(PeerClock::time_point deadline, PingDone done) {
  if (state_ == PeerState::dead) {
    PingReply reply;
    reply.result = {dead_code_, dead_reason_};
    reply.node = node_;
    asio::post(io_, [done = std::move(done), reply] { done(reply); });
    return;
  }
  const std::uint64_t seq = next_heartbeat_seq_++;
  auto& p = pings_[seq];
  p.done = std::move(done);
  p.timer = std::make_unique<asio::steady_timer>(io_);
  p.timer->expires_at(deadline);
  std::weak_ptr<Pair> weak = shared_from_this();
  const auto allowed = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - PeerClock::now());
  p.timer->async_wait([weak, seq, allowed](const boost::system::error_code& ec) {
    auto self = weak.lock();
    if (ec || !self) return;
    const auto it = self->pings_.find(seq);
    if (it == self->pings_.end()) return;
    PingDone expired = std::move(it->second.done);
    self->pings_.erase(it);
    PingReply reply;
    reply.node = self->node_;
    reply.result = {Code::timeout,
                    "no answer from " + self->describe() + " within " + ms_text(allowed) +
                        " (deadlines.connect_ms)" +
                        (self->state_ == PeerState::connecting ? " while connecting" : "")};
    if (expired) expired(reply);
  });
  if (state_ == PeerState::ready) send_ping(seq);
}

void Pair::send_ping(std::uint64_t seq) {
  pings_[seq].sent = true;
  streams_[0]->send_frame(heartbeat_frame(seq));
}

// --- Data --------------------------------------------------------------------------

void Pair::send(std::uint64_t channel, std::shared_ptr<const engine::OutMessage> message,
                    SendDone done) {
  if (state_ == PeerState::dead) {
    const PeerResult r{dead_code_, dead_reason_};
    asio::post(io_, [done = std::move(done), r] {
      if (done) done(r);
    });
    return;
  }
  if (state_ == PeerState::connecting) {
    queued_.push_back({channel, std::move(message), std::move(done)});
    return;
  }
  start_send(channel, std::move(message), std::move(done));
}

void Pair::start_send(std::uint64_t channel,
                          std::shared_ptr<const engine::OutMessage> message, SendDone done) {
  const std::uint64_t total = message->size();
  if (total > kMaxMessageBytes) {
    const PeerResult r{Code::invalid_argument,
                       "a message to " + describe() + " of " + std::to_string(total) +
                           " bytes exceeds the peer message limit of 1 GiB"};
    asio::post(io_, [done = std::move(done), r] {
      if (done) done(r);
    });
    return;
  }
  const std::uint64_t head = message->head.size();
  const bool head_in_frame = head > 0 && head <= kMaxFrameHead && total - head >= engine::kPlaceMinBytes;
  const std::uint64_t bytes = head_in_frame ? total - head : total;  // raw, after the frames
  std::uint64_t chunk = std::max<std::uint64_t>(1, options_.chunk_bytes);
  // With bulk copy threads, a message sent while no other is on its way is
  // spread over every stream (chunks of at least what those threads take,
  // whole pages), so that its copies into and out of the sockets run on
  // several threads at once: otherwise a lone message of one
  // tcp.chunk_bytes (an algorithm's chunk: 1 MiB by default) goes through one
  // socket on one thread, at what one TCP stream does. Where messages follow
  // each other they are spread already, one per stream, and cutting them
  // further only adds chunks (large all-reduces and reduce-scatters lost a
  // fifth). A lone message under kSpreadMinBytes stays whole on the event
  // loop: the hand-offs to the copy threads and back cost more than the
  // copies take (docs/architecture.md, bulk copy threads).
  if (options_.bulk != nullptr && streams_.size() > 1 && in_flight_.empty() && bytes >= kSpreadMinBytes) {
    const std::uint64_t per = (bytes + streams_.size() - 1) / streams_.size();
    const std::uint64_t spread = std::max<std::uint64_t>(BulkIo::kMinBytes, (per + 4095) & ~std::uint64_t{4095});
    chunk = std::min(chunk, spread);
  }
  const std::uint64_t chunks = bytes == 0 ? 1 : (bytes + chunk - 1) / chunk;
  const std::uint64_t seq = send_seq_[channel]++;
  const std::uint64_t id = next_send_id_++;
  in_flight_[id] = InFlight{static_cast<std::size_t>(chunks), std::move(done)};
  std::weak_ptr<Pair> weak = shared_from_this();
  // The copy threads start once every chunk is handed over (BulkIo::Batch).
  std::optional<BulkIo::Batch> batch;
  if (options_.bulk != nullptr && chunks > 1) batch.emplace(*options_.bulk);
  for (std::uint64_t k = 0; k < chunks; ++k) {
    PeerStream::Chunk c;
    c.message = message;
    c.channel = channel;
    c.seq = seq;
    c.offset = k * chunk;
    c.length = std::min(chunk, bytes - c.offset);
    c.head_in_frame = head_in_frame;
    // Bulk threads only for a stream of data (see on_data).
    c.offload = chunks > 1 || in_flight_.size() >= 2;
    c.written = [weak, id] {
      auto self = weak.lock();
      if (!self) return;
      const auto it = self->in_flight_.find(id);
      if (it == self->in_flight_.end()) return;
      if (--it->second.chunks_left > 0) return;
      SendDone finished = std::move(it->second.done);
      self->in_flight_.erase(it);
      if (finished) finished(PeerResult{});
    };
    streams_[next_stream_++ % streams_.size()]->send_chunk(std::move(c));
  }
}

void Pair::on_data(PeerStream& stream, peerwire::DataChunk::Reader chunk) {
  const std::uint64_t channel = chunk.getChannel();
  const std::uint64_t seq = chunk.getSeq();
  const std::uint64_t offset = chunk.getOffset();
  const std::uint64_t total = chunk.getTotal();
  const std::uint64_t raw = chunk.getRaw();
  const auto head = chunk.getHead();
  const std::uint64_t hb = head.size();
  // For the errors below only (made lazily: this runs for every chunk).
  const auto where = [channel, seq] {
    return " (channel " + std::to_string(channel) + ", message " + std::to_string(seq) + ")";
  };
  if (chunk.hasPayload() && chunk.getPayload().size() != 0) {
    throw Error(Code::protocol, "sent chunk bytes inside the frame (protocol 1), not after it" + where());
  }
  if (hb > kMaxFrameHead) {
    throw Error(Code::protocol, "sent a message head of " + std::to_string(hb) +
                                    " bytes in a chunk frame, beyond the limit of " +
                                    std::to_string(kMaxFrameHead) + where());
  }
  if (total > kMaxMessageBytes - hb) {
    throw Error(Code::protocol, "announced a message of " + std::to_string(total + hb) +
                                    " bytes, beyond the limit of 1 GiB" + where());
  }
  if (offset > total || raw > total - offset || (raw == 0 && total != 0)) {
    throw Error(Code::protocol, "sent a chunk outside its message" + where());
  }
  const std::uint64_t next = recv_next_[channel];
  if (seq < next) {
    throw Error(Code::protocol, "sent a message that was already delivered" + where());
  }
  const auto key = std::make_pair(channel, seq);
  if (early_.count(key) != 0) {
    throw Error(Code::protocol, "sent a message twice" + where());
  }
  const std::span<const std::byte> head_bytes(reinterpret_cast<const std::byte*>(head.begin()), hb);
  if (total == 0) {
    if (partial_.count(key) != 0) throw Error(Code::protocol, "changed the size of a message" + where());
    complete(key, engine::MessageBytes::copy_of(head_bytes));
    return;
  }
  auto it = partial_.find(key);
  if (it == partial_.end()) {
    if (held_bytes_ + hb + total > kMaxHeldBytes) {
      throw Error(Code::resource_exhausted,
                  "has more than 2 GiB of incomplete messages outstanding" + where());
    }
    auto buf = std::make_shared<Partial::Buffers>();
    // The head came first: the payload may have a place of its own (an
    // operation's output), and is then read from the socket straight there.
    if (hb != 0) buf->place = owner_.link_place(*this, channel, head_bytes, total);
    // Not zero-filled, and only the pages the chunks reach are ever touched:
    // announcing a large message costs the sender the bytes it sends.
    buf->bytes = engine::MessageBytes(buf->place.dest != nullptr ? hb : hb + total);
    if (hb != 0) std::memcpy(buf->bytes.data(), head_bytes.data(), hb);
    held_bytes_ += buf->bytes.size();
    it = partial_.emplace(key, Partial{buf, total, hb, {}, 0}).first;
  } else if (it->second.total != total || it->second.head != hb ||
             (hb != 0 && std::memcmp(it->second.buf->bytes.data(), head_bytes.data(), hb) != 0)) {
    throw Error(Code::protocol, "changed the size or the head of a message" + where());
  }
  Partial& p = it->second;
  // Chunks never overlap (each byte is written once, and a message is
  // complete exactly when its bytes are all in: no uninitialized byte is ever
  // delivered).
  auto& chunks = p.chunks;
  const auto after = chunks.lower_bound(offset);
  if ((after != chunks.end() && after->first < offset + raw) ||
      (after != chunks.begin() && std::prev(after)->second > offset)) {
    throw Error(Code::protocol, "sent overlapping chunks" + where());
  }
  chunks.emplace_hint(after, offset, offset + raw);
  std::byte* dest = p.buf->place.dest != nullptr ? p.buf->place.dest + offset
                                                  : p.buf->bytes.data() + p.head + offset;
  std::weak_ptr<Pair> weak = shared_from_this();
  // Copied on a bulk thread only while the sender streams data (it says so:
  // a message of several chunks, or more messages queued behind this one):
  // a lone chunk is read sooner on the event loop than handed over and back.
  const bool offload = chunk.getStreaming() || total > raw;
  stream.expect_raw(dest, raw, p.buf, [weak, key, raw] {
    if (auto self = weak.lock()) self->on_raw_done(key, raw);
  }, offload);
}

void Pair::on_raw_done(std::pair<std::uint64_t, std::uint64_t> key, std::uint64_t bytes) {
  const auto it = partial_.find(key);
  if (it == partial_.end()) return;  // the link failed meanwhile
  it->second.received += bytes;
  if (it->second.received < it->second.total) return;
  // Placed: the payload is in the receiver's memory already, and the message
  // delivered is its head.
  engine::MessageBytes whole = std::move(it->second.buf->bytes);
  partial_.erase(it);
  held_bytes_ -= whole.size();
  complete(key, std::move(whole));
}

void Pair::complete(std::pair<std::uint64_t, std::uint64_t> key, engine::MessageBytes whole) {
  const auto [channel, seq] = key;
  const std::uint64_t next = recv_next_[channel];
  if (seq != next) {
    held_bytes_ += whole.size();
    if (held_bytes_ > kMaxHeldBytes) {
      throw Error(Code::resource_exhausted,
                  "has more than 2 GiB of messages waiting for earlier ones (channel " +
                      std::to_string(channel) + ", message " + std::to_string(seq) + ")");
    }
    early_.emplace(key, std::move(whole));
    return;
  }
  recv_next_[channel] = next + 1;
  auto self = shared_from_this();
  owner_.link_data(*this, channel, seq, std::move(whole));
  deliver_in_order(channel);
}

void Pair::deliver_in_order(std::uint64_t channel) {
  while (state_ != PeerState::dead) {
    const std::uint64_t next = recv_next_[channel];
    const auto it = early_.find({channel, next});
    if (it == early_.end()) return;
    engine::MessageBytes bytes = std::move(it->second);
    early_.erase(it);
    held_bytes_ -= bytes.size();
    recv_next_[channel] = next + 1;
    owner_.link_data(*this, channel, next, std::move(bytes));
  }
}

}  // namespace collectived::tcp
