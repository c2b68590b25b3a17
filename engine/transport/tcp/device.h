// The peer-daemon connection manager: listens for other nodes' daemons, opens
// connections to them on first need, keeps and shares them, re-opens them
// after a failure, and moves opaque messages between daemons.
//
//   Device peers(io, options, log);
//   peers.listen();                                   // if peer.port != 0
//   peers.on_data(channel, [](const std::string& peer, std::uint64_t channel,
//                             std::uint64_t seq, engine::MessageBytes payload) {...});
//   peers.send("10.0.0.7:47600", channel, std::move(bytes), [](const PeerResult& r) {...});
//   peers.ping("10.0.0.7:47600", [](const PingReply& r) {...});
//   peers.on_peer_down([](const std::string& peer, const std::string& node, Code,
//                         const std::string& why) {...});   // fail what waited on it
//
// A peer is named by its listen address "host:port". There is at most one
// connection this daemon opened to each peer; a connection the peer opened
// to this daemon is used as well (whichever is ready first serves sends).
// Messages of one channel from one peer arrive whole and in the order they
// were sent on one connection.
//
// Threads: send(), on_data() and ping() may be called from any thread (they
// post to the event loop); everything else runs on the event-loop thread,
// and so do all callbacks and handlers. Destroy it only once its io_context
// no longer runs (the Server's member order does that): handlers still queued
// there refer to it.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/profile.h"
#include "engine/transport/tcp/peer_auth.h"
#include "engine/transport/tcp/pair.h"
#include "engine/log.h"
#include "ipc/protocol.capnp.h"

namespace collectived::engine::transport::tcp {

/// One peer as status shows it.
struct PeerStatus {
  std::string address;     ///< "host:port"
  std::string node;        ///< node name, once known
  PeerState state = PeerState::dead;
  bool outbound = false;   ///< this daemon opened the connection in use
  std::uint32_t streams = 0;
  std::string congestion_control;    ///< of the connection in use, as the kernel says
  std::uint64_t bytes_sent = 0;      ///< all connections to the peer since start
  std::uint64_t bytes_received = 0;
  std::uint64_t rtt_us = 0;          ///< last heartbeat round trip (0: none yet)
  double skew_ms = 0;                ///< its wall clock minus ours
  std::uint64_t errors = 0;          ///< connections that failed or were refused
  std::uint32_t connections = 0;     ///< connections opened (either way) since start
  std::chrono::system_clock::time_point connected_since{};  ///< epoch when not ready
  std::string last_error;
};

class Device final : private Pair::Owner {
 public:
  using DataHandler = std::function<void(const std::string& peer, std::uint64_t channel,
                                         std::uint64_t seq, engine::MessageBytes payload)>;
  /// A ready connection to `peer` (node `node`) ended: its sends failed, and
  /// nothing more will arrive on it. `why` names the node and the reason.
  using DownHandler = std::function<void(const std::string& peer, const std::string& node,
                                         Code code, const std::string& why)>;

  Device(boost::asio::io_context& io, PeerOptions options, engine::Logger& log);
  ~Device() override;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  /// Loads the secret and binds the listener when peer.port is not 0; throws
  /// Error naming the address, the profile keys and the reason otherwise.
  void listen();
  bool listening() const { return listening_; }
  /// "host:port" other daemons reach this one at ("" without a listener).
  const std::string& address() const { return options_.local.listen_address; }

  /// Sends `payload` to `peer` on `channel`, opening the connection if needed.
  /// `done` runs on the event loop once the whole payload is written to the
  /// peer's sockets (not yet read by it), or with an error naming the peer.
  void send(const std::string& peer, std::uint64_t channel, std::vector<std::byte> payload,
            SendDone done);
  /// The same for a message whose payload pieces are written in place: they
  /// must stay valid and unchanged until `done` runs (`message.keep` may own
  /// them).
  void send(const std::string& peer, std::uint64_t channel, engine::OutMessage message,
            SendDone done);
  /// Routes messages of `channel` to `handler` (an empty one unregisters).
  /// Messages that arrive before a handler is registered are kept (up to
  /// 256 MiB in all) and handed to it when it is.
  void on_data(std::uint64_t channel, DataHandler handler);
  /// Where the payload of a large message of `channel` goes, asked when its
  /// head arrives ahead of the payload (engine::Placement; the message is
  /// then handed to the data handler as its head alone). Event-loop thread.
  using PlaceHandler = std::function<engine::Placement(
      const std::string& peer, std::span<const std::byte> head, std::uint64_t bytes)>;
  /// Sets (an empty one removes) `channel`'s placement handler.
  void on_place(std::uint64_t channel, PlaceHandler handler);
  /// Tells `handler` (one; an empty one removes it) whenever a ready
  /// connection ends, except at shutdown. Event-loop thread.
  void on_peer_down(DownHandler handler) { down_handler_ = std::move(handler); }
  /// One heartbeat round trip to `peer`, opening the connection if needed;
  /// answered within deadlines.connect_ms.
  void ping(const std::string& peer, PingDone done);

