#include "engine/transport/tcp/device.h"

#include <boost/asio/ip/address.hpp>
#include <boost/asio/post.hpp>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace collectived::engine::transport::tcp {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

// Unauthenticated connections in their handshake at once (each holds a socket
// and up to kHandshakeMaxFrame of buffer until deadlines.connect_ms).
constexpr std::size_t kMaxPendingHandshakes = 64;
constexpr std::uint64_t kHandshakeMaxFrame = 64 * 1024;
// Messages held for channels that have no handler yet.
constexpr std::uint64_t kMaxUnclaimedBytes = std::uint64_t{256} << 20;

std::string host_of(const std::string& endpoint) {
  return endpoint.substr(0, endpoint.rfind(':'));
}

const char* direction(bool outbound) { return outbound ? "outbound" : "inbound"; }

std::string hex(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

// An accepted stream until its handshake is done or failed.
class Device::Pending final : public StreamSink,
                                   public std::enable_shared_from_this<Pending> {
 public:
  Pending(Device& manager, std::shared_ptr<PeerStream> stream, const Secret& secret,
          PeerIdentity local)
      : manager_(manager),
        stream(std::move(stream)),
        handshake(secret, std::move(local), this->stream->local_text()),
        timer(manager.io_) {}

  void on_stream_message(PeerStream& s, peerwire::PeerMessage::Reader m) override {
    if (finished) return;
    auto frames = handshake.on_message(m);
    if (handshake.state() == Handshake::State::failed) {
      if (!frames.empty()) {
        s.close_after(std::move(frames.back()));
      } else {
        s.close();
      }
      finish(false);
      return;
    }
    // The acceptor's `ready` goes out before anything the link sends.
    for (auto& f : frames) s.send_frame(std::move(f));
    if (handshake.state() == Handshake::State::done) finish(true);
  }

  void on_stream_closed(PeerStream&, Code code, const std::string& why) override {
    if (finished) return;
    handshake.abort(code, "the connection closed during the handshake: " + why);
    finish(false);
  }

  void finish(bool ok) {
    finished = true;
    timer.cancel();
    auto self = shared_from_this();
    if (ok) {
      manager_.handshake_done(*this);
    } else {
      manager_.handshake_failed(*this);
    }
  }

 private:
  Device& manager_;

 public:
  std::shared_ptr<PeerStream> stream;
  Handshake handshake;
  asio::steady_timer timer;
  bool finished = false;
};

std::uint32_t effective_io_threads(std::uint32_t configured, unsigned cores) {
  // Bulk copy threads pay off where cores are spare; on a machine of 2-3
  // cores they only add hand-offs (a 1 MiB all-reduce on 4 daemons lost a
  // fifth with 4 threads). At most (cores - 2) / 2.
  return std::min<std::uint32_t>(configured, cores >= 4 ? (cores - 2) / 2 : 0);
}

std::uint32_t effective_streams(std::uint32_t configured, std::uint32_t io_threads) {
  if (configured != 0) return configured;
  // Several streams pay off where copy threads move them at once. Where the
  // event loop copies every byte, it reads one stream's chunk at a time while
  // the others' bytes wait in their socket buffers and leave the cache
  // before it reads them, so one stream is faster there
  // (docs/architecture.md, streams per peer).
  return io_threads > 0 ? kAutoStreams : 1;
}

PeerOptions peer_options(const config::Profile& profile, const std::string& daemon_version) {
  PeerOptions o;
  o.local.protocol_version = peerwire::PEER_PROTOCOL_VERSION;
  o.local.node = profile.node.name;
  o.local.daemon_version = daemon_version;
  o.bind_address = profile.peer.listen_address;
  o.port = profile.peer.port;
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(profile.peer.listen_address, ec);
  if (!ec && o.port != 0) {
    o.listen_any = address.is_unspecified();
    o.local.listen_address = endpoint_text(tcp::endpoint(address, o.port));
  }
  o.secret_file = profile.peer.secret_file;
  o.chunk_bytes = profile.tcp.chunk_bytes;
  o.io_threads = effective_io_threads(profile.tcp.io_threads, std::thread::hardware_concurrency());
  o.streams_per_peer = effective_streams(profile.tcp.streams_per_peer, o.io_threads);
  o.congestion_control = profile.tcp.congestion_control;
  o.connect_deadline = profile.deadlines.connect;
  o.heartbeat_interval = profile.deadlines.heartbeat;
  return o;
}

Device::Device(asio::io_context& io, PeerOptions options, engine::Logger& log)
    : io_(io), options_(std::move(options)), log_(log), acceptor_(io) {
  if (options_.io_threads > 0) {
    bulk_ = std::make_unique<BulkIo>(options_.io_threads);
    options_.bulk = bulk_.get();
  }
  if (!options_.congestion_control.empty()) {
    // Tried once on a socket of our own: a name the kernel does not have, or
    // one an unprivileged daemon may not use, is said here, and the streams
    // keep the system's default instead of failing one by one.
    tcp::socket probe(io_);
    boost::system::error_code ec;
    probe.open(tcp::v4(), ec);
    const std::string refused =
        ec ? ec.message()
           : set_congestion_control(probe.native_handle(), options_.congestion_control);
    if (!refused.empty()) {
      log_.warn("peer_congestion_control",
                {{"wanted", options_.congestion_control},
                 {"error", refused},
                 {"using", "the system's default"},
                 {"action", "load the module (modprobe tcp_" + options_.congestion_control +
                                ") and, for a daemon without CAP_NET_ADMIN, add it to sysctl "
                                "net.ipv4.tcp_allowed_congestion_control; or set "
                                "tcp.congestion_control to \"\" for the system's default"}});
      options_.congestion_control.clear();
    }
  }
  if (options_.local.protocol_version != peerwire::PEER_PROTOCOL_VERSION) {
    // A test hook (collectived --test-hook peer_version=N): tests meet a
    // version mismatch without building a second daemon.
    log_.warn("test_hook", {{"peer_version", options_.local.protocol_version},
                            {"real_version", peerwire::PEER_PROTOCOL_VERSION},
                            {"effect", "this daemon announces a fake peer protocol version; "
                                       "for tests only"}});
  }
}

Device::~Device() {
  stopping_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  for (auto& [p, pending] : pending_) pending->stream->close();
  for (auto& [key, rec] : records_) {
    for (auto& link : std::vector(rec.links)) link->close(Code::aborted, "daemon stopping", false);
  }
}

const Secret& Device::secret() {
  if (secret_) return *secret_;
  SecretFile file = load_secret(options_.secret_file);
  for (const auto& w : file.warnings) {
    log_.warn("peer_secret_insecure", {{"file", options_.secret_file}, {"warning", w}});
  }
  secret_.emplace(std::move(file.secret));
  return *secret_;
}

void Device::listen() {
  if (options_.port == 0) {
    log_.info("peer_listener_disabled",
              {{"reason", "peer.port is 0"},
               {"effect", "other nodes' daemons cannot connect to this one (it can still "
                          "connect to theirs); set peer.port, peer.listen_address and "
                          "peer.secret_file for a multi-node cluster"}});
    return;
  }
  secret();  // a node that accepts peers must be able to authenticate them
  boost::system::error_code ec;
  const auto address = asio::ip::make_address(options_.bind_address, ec);
  if (ec) {
    throw Error(Code::invalid_argument, "peer.listen_address \"" + options_.bind_address +
                                            "\" is not an IP address");
  }
  const tcp::endpoint endpoint(address, options_.port);
  const std::string where = endpoint_text(endpoint);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(asio::socket_base::reuse_address(true), ec);
  // Accepted streams inherit the listener's congestion control.
  if (!ec) (void)set_congestion_control(acceptor_.native_handle(), options_.congestion_control);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    std::string hint;
    if (ec == asio::error::address_in_use) {
      hint = "; another collectived or another program holds that port: stop it or choose "
             "another peer.port";
    } else if (ec == boost::system::errc::address_not_available) {
      hint = "; no interface of this host has that address: set peer.listen_address to one "
             "of its addresses (or 0.0.0.0)";
    } else if (ec == asio::error::access_denied) {
      hint = "; ports below 1024 need CAP_NET_BIND_SERVICE";
    }
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    throw Error(Code::unavailable, "cannot listen for peer daemons on " + where +
                                       " (peer.listen_address, peer.port): " + ec.message() +
                                       hint);
  }
  listening_ = true;
  log_.info("peer_listening", {{"address", where},
                               {"streams_per_peer", options_.streams_per_peer},
                               {"io_threads", options_.io_threads},
                               {"congestion_control", options_.congestion_control.empty()
                                                          ? std::string("system default")
                                                          : options_.congestion_control},
                               {"chunk_bytes", options_.chunk_bytes},
                               {"heartbeat_ms", options_.heartbeat_interval.count()},
                               {"connect_ms", options_.connect_deadline.count()},
                               {"secret_file", options_.secret_file},
                               {"protocol", options_.local.protocol_version}});
  accept_next();
}

