// One connection to another node's daemon: several authenticated TCP streams
// with heartbeats, chunked data and pings. Owned by the Device
// (engine/transport/tcp/device.h), which decides when links are opened and shared.
// Everything here runs on the daemon's event-loop thread.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <array>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/transport/tcp/bulk_io.h"
#include "engine/transport/tcp/peer_auth.h"
#include "engine/transport/transport.h"
#include "ipc/error.h"
#include "ipc/frame.h"

#include "engine/transport/tcp/options.h"
#include "engine/transport/tcp/stream.h"

namespace collectived::engine::transport::tcp {

/// A connection to one peer daemon: `streams` authenticated TCP streams.
class Pair : public std::enable_shared_from_this<Pair>, public StreamSink {
 public:
  /// The manager: hears about state changes and whole received messages.
  class Owner {
   public:
    virtual void link_ready(Pair& link) = 0;
    /// `was` is the state before; `refused`: authentication or version refusal.
    virtual void link_dead(Pair& link, PeerState was, Code code, const std::string& why,
                           bool refused) = 0;
    virtual void link_data(Pair& link, std::uint64_t channel, std::uint64_t seq,
                           engine::MessageBytes payload) = 0;
    /// A message whose head came ahead of its `bytes` of payload (a large
    /// one): where those bytes go, if the channel's receiver has a place for
    /// them. The message is then delivered (link_data) as its head alone.
    virtual engine::Placement link_place(Pair& link, std::uint64_t channel,
                                         std::span<const std::byte> head, std::uint64_t bytes) {
      (void)link, (void)channel, (void)head, (void)bytes;
      return {};
    }
    virtual ~Owner() = default;
  };

  /// `key` is the peer's "host:port"; `known_node` its node name if known.
  Pair(boost::asio::io_context& io, const PeerOptions& options, const Secret& secret,
           Owner& owner, std::string key, bool outbound, std::string known_node);
  ~Pair() override;

  /// Outbound: resolves the key, opens the streams and runs their handshakes,
  /// all within deadlines.connect_ms.
  void connect();
  /// Inbound: the first authenticated stream fixes the connection id and the
  /// stream count; the link is ready once all streams arrived (within
  /// deadlines.connect_ms of the first).
  void attach(std::shared_ptr<PeerStream> stream, const Handshake& handshake);

  /// Sends `message` on `channel`, chunked across the streams; its bytes are
  /// written in place. `done` runs once every chunk is written to a socket,
  /// or with the error that ended the link. Queued while connecting.
  void send(std::uint64_t channel, std::shared_ptr<const engine::OutMessage> message,
            SendDone done);
  /// A heartbeat round trip; `done` runs with its RTT, or an error at `deadline`.
  void ping(PeerClock::time_point deadline, PingDone done);
  /// Ends the link: every stream is closed (after a PeerError naming `why`
  /// when `tell_peer`), waiting sends and pings fail with `code`/`why`.
  void close(Code code, const std::string& why, bool tell_peer);

  // StreamSink
  void on_stream_message(PeerStream& stream, peerwire::PeerMessage::Reader message) override;
  void on_stream_closed(PeerStream& stream, Code code, const std::string& why) override;

  const std::string& key() const { return key_; }
  bool outbound() const { return outbound_; }
  PeerState state() const { return state_; }
  /// The peer's node name (empty until known), and "node NAME (KEY)" for messages.
  const std::string& node() const { return node_; }
  std::string describe() const;
  std::uint64_t connection_id() const { return connection_id_; }
  std::uint32_t streams() const { return static_cast<std::uint32_t>(streams_.size()); }
  /// The congestion control of its streams, read back from the kernel.
  std::string congestion_control() const {
    for (const auto& s : streams_) {
      if (s && !s->closed()) return s->congestion_control();
    }
    return {};
  }
  std::uint64_t bytes_sent() const;
  std::uint64_t bytes_received() const;
  bool have_rtt() const { return have_rtt_; }
  std::uint64_t rtt_us() const { return rtt_us_; }
  double skew_ms() const { return skew_ms_; }
  std::chrono::system_clock::time_point ready_since() const { return ready_wall_; }
  const std::string& daemon_version() const { return remote_.daemon_version; }

