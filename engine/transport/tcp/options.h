// The peer layer's settings (from the profile) and the small types its parts
// share: results, ping replies, peer addresses, socket options.
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "engine/transport/tcp/bulk_io.h"
#include "engine/transport/tcp/peer_auth.h"
#include "ipc/error.h"

namespace collectived::engine::transport::tcp {

using PeerClock = std::chrono::steady_clock;

/// Settings of the peer layer (from the profile; deadlines may change on SIGHUP).
struct PeerOptions {
  PeerIdentity local;          ///< node name, announced listen address, versions
  std::string bind_address;    ///< peer.listen_address
  std::uint16_t port = 0;      ///< peer.port; 0 = no listener
  /// The listener binds every address (0.0.0.0, ::): each connection then
  /// announces the address it leaves from, with `port`.
  bool listen_any = false;
  std::string secret_file;     ///< peer.secret_file
  std::uint32_t streams_per_peer = 4;  ///< effective (effective_streams)
  std::uint64_t chunk_bytes = 1 << 20;
  /// tcp.io_threads: threads per direction that copy large chunks to and
  /// from the sockets (0: the event loop does it).
  std::uint32_t io_threads = 0;
  /// tcp.congestion_control: set on every stream; empty = the system's.
  std::string congestion_control;
  /// The threads (the Device owns them; set when io_threads > 0).
  BulkIo* bulk = nullptr;
  std::chrono::milliseconds connect_deadline{5000};
  std::chrono::milliseconds heartbeat_interval{1000};
};

/// Sets the congestion control `congestion` (empty: the system's) on a
/// socket that is not connected yet: an outgoing one before connect, the
/// listener before listen (accepted sockets inherit it). Set later, it would
/// come after the system default's initialization, and bbr's pacing on timers
/// outlives the switch (a 64 MiB all-gather took twice as long;
/// docs/architecture.md). Returns why it was refused, or "".
std::string set_congestion_control(int fd, const std::string& congestion);
/// The congestion control of a socket ("" if it cannot be read).
std::string congestion_control_of(int fd);

enum class PeerState { connecting, ready, dead };
std::string_view to_string(PeerState state);

/// Outcome of a send or a ping: ok, or a code and a message naming the peer.
struct PeerResult {
  Code code = Code::ok;
  std::string message;
  bool ok() const { return code == Code::ok; }
};

using SendDone = std::function<void(const PeerResult&)>;

struct PingReply {
  PeerResult result;
  std::string node;             ///< the peer's node name
  std::uint64_t rtt_us = 0;     ///< round trip of one heartbeat
  double skew_ms = 0;           ///< the peer's wall clock minus ours (positive: it is ahead)
  bool new_connection = false;  ///< the ping opened the connection
};
using PingDone = std::function<void(const PingReply&)>;

/// "ip:port", IPv6 bracketed, IPv4-mapped IPv6 shown as IPv4.
std::string endpoint_text(const boost::asio::ip::tcp::endpoint& endpoint);

/// A peer daemon's address. `key` is its canonical text ("10.0.0.2:47600",
/// "[fd00::2]:47600", "node7:47600"): the name a peer is known by.
struct PeerAddress {
  std::string host;
  std::uint16_t port = 0;
  std::string key;
};
/// Parses "host:port" or "[v6]:port". Throws Error(invalid_argument) saying why.
PeerAddress parse_peer_address(const std::string& text);

}  // namespace collectived::engine::transport::tcp