void Device::accept_next() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    // Aborted first: a handler cancelled by the manager's destruction runs
    // after `this` is gone and must not touch it.
    if (ec == asio::error::operation_aborted || stopping_) return;
    if (ec) {
      log_.error("peer_accept_failed", {{"error", ec.message()}});
    } else {
      on_accept(std::move(socket));
    }
    accept_next();
  });
}

void Device::on_accept(tcp::socket socket) {
  boost::system::error_code ec;
  const auto remote = socket.remote_endpoint(ec);
  const std::string remote_text = ec ? std::string("?") : endpoint_text(remote);
  if (pending_.size() >= kMaxPendingHandshakes) {
    log_.warn("peer_refused", {{"remote", remote_text},
                               {"reason", "64 peer handshakes are already in progress"}});
    return;  // closing the socket refuses it
  }
  socket.set_option(tcp::no_delay(true), ec);  // the congestion control: from the listener
  auto stream = std::make_shared<PeerStream>(std::move(socket), kHandshakeMaxFrame);
  stream->set_bulk(options_.bulk);
  PeerIdentity me = options_.local;
  if (options_.listen_any) {
    me.listen_address = host_of(stream->local_text()) + ":" + std::to_string(options_.port);
  }
  auto pending = std::make_shared<Pending>(*this, stream, *secret_, std::move(me));
  pending_.emplace(pending.get(), pending);
  stream->set_sink(std::static_pointer_cast<StreamSink>(pending));
  std::weak_ptr<Pending> weak = pending;
  const auto deadline = options_.connect_deadline;
  pending->timer.expires_after(deadline);
  pending->timer.async_wait([weak, deadline](const boost::system::error_code& tec) {
    auto p = weak.lock();
    if (tec || !p || p->finished) return;
    p->handshake.abort(Code::timeout, "no complete handshake within " +
                                          std::to_string(deadline.count()) +
                                          " ms (deadlines.connect_ms)");
    p->stream->close();
    p->finish(false);
  });
  stream->start();
  log_.debug("peer_accepted", {{"remote", remote_text}});
}

