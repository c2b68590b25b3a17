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

namespace collectived::engine::transport::tcp {

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

}  // namespace collectived::engine::transport::tcp