  /// Every peer known since start, by address.
  std::vector<PeerStatus> status() const;

  /// Live profile changes (SIGHUP).
  void set_deadlines(std::chrono::milliseconds connect, std::chrono::milliseconds heartbeat);
  /// Stops listening and closes every connection, telling the peers `why`.
  void shutdown(const std::string& why);

 private:
  class Pending;
  struct Record {
    std::string node;
    std::vector<std::shared_ptr<Pair>> links;  // connecting or ready
    std::uint64_t bytes_sent = 0;                  // of closed links
    std::uint64_t bytes_received = 0;
    std::uint64_t errors = 0;
    std::uint32_t connections = 0;
    std::uint64_t rtt_us = 0;
    double skew_ms = 0;
    bool outbound = false;
    bool ephemeral = false;  // keyed by a connection's source, not a listen address
    std::string last_error;
  };
  struct Unclaimed {
    std::string peer;
    std::uint64_t seq;
    engine::MessageBytes payload;
  };

  // Pair::Owner
  void link_ready(Pair& link) override;
  void link_dead(Pair& link, PeerState was, Code code, const std::string& why,
                 bool refused) override;
  void link_data(Pair& link, std::uint64_t channel, std::uint64_t seq,
                 engine::MessageBytes payload) override;
  engine::Placement link_place(Pair& link, std::uint64_t channel,
                               std::span<const std::byte> head, std::uint64_t bytes) override;

  Pair::Owner& owner() { return *this; }
  void accept_next();
  void on_accept(boost::asio::ip::tcp::socket socket);
  void handshake_done(Pending& pending);
  void handshake_failed(Pending& pending);
  /// The secret, loaded on first need. Throws Error saying why it cannot be had.
  const Secret& secret();
  /// The link that serves `key`; opens one if none is ready or connecting.
  std::shared_ptr<Pair> link_for(const std::string& key, bool& opened);

  boost::asio::io_context& io_;
  PeerOptions options_;
  engine::Logger& log_;
  /// Copies of large chunks off the event loop (tcp.io_threads > 0). Its
  /// threads are joined after every link was closed (~Device).
  std::unique_ptr<BulkIo> bulk_;
  boost::asio::ip::tcp::acceptor acceptor_;
  std::optional<Secret> secret_;
  bool listening_ = false;
  bool stopping_ = false;
  std::map<std::string, Record> records_;
  std::map<Pending*, std::shared_ptr<Pending>> pending_;
  std::map<std::uint64_t, DataHandler> handlers_;
  std::map<std::uint64_t, PlaceHandler> placers_;
  std::map<std::uint64_t, std::deque<Unclaimed>> unclaimed_;
  std::uint64_t unclaimed_bytes_ = 0;
  DownHandler down_handler_;
};

/// The options the profile gives. (Tests of the version check set
/// `local.protocol_version` to announce another version: collectived
/// --test-hook peer_version=N.)
PeerOptions peer_options(const config::Profile& profile, const std::string& daemon_version);

/// tcp.io_threads as it runs on a machine of `cores` cores: at most
/// (cores - 2) / 2, none below 4 cores.
std::uint32_t effective_io_threads(std::uint32_t configured, unsigned cores);
/// tcp.streams_per_peer as it runs: the configured count, or for 0 (auto)
/// kAutoStreams where copy threads run (`io_threads` > 0, effective) and one
/// stream where the event loop copies every byte.
std::uint32_t effective_streams(std::uint32_t configured, std::uint32_t io_threads);
inline constexpr std::uint32_t kAutoStreams = 4;

/// Fills StatusReply.peers.
void fill_peer_status(const Device& peers, wire::StatusReply::Builder status);

}  // namespace collectived::engine::transport::tcp