void Device::handshake_failed(Pending& p) {
  pending_.erase(&p);  // Pending::finish holds it meanwhile
  if (stopping_) return;
  const Handshake& hs = p.handshake;
  if (hs.refused()) {
    log_.warn("peer_refused", {{"remote", p.stream->remote_text()},
                               {"node", hs.remote().node},
                               {"direction", "inbound"},
                               {"reason", hs.error()}});
  } else {
    log_.info("peer_handshake_failed",
              {{"remote", p.stream->remote_text()}, {"reason", hs.error()}});
  }
}

void Device::handshake_done(Pending& p) {
  pending_.erase(&p);  // Pending::finish holds it meanwhile
  if (stopping_) {
    p.stream->close();
    return;
  }
  const Handshake& hs = p.handshake;
  // A peer is known by its listen address; one without a listener (peer.port
  // 0) by its address and the connection's id, the same on all its streams.
  const std::string unnamed = host_of(p.stream->remote_text()) + "/" + hex(hs.connection_id());
  std::string key = unnamed;
  if (!hs.remote().listen_address.empty()) {
    try {
      key = parse_peer_address(hs.remote().listen_address).key;
    } catch (const Error&) {
    }
  }
  Record& rec = records_[key];
  rec.node = hs.remote().node;
  rec.ephemeral = key == unnamed;
  std::shared_ptr<Pair> link;
  for (const auto& l : rec.links) {
    if (!l->outbound() && l->state() == PeerState::connecting &&
        l->connection_id() == hs.connection_id()) {
      link = l;
    }
  }
  if (!link) {
    link = std::make_shared<Pair>(io_, options_, *secret_, owner(), key, false, rec.node);
    rec.links.push_back(link);
    ++rec.connections;
  }
  link->attach(p.stream, hs);
}

std::shared_ptr<Pair> Device::link_for(const std::string& key, bool& opened) {
  Record& rec = records_[key];
  opened = false;
  for (const auto& l : rec.links) {
    if (l->state() == PeerState::ready) return l;
  }
  for (const auto& l : rec.links) {
    if (l->state() == PeerState::connecting && l->outbound()) return l;
  }
  const Secret& s = secret();
  auto link = std::make_shared<Pair>(io_, options_, s, owner(), key, true, rec.node);
  rec.links.push_back(link);
  ++rec.connections;
  opened = true;
  log_.debug("peer_connecting", {{"peer", key}, {"node", rec.node}});
  link->connect();
  return link;
}

