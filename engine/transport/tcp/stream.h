// One authenticated TCP stream of a peer connection (tcp/pair.h): framing,
// a write queue where control frames overtake data chunks, a read loop.
// Everything here runs on the daemon's event-loop thread (bulk copies aside).
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

namespace collectived::engine::transport::tcp {

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

}  // namespace collectived::engine::transport::tcp