 private:
  void open_stream(std::uint32_t index, const boost::asio::ip::tcp::endpoint& endpoint);
  void start_stream(std::uint32_t index, boost::asio::ip::tcp::socket socket);
  void on_handshake_message(PeerStream& stream, Handshake& handshake,
                            peerwire::PeerMessage::Reader message);
  std::uint64_t max_frame() const;
  void become_ready();
  void fail(Code code, const std::string& why, bool refused, bool tell_peer);
  /// Fails the link with timeout and why(*this) unless it is ready within
  /// deadlines.connect_ms.
  void arm_connect_deadline(std::string (*why)(const Pair&));
  void arm_heartbeat();
  void heartbeat_tick();
  std::vector<std::byte> heartbeat_frame(std::uint64_t seq) const;
  void send_ping(std::uint64_t seq);
  void start_send(std::uint64_t channel, std::shared_ptr<const engine::OutMessage> message,
                  SendDone done);
  void on_heartbeat(PeerStream& stream, peerwire::Heartbeat::Reader hb);
  void on_heartbeat_ack(PeerStream& stream, peerwire::HeartbeatAck::Reader ack);
  void on_data(PeerStream& stream, peerwire::DataChunk::Reader chunk);
  void on_raw_done(std::pair<std::uint64_t, std::uint64_t> key, std::uint64_t bytes);
  void complete(std::pair<std::uint64_t, std::uint64_t> key, engine::MessageBytes bytes);
  void deliver_in_order(std::uint64_t channel);

  boost::asio::io_context& io_;
  const PeerOptions& options_;
  const Secret& secret_;
  Owner& owner_;
  const std::string key_;
  const bool outbound_;
  std::string node_;
  PeerIdentity remote_;
  PeerState state_ = PeerState::connecting;
  std::uint64_t connection_id_ = 0;
  std::uint32_t streams_wanted_ = 0;
  std::vector<std::shared_ptr<PeerStream>> streams_;
  std::vector<std::unique_ptr<Handshake>> handshakes_;  // outbound, by stream index
  std::uint32_t streams_ready_ = 0;
  boost::asio::ip::tcp::resolver resolver_;
  boost::asio::ip::tcp::endpoint endpoint_;  // outbound: where stream 0 connected
  boost::asio::steady_timer connect_timer_;
  boost::asio::steady_timer heartbeat_timer_;
  std::chrono::system_clock::time_point ready_wall_{};
  Code dead_code_ = Code::ok;
  std::string dead_reason_;

  // Sending.
  struct Queued {
    std::uint64_t channel;
    std::shared_ptr<const engine::OutMessage> message;
    SendDone done;
  };
  std::deque<Queued> queued_;  // until ready
  struct InFlight {
    std::size_t chunks_left;
    SendDone done;
  };
  std::map<std::uint64_t, InFlight> in_flight_;
  std::uint64_t next_send_id_ = 1;
  std::map<std::uint64_t, std::uint64_t> send_seq_;  // channel -> next seq
  std::uint32_t next_stream_ = 0;

  // Receiving.
  struct Partial {
    // Shared with the streams reading into it: the reassembly buffer and,
    // when placed, the receiver's hold on the destination.
    struct Buffers {
      engine::MessageBytes bytes;  // the whole message, or its head when placed
      engine::Placement place;
    };
    std::shared_ptr<Buffers> buf;
    std::uint64_t total = 0;                        // raw bytes of the message
    std::uint64_t head = 0;                         // head bytes from the frames (protocol 3)
    std::map<std::uint64_t, std::uint64_t> chunks;  // offset -> end, announced so far
    std::uint64_t received = 0;                     // bytes read in
  };
  std::map<std::pair<std::uint64_t, std::uint64_t>, Partial> partial_;  // (channel, seq)
  std::map<std::pair<std::uint64_t, std::uint64_t>, engine::MessageBytes> early_;
  std::uint64_t held_bytes_ = 0;  // in partial_ and early_
  std::map<std::uint64_t, std::uint64_t> recv_next_;  // channel -> next seq to deliver

  // Heartbeats and pings.
  std::uint64_t next_heartbeat_seq_ = 1;
  struct PingWait {
    PingDone done;
    std::unique_ptr<boost::asio::steady_timer> timer;
    bool sent = false;
  };
  std::map<std::uint64_t, PingWait> pings_;  // by heartbeat seq
  bool have_rtt_ = false;
  std::uint64_t rtt_us_ = 0;
  double skew_ms_ = 0;
};

}  // namespace collectived::engine::transport::tcp