void Device::link_ready(Pair& link) {
  Record& rec = records_[link.key()];
  rec.node = link.node();
  log_.info("peer_connected", {{"peer", link.key()},
                               {"node", link.node()},
                               {"direction", direction(link.outbound())},
                               {"streams", link.streams()},
                               {"connection", hex(link.connection_id())},
                               {"peer_version", link.daemon_version()}});
}

void Device::link_dead(Pair& link, PeerState was, Code code, const std::string& why,
                            bool refused) {
  const auto it = records_.find(link.key());
  if (it != records_.end()) {
    Record& rec = it->second;
    std::erase_if(rec.links, [&](const auto& l) { return l.get() == &link; });
    rec.bytes_sent += link.bytes_sent();
    rec.bytes_received += link.bytes_received();
    if (link.have_rtt()) {
      rec.rtt_us = link.rtt_us();
      rec.skew_ms = link.skew_ms();
    }
    if (!link.node().empty()) rec.node = link.node();
    rec.outbound = link.outbound();
    if (!stopping_) {
      ++rec.errors;
      rec.last_error = why;
      // A daemon without a listener is known by its connection's source
      // port; once that connection is gone, so is the record.
      if (rec.ephemeral && rec.links.empty()) records_.erase(it);
    }
  }
  if (stopping_) return;
  const char* event = refused                       ? "peer_refused"
                      : was == PeerState::ready     ? "peer_dead"
                                                    : "peer_connect_failed";
  log_.warn(event, {{"peer", link.key()},
                    {"node", link.node()},
                    {"direction", direction(link.outbound())},
                    {"code", to_string(code)},
                    {"reason", why}});
  if (was == PeerState::ready && down_handler_) {
    DownHandler handler = down_handler_;
    handler(link.key(), link.node(), code, why);
  }
}

void Device::link_data(Pair& link, std::uint64_t channel, std::uint64_t seq,
                            engine::MessageBytes payload) {
  const auto h = handlers_.find(channel);
  if (h != handlers_.end()) {
    DataHandler handler = h->second;  // it may unregister itself
    handler(link.key(), channel, seq, std::move(payload));
    return;
  }
  if (unclaimed_bytes_ + payload.size() > kMaxUnclaimedBytes) {
    log_.error("peer_data_dropped",
               {{"peer", link.key()},
                {"node", link.node()},
                {"channel", channel},
                {"seq", seq},
                {"bytes", payload.size()},
                {"reason", "no handler for the channel, and 256 MiB of messages for channels "
                           "without handlers are already held"}});
    return;
  }
  unclaimed_bytes_ += payload.size();
  unclaimed_[channel].push_back({link.key(), seq, std::move(payload)});
}

engine::Placement Device::link_place(Pair& link, std::uint64_t channel,
                                          std::span<const std::byte> head, std::uint64_t bytes) {
  // Only where the data handler is there too: a message kept for a channel
  // without one (unclaimed_) must arrive whole.
  const auto p = placers_.find(channel);
  if (p == placers_.end() || handlers_.count(channel) == 0) return {};
  return p->second(link.key(), head, bytes);
}

void Device::on_place(std::uint64_t channel, PlaceHandler handler) {
  asio::post(io_, [this, channel, handler = std::move(handler)]() mutable {
    if (handler) {
      placers_[channel] = std::move(handler);
    } else {
      placers_.erase(channel);
    }
  });
}

void Device::on_data(std::uint64_t channel, DataHandler handler) {
  asio::post(io_, [this, channel, handler = std::move(handler)]() mutable {
    if (!handler) {
      handlers_.erase(channel);
      return;
    }
    handlers_[channel] = handler;
    const auto it = unclaimed_.find(channel);
    if (it == unclaimed_.end()) return;
    std::deque<Unclaimed> held = std::move(it->second);
    unclaimed_.erase(it);
    for (auto& u : held) {
      unclaimed_bytes_ -= u.payload.size();
      handler(u.peer, channel, u.seq, std::move(u.payload));
    }
  });
}

void Device::send(const std::string& peer, std::uint64_t channel,
                       std::vector<std::byte> payload, SendDone done) {
  engine::OutMessage message;
  message.head = std::move(payload);
  send(peer, channel, std::move(message), std::move(done));
}

void Device::send(const std::string& peer, std::uint64_t channel, engine::OutMessage message,
                       SendDone done) {
  auto shared = std::make_shared<const engine::OutMessage>(std::move(message));
  asio::post(io_, [this, peer, channel, shared, done = std::move(done)]() mutable {
    if (stopping_) {
      if (done) done({Code::aborted, "collectived on node " + options_.local.node + " is stopping"});
      return;
    }
    try {
      bool opened = false;
      auto link = link_for(parse_peer_address(peer).key, opened);
      link->send(channel, shared, std::move(done));
    } catch (const Error& e) {
      if (done) done({e.code(), e.what()});
    }
  });
}

