// One connected client: its socket, its framing state, its requests.
#pragma once

#include <sys/socket.h>

#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "config/profile.h"
#include "daemon/direct_broker.h"
#include "engine/engine.h"
#include "engine/gpu/executor.h"
#include "engine/host_mapping.h"
#include "engine/log.h"
#include "engine/registry.h"
#include "ipc/frame.h"
#include "ipc/ring.h"

namespace collectived::engine::transport::tcp {
class Device;
}
namespace collectived::engine::transport::verbs {}

namespace collectived::daemon {

// The transports (engine/transport/), by the short names the daemon wires them with.
namespace tcp = engine::transport::tcp;
namespace verbs = engine::transport::verbs;
namespace transport = engine::transport;

/// What a session needs from the daemon that owns it.
class RingPoller;

class SessionHost {
 public:
  virtual ~SessionHost() = default;
  virtual const config::Profile& profile() const = 0;
  virtual engine::Logger& logger() = 0;
  virtual engine::Registry& registry() = 0;
  virtual engine::Engine& engine() = 0;
  virtual RingPoller& ring_poller() = 0;
  /// "host:port" this daemon hosts rendezvous on.
  virtual std::string rendezvous_address() const = 0;
  virtual void fill_status(wire::StatusReply::Builder status) = 0;
  virtual void session_closed(std::uint64_t session_id) = 0;
  /// Connections to other nodes' daemons (engine/transport/tcp/device.h).
  virtual tcp::Device& peers() = 0;
  /// GPU memory and stream-ordered collectives (engine/gpu/executor.h).
  virtual engine::gpu::GpuExecutor& gpu() = 0;
  /// The clients' exchange for their own GPU kernels (direct_broker.h).
  virtual DirectBroker& direct_broker() = 0;
};

/// Identity of a client from SO_PEERCRED, fixed at accept().
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

/// A client session. Lives on the event-loop thread; owned by the server's
/// session table and by its own pending asynchronous operations.
class ClientSession : public std::enable_shared_from_this<ClientSession> {
 public:
  using Socket = boost::asio::local::stream_protocol::socket;

  ClientSession(SessionHost& host, Socket socket, std::uint64_t id, PeerCredentials cred);
  ClientSession(const ClientSession&) = delete;
  ClientSession& operator=(const ClientSession&) = delete;

  void start();
  /// Sends an error naming `why` to the client (request id 0: about the session),
  /// then closes once it is written or the deadline passes.
  void fail_and_close(Code code, const std::string& why);
  /// Closes at once; idempotent.
  void close(std::string_view reason);

  std::uint64_t id() const { return id_; }
  const PeerCredentials& credentials() const { return cred_; }
  const std::string& name() const { return name_; }
  std::chrono::steady_clock::time_point connected_at() const { return connected_at_; }
  bool closed() const { return closed_; }

  /// Ring poller thread: runs the submissions waiting in this client's ring.
  /// True if there were any.
  bool poll_ring();
  /// Ring poller thread: announces (or withdraws) that the poller sleeps.
  /// True if submissions are already waiting (then it must not sleep).
  bool ring_sleep(bool sleeping);

  /// Sends the engine's answer to request `id`. Any thread.
  void deliver(std::uint64_t id, engine::Result result);

