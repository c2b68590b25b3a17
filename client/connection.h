// Private: the client side of one control connection to the daemon.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>

#include "ipc/error.h"
#include "ipc/fd.h"
#include "ipc/frame.h"
#include "ipc/ring.h"

namespace collectived::client {

using Clock = std::chrono::steady_clock;

/// A connected, handshaken session. Thread-safe: any thread may call(); the
/// thread that waits reads the socket for everyone (leader/follower), so no
/// background thread is needed.
class Connection {
 public:
  /// Connects to `socket_path` and says Hello. Throws Error naming the socket.
  static std::unique_ptr<Connection> open(const std::string& socket_path,
                                          const std::string& client_name,
                                          std::chrono::milliseconds timeout);

  /// Sends `request` (its id is assigned here) with `fds`, waits for the reply
  /// until `deadline`. An Error reply is thrown as Error.
  std::unique_ptr<ipc::IncomingFrame> call(capnp::MessageBuilder& request,
                                           std::span<const int> fds, Clock::time_point deadline);

  /// Sends `request` without waiting; returns its id.
  std::uint64_t send_request(capnp::MessageBuilder& request, std::span<const int> fds,
                             Clock::time_point deadline);
  /// The reply to `id`, or nullptr if none came before `deadline` (the reply
  /// may still come later). Throws Error when the connection is broken.
  std::unique_ptr<ipc::IncomingFrame> wait_reply(std::uint64_t id, Clock::time_point deadline);
  /// The reply to `id` if it has arrived (reads what is readable, never blocks).
  std::unique_ptr<ipc::IncomingFrame> try_reply(std::uint64_t id);
  /// Forget request `id`: its reply is dropped when it comes.
  void abandon(std::uint64_t id);
  /// Throws the Error an error reply carries; returns otherwise.
  static void check(ipc::IncomingFrame& reply);

  const std::string& rendezvous_address() const { return rendezvous_address_; }
  std::chrono::milliseconds operation_deadline() const { return operation_deadline_; }
  std::chrono::milliseconds rendezvous_deadline() const { return rendezvous_deadline_; }

  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  std::uint64_t session_id() const { return session_id_; }
  const std::string& node_name() const { return node_name_; }
  const std::string& daemon_version() const { return daemon_version_; }
  const std::string& socket_path() const { return socket_path_; }
  /// The socket, for watching it (never read or write it from outside).
  int socket_fd() const { return fd_.get(); }

 private:
  Connection(UniqueFd fd, std::string socket_path);
  /// Sets up the shared-memory rings (ipc/ring.h); on failure the socket
  /// alone carries everything.
  void attach_ring();
  /// Moves completions from the ring into arrived_ (state_mutex_ held).
  void drain_ring_locked();
  /// Waits for a ring completion: spins briefly, then sleeps on the futex word
  /// in short slices, checking the socket between them. Asleep, it is woken
  /// for the completion of `id` only, unless other threads wait too.
  void wait_ring(Clock::time_point deadline, std::uint64_t id);
  /// One turn of waiting for room in the submission ring (throws the
  /// session's end, or a timeout past `deadline`).
  void wait_for_ring(Clock::time_point deadline);
  void read_once(Clock::time_point deadline);
  /// Takes the reader role (state_mutex_ held by `lock`, no reader active),
  /// runs `read` unlocked, records a failure as the connection's error.
  void read_as_reader(std::unique_lock<std::mutex>& lock, const std::function<void()>& read);
  Error session_error_or(const Error& fallback);

  UniqueFd fd_;
  std::string socket_path_;
  std::uint64_t session_id_ = 0;
  std::string node_name_;
  std::string daemon_version_;
  std::string rendezvous_address_;
  std::chrono::milliseconds operation_deadline_{30000};
  std::chrono::milliseconds rendezvous_deadline_{60000};
  std::set<std::uint64_t> abandoned_;
  std::atomic<std::uint64_t> next_id_{1};
  // wait_ring spins this long before it sleeps, unless the recent waits
  // (recent_wait_us_, a moving average) were much longer.
  static constexpr std::int64_t kSpinMicros = 100;
  std::atomic<std::int64_t> recent_wait_us_{0};

  std::mutex send_mutex_;
  std::mutex state_mutex_;
  std::condition_variable arrived_cv_;
  bool reader_active_ = false;
  /// Threads in wait_reply: with more than one, a sleeping reader asks to be
  /// woken for any completion (the others' ids are not its own).
  std::atomic<int> waiters_{0};
  std::map<std::uint64_t, std::unique_ptr<ipc::IncomingFrame>> arrived_;
  std::optional<Error> broken_;
  ipc::FrameDecoder decoder_;  // used by the reader only

  // Shared-memory fast path.
  void* ring_base_ = nullptr;
  ipc::RingView ring_;
  UniqueFd ring_doorbell_;
  bool ring_ok_ = false;
  std::vector<std::byte> ring_scratch_;  // completions being decoded (state_mutex_)
};

}  // namespace collectived::client
