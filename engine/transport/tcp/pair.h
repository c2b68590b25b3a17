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

namespace collectived::tcp {

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

class PeerStream;

/// Receives what a stream reads. Held weakly by the stream.
class StreamSink {
 public:
  virtual void on_stream_message(PeerStream& stream, peerwire::PeerMessage::Reader message) = 0;
  virtual void on_stream_closed(PeerStream& stream, Code code, const std::string& why) = 0;
  virtual ~StreamSink() = default;
};

/// One TCP stream of a peer connection: framing (ipc/frame.h), a write queue
/// where control frames (handshake, heartbeats) overtake data chunks, and a
/// read loop that hands each message to the sink.
class PeerStream : public std::enable_shared_from_this<PeerStream> {
 public:
  /// A piece of an outgoing message: its frame is encoded when it is
  /// written, its bytes go out in place after the frame.
  struct Chunk {
    std::shared_ptr<const engine::OutMessage> message;
    std::uint64_t channel = 0;
    std::uint64_t seq = 0;
    std::uint64_t offset = 0;
    std::uint64_t length = 0;
    std::function<void()> written;  ///< called once the chunk is in the socket
    /// Part of a stream of data: may be written on a bulk thread.
    bool offload = false;
    /// The message's head travels in the frame (DataChunk.head); offset and
    /// length count its payload only.
    bool head_in_frame = false;
  };

  PeerStream(boost::asio::ip::tcp::socket socket, std::uint64_t max_frame_bytes);
  PeerStream(const PeerStream&) = delete;
  PeerStream& operator=(const PeerStream&) = delete;

  void set_sink(std::weak_ptr<StreamSink> sink) { sink_ = std::move(sink); }
  /// Large raw reads and data writes go to `bulk`'s threads (null: the event
  /// loop does them). Set before start().
  void set_bulk(BulkIo* bulk) { bulk_ = bulk; }
  /// Starts reading.
  void start();
  /// Replaces the frame-size limit; only between frames (false otherwise).
  bool set_max_frame(std::uint64_t max_frame_bytes);

  void send_frame(std::vector<std::byte> frame);
  void send_chunk(Chunk chunk);
  /// From inside StreamSink::on_stream_message for a data frame: the next
  /// `bytes` bytes of the stream are raw chunk bytes, to be read into `dest`
  /// (which `owner` keeps alive); `done` runs once they are there.
  /// `offload`: part of a stream of data, may be read on a bulk thread.
  void expect_raw(std::byte* dest, std::uint64_t bytes, std::shared_ptr<void> owner,
                  std::function<void()> done, bool offload = false);
  /// Drops queued data, writes `last` (a PeerError), then closes (at the
  /// latest after one second).
  void close_after(std::vector<std::byte> last);
  /// Closes now; the sink hears nothing more.
  void close();
  bool closed() const { return closed_; }

  std::uint32_t index = 0;  ///< position in its link
  const std::string& remote_text() const { return remote_text_; }
  const std::string& local_text() const { return local_text_; }
  std::uint64_t bytes_sent() const { return bytes_sent_; }
  std::uint64_t bytes_received() const { return bytes_received_; }
  PeerClock::time_point last_received() const { return last_received_; }
  /// When the other side last answered a heartbeat sent on this stream.
  PeerClock::time_point last_answer() const { return last_answer_; }
  void answered() { last_answer_ = PeerClock::now(); }
  std::size_t queued_chunks() const { return data_.size(); }
  /// The stream's TCP congestion control, as the kernel reports it.
  std::string congestion_control() { return congestion_control_of(socket_.native_handle()); }

 private:
  void read_next();
  void on_read(const boost::system::error_code& ec, std::size_t n);
  /// The end of any read: false (after failing the stream on an error) when
  /// the caller stops; else the bytes are counted.
  bool read_done(const boost::system::error_code& ec, std::size_t n);
  /// Hands out what the decoder holds (frames, raw bytes); reads on.
  void drain();
  void finish_raw();
  void write_next();
  /// The end of a chunk write, on the event loop (either path).
  void on_written(const boost::system::error_code& ec, std::size_t n);
  /// The end of a raw read, on the event loop (either path).
  void on_raw_read(const boost::system::error_code& ec, std::size_t n);
  /// A bulk transfer ended: closes the socket if close() waited for it.
  void bulk_finished();
  void fail(Code code, const std::string& why, bool tell_peer);

  boost::asio::ip::tcp::socket socket_;
  ipc::FrameDecoder decoder_;
  std::weak_ptr<StreamSink> sink_;
  std::string remote_text_;
  std::string local_text_;
  std::deque<std::vector<std::byte>> control_;
  std::deque<Chunk> data_;
  // What the write in progress points into.
  std::vector<std::byte> current_frame_;
  std::shared_ptr<const engine::OutMessage> current_message_;
  std::function<void()> current_written_;
  bool current_offload_ = false;
  // Raw chunk bytes being read (expect_raw).
  struct Raw {
    std::byte* dest = nullptr;
    std::uint64_t remaining = 0;
    std::shared_ptr<void> owner;
    std::function<void()> done;
    bool offload = false;
  };
  Raw raw_;
  BulkIo* bulk_ = nullptr;
  /// Transfers on bulk_'s threads (at most a read and a write): the socket
  /// stays open until they end, so that they never touch a reused descriptor.
  int bulk_busy_ = 0;
  bool writing_ = false;
  bool closing_ = false;
  bool closed_ = false;
  boost::asio::steady_timer close_timer_;
  std::uint64_t bytes_sent_ = 0;
  std::uint64_t bytes_received_ = 0;
  PeerClock::time_point last_received_;
  PeerClock::time_point last_answer_;
};

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

}  // namespace collectived::tcp
