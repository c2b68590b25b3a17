// The daemon: event loop, client listener, sessions, signals, lifecycle.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "config/profile.h"
#include "daemon/metrics.h"
#include "daemon/notify.h"
#include "daemon/options.h"
#include "engine/transport/tcp/device.h"
#include "engine/transport/tcp/node_transport.h"
#include "engine/transport/select.h"
#include "daemon/ring_poller.h"
#include "daemon/session.h"
#include "engine/log.h"
#include "engine/registry.h"

namespace collectived::daemon {

/// Where the profile came from, so SIGHUP can load it again.
struct ProfileSource {
  std::string file;                    ///< empty: the embedded default
  std::vector<std::string> overrides;  ///< --set arguments
};

/// The profile's rules for collectives between nodes (collectives.*, and
/// the transfer chunk from tcp.chunk_bytes).
engine::NodeAlgorithmOptions node_algorithms(const config::Profile& p);

/// Owns everything the daemon serves with. main() builds it from a loaded
/// profile and calls run(); nothing here is global.
class Server final : public SessionHost {
 public:
  /// `hooks`: collectived --test-hook (tests only).
  Server(config::Profile profile, ProfileSource source, engine::Logger& logger,
         TestHooks hooks = {});
  ~Server() override;

  /// Binds the client socket (throws Error naming the path on failure).
  void listen();
  /// Serves until SIGTERM/SIGINT; returns the process exit code.
  int run();

  // SessionHost
  const config::Profile& profile() const override { return profile_; }
  engine::Logger& logger() override { return log_; }
  engine::Registry& registry() override { return registry_; }
  engine::Engine& engine() override { return engine_; }
  RingPoller& ring_poller() override { return ring_poller_; }
  std::string rendezvous_address() const override;
  void fill_status(wire::StatusReply::Builder status) override;
  void session_closed(std::uint64_t session_id) override;
  tcp::Device& peers() override { return peers_; }
  engine::gpu::GpuExecutor& gpu() override { return *gpu_; }
  DirectBroker& direct_broker() override { return direct_broker_; }

 private:
  /// io_.run(), polling for workers.event_loop_spin_us before each sleep.
  void run_event_loop();
  void accept_next();
  void on_accept(boost::asio::local::stream_protocol::socket socket);
  bool allowed(const PeerCredentials& cred, int fd, std::string& why) const;
  /// chown of the socket to client.socket_group; a group the node lacks
  /// goes to `missing`.
  void give_socket_group(const std::string& path, std::vector<std::string>& missing);
  /// client_gids_ from the profile; one warning names every group in
  /// `missing` and those of client.allowed_groups the node lacks.
  void resolve_client_groups(std::vector<std::string> missing);
  void wait_signal();
  void reload();
  void begin_shutdown(const std::string& reason);
  void arm_watchdog();
  void arm_deadline_sweep();

  config::Profile profile_;
  ProfileSource source_;
  const TestHooks test_hooks_;
  engine::Logger& log_;
  Notifier notifier_;
  Metrics metrics_;  // before engine_, which reports to it
  engine::Registry registry_;
  engine::Engine engine_;
  // After engine_: destroyed first, joining its completion thread (which
  // answers through the engine) while the engine is still there.
  std::unique_ptr<engine::gpu::GpuExecutor> gpu_;
  DirectBroker direct_broker_;
  boost::asio::io_context io_;
  // After io_ (sessions it holds go before the io_context), after engine_
  // (its thread submits into the engine).
  RingPoller ring_poller_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  boost::asio::signal_set signals_;
  boost::asio::steady_timer watchdog_timer_;
  boost::asio::steady_timer shutdown_timer_;
  boost::asio::steady_timer sweep_timer_;
  tcp::Device peers_;  // after io_: its sockets and timers live on it
  // The engine's way to other nodes: tcp or verbs per peer (after peers_,
  // which it uses; destroyed first).
  std::unique_ptr<transport::SelectingTransport> transport_;
  MetricsServer metrics_server_;  // after io_, like peers_
  std::map<std::uint64_t, std::shared_ptr<ClientSession>> sessions_;
  std::uint64_t next_session_id_ = 1;
  /// client.allowed_gids plus the gids of client.allowed_groups (resolved
  /// at listen() and at each reload).
  std::vector<gid_t> client_gids_;
  bool stopping_ = false;
  bool socket_bound_ = false;
  const std::chrono::steady_clock::time_point started_;
};

}  // namespace collectived::daemon