void Device::ping(const std::string& peer, PingDone done) {
  asio::post(io_, [this, peer, done = std::move(done)]() mutable {
    PingReply failed;
    if (stopping_) {
      failed.result = {Code::aborted, "collectived on node " + options_.local.node + " is stopping"};
      done(failed);
      return;
    }
    try {
      bool opened = false;
      auto link = link_for(parse_peer_address(peer).key, opened);
      link->ping(PeerClock::now() + options_.connect_deadline,
                 [done = std::move(done), opened](const PingReply& reply) {
                   PingReply r = reply;
                   r.new_connection = opened;
                   done(r);
                 });
    } catch (const Error& e) {
      failed.result = {e.code(), e.what()};
      done(failed);
    }
  });
}

std::vector<PeerStatus> Device::status() const {
  std::vector<PeerStatus> out;
  out.reserve(records_.size());
  for (const auto& [key, rec] : records_) {
    PeerStatus st;
    st.address = key;
    st.node = rec.node;
    st.errors = rec.errors;
    st.connections = rec.connections;
    st.last_error = rec.last_error;
    st.bytes_sent = rec.bytes_sent;
    st.bytes_received = rec.bytes_received;
    st.rtt_us = rec.rtt_us;
    st.skew_ms = rec.skew_ms;
    st.outbound = rec.outbound;
    const Pair* in_use = nullptr;
    bool connecting = false;
    for (const auto& l : rec.links) {
      st.bytes_sent += l->bytes_sent();
      st.bytes_received += l->bytes_received();
      if (l->state() == PeerState::ready && in_use == nullptr) in_use = l.get();
      if (l->state() == PeerState::connecting) connecting = true;
    }
    if (in_use != nullptr) {
      st.state = PeerState::ready;
      st.outbound = in_use->outbound();
      st.streams = in_use->streams();
      st.congestion_control = in_use->congestion_control();
      st.connected_since = in_use->ready_since();
      if (in_use->have_rtt()) {
        st.rtt_us = in_use->rtt_us();
        st.skew_ms = in_use->skew_ms();
      }
      if (st.node.empty()) st.node = in_use->node();
    } else {
      st.state = connecting ? PeerState::connecting : PeerState::dead;
    }
    out.push_back(std::move(st));
  }
  return out;
}

void Device::set_deadlines(std::chrono::milliseconds connect,
                                std::chrono::milliseconds heartbeat) {
  options_.connect_deadline = connect;
  options_.heartbeat_interval = heartbeat;
}

void Device::shutdown(const std::string& why) {
  if (stopping_) return;
  stopping_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  auto pending = std::move(pending_);
  pending_.clear();
  for (auto& [p, entry] : pending) {
    entry->finished = true;
    entry->timer.cancel();
    entry->stream->close();
  }
  for (auto& [key, rec] : records_) {
    for (auto& link : std::vector(rec.links)) link->close(Code::aborted, why, true);
  }
}

void fill_peer_status(const Device& peers, wire::StatusReply::Builder status) {
  const auto list = peers.status();
  const auto now = std::chrono::system_clock::now();
  auto out = status.initPeers(static_cast<unsigned>(list.size()));
  for (unsigned i = 0; i < list.size(); ++i) {
    const PeerStatus& p = list[i];
    auto o = out[i];
    o.setAddress(p.address.c_str());
    o.setNode(p.node.c_str());
    o.setState(p.state == PeerState::ready        ? wire::PeerLinkState::READY
               : p.state == PeerState::connecting ? wire::PeerLinkState::CONNECTING
                                                  : wire::PeerLinkState::DEAD);
    o.setOutbound(p.outbound);
    o.setStreams(p.streams);
    o.setCongestionControl(p.congestion_control.c_str());
    o.setBytesSent(p.bytes_sent);
    o.setBytesReceived(p.bytes_received);
    o.setRttUs(p.rtt_us);
    o.setClockSkewMs(p.skew_ms);
    o.setErrors(p.errors);
    o.setConnections(p.connections);
    if (p.state == PeerState::ready) {
      o.setConnectedSinceUnixMs(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    p.connected_since.time_since_epoch())
                                    .count());
      const auto for_ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(now - p.connected_since).count();
      o.setConnectedMs(for_ms > 0 ? static_cast<std::uint64_t>(for_ms) : 0);
    }
    o.setLastError(p.last_error.c_str());
  }
  status.setPeerAddress(peers.address().c_str());
}

}  // namespace collectived::engine::transport::tcp