 private:
  void wait_readable();
  void on_readable();
  void dispatch(ipc::IncomingFrame& frame);
  void handle_hello(std::uint64_t id, wire::Hello::Reader hello);
  void handle_register_host(std::uint64_t id, wire::RegisterHost::Reader req,
                            std::vector<UniqueFd>& fds);
  void handle_deregister(std::uint64_t id, wire::Deregister::Reader req);
  void handle_status(std::uint64_t id);
  void handle_attach_ring(std::uint64_t id, wire::AttachRing::Reader req,
                          std::vector<UniqueFd>& fds);
  /// Runs a hot-path request (collective, p2p, split, destroy, abort); any thread.
  void dispatch_hot(std::uint64_t id, wire::Message::Reader m, bool from_worker);
  /// Replies through the ring when the request came through it, else the socket.
  void send_reply(std::uint64_t id, std::vector<std::byte> frame);
  /// Wakes the client if it sleeps on its completion ring waiting for `id`
  /// (0: whatever it waits for).
  void wake_client(std::uint64_t id);
  bool flush_ring_overflow();
  void handle_collective(std::uint64_t id, wire::Collective::Reader req, bool from_worker);
  void handle_p2p(std::uint64_t id, wire::P2PGroup::Reader req, bool from_worker);
  /// PeerPing: answered asynchronously (daemon/session_peer.cc).
  void handle_peer_ping(std::uint64_t id, wire::PeerPing::Reader req);
  /// GPU registration and flag page (daemon/session_gpu.cc).
  void handle_register_gpu(std::uint64_t id, wire::RegisterGpu::Reader req,
                           std::vector<UniqueFd>& fds);
  void handle_attach_gpu(std::uint64_t id, wire::AttachGpu::Reader req, std::vector<UniqueFd>& fds);
  void handle_direct_join(std::uint64_t id, wire::DirectJoin::Reader req);
  /// Tells the broker of a collective on host memory, until its first round is answered.
  void note_host_collective(std::uint64_t comm);
  std::shared_ptr<engine::gpu::RankSync> gpu_sync(wire::GpuSync::Reader req);
  /// An all-reduce, broadcast or reduce across nodes larger than the profile's
  /// gpu.stage_chunk_bytes, on host or GPU buffers alike (every rank cuts it
  /// the same way): submitted as consecutive chunk operations, answered once
  /// (session_gpu.cc). False when it is not cut (the caller submits it whole).
  bool submit_chunked(std::uint64_t id, wire::Collective::Reader req, bool from_worker);
  /// The reference the chunks of one chunked operation are submitted with:
  /// their answers reach the client as one (logs `event`).
  engine::ClientRef chunked_ref(const char* event, std::uint64_t comm, std::uint64_t count,
                                std::size_t chunks, bool from_worker);
  /// `from_worker`: the request is handled on a daemon worker thread (the
  /// ring poller), which may run small operations itself.
  engine::ClientRef client_ref(bool from_worker = false);
  void reply_error(std::uint64_t id, Code code, const std::string& message);
  /// Queues or writes a frame. Any thread.
  void send(std::vector<std::byte> frame);
  void write_next();
  void update_frame_timer();
  std::string who() const;

  SessionHost& host_;
  Socket socket_;
  const std::uint64_t id_;
  const PeerCredentials cred_;
  const std::chrono::steady_clock::time_point connected_at_;
  std::string name_;
  ipc::FrameDecoder decoder_;
  std::mutex write_mutex_;  // guards outbox_, writing_, closed_ and the descriptor's life
  std::deque<std::vector<std::byte>> outbox_;
  bool writing_ = false;
  bool hello_done_ = false;
  std::mutex direct_decided_mu_;
  std::set<std::uint64_t> direct_decided_;  // communicators whose first broker round was answered
  std::atomic<bool> close_after_flush_ = false;
  std::atomic<bool> closed_ = false;
  bool frame_timer_armed_ = false;
  boost::asio::steady_timer frame_timer_;
  boost::asio::steady_timer close_timer_;
  std::shared_ptr<engine::CompletionSink> sink_;

  // Shared-memory fast path (ipc/ring.h), set once by AttachRing.
  engine::HostMapping ring_mapping_;
  ipc::RingView ring_;
  UniqueFd ring_doorbell_;
  std::atomic<bool> ring_attached_ = false;
  std::atomic<bool> ring_broken_ = false;
  std::mutex cq_mutex_;  // completions come from several daemon threads
  std::deque<std::vector<std::byte>> cq_overflow_;  // completions waiting for ring room
  std::vector<std::byte> ring_frame_;  // poller thread's scratch
};

}  // namespace collectived::daemon
