// Prometheus metrics: counters and latency histograms the engine and the
// server update from any thread, and a small HTTP/1.0 responder on the
// daemon's event loop that serves them in the text exposition format.
#pragma once

#include <array>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "engine/engine.h"
#include "engine/log.h"
#include "ipc/protocol.capnp.h"

namespace collectived::daemon {

/// The daemon's counters. Updates are relaxed atomics (no lock, no
/// allocation), so the engine may call them under its own lock.
class Metrics final : public engine::EngineObserver {
 public:
  /// Upper bounds of the latency buckets, in seconds (then +Inf).
  static constexpr std::array<double, 20> kBuckets{
      10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3,
      25e-3, 50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,  5.0,    10.0, 30.0};
  static constexpr std::size_t kKinds = 9;        ///< engine::OpKind values
  static constexpr std::size_t kTransports = 3;   ///< local, tcp, verbs
  static constexpr std::size_t kCodes = 14;       ///< collectived::Code values

  Metrics() = default;
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // engine::EngineObserver
  void operation_finished(engine::OpKind kind, Code code, std::uint64_t bytes,
                          engine::Clock::duration latency, std::string_view transport) override;

  void client_accepted() { clients_accepted_.fetch_add(1, std::memory_order_relaxed); }
  void client_refused() { clients_refused_.fetch_add(1, std::memory_order_relaxed); }

  /// The exposition text: these counters, plus the gauges of `status` (the
  /// same snapshot `collectivectl status` shows).
  std::string render(wire::StatusReply::Reader status) const;

 private:
  struct Histogram {
    std::array<std::atomic<std::uint64_t>, kBuckets.size() + 1> buckets{};  // per bucket, not cumulative
    std::atomic<std::uint64_t> count{0};
    std::atomic<std::uint64_t> sum_ns{0};
  };
  std::array<std::array<std::atomic<std::uint64_t>, kCodes>, kKinds> operations_{};
  std::array<std::atomic<std::uint64_t>, kKinds> bytes_{};
  std::array<std::array<Histogram, kTransports>, kKinds> latency_{};
  std::atomic<std::uint64_t> clients_accepted_{0};
  std::atomic<std::uint64_t> clients_refused_{0};
};

/// Serves `GET /metrics` (HTTP/1.0 and 1.1, one request per connection) on
/// the event loop. Anything else gets 404 or 400; a request must arrive whole
/// within 5 s and 8 KiB.
class MetricsServer {
 public:
  using Render = std::function<std::string()>;
  MetricsServer(boost::asio::io_context& io, engine::Logger& log, Render render);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  /// Listens on `where`: "host:port" (IPv6 as "[addr]:port"; port 0 picks
  /// one) or an absolute Unix socket path, created with `socket_mode`.
  /// Throws Error naming the address and the profile key on failure.
  void listen(const std::string& where, std::uint32_t socket_mode);
  /// Where it listens ("127.0.0.1:9464", "/run/collectived/metrics.sock"); "" when off.
  std::string address() const;
  /// Stops accepting and removes the Unix socket file.
  void close();

  struct Listener;

 private:
  boost::asio::io_context& io_;
  engine::Logger& log_;
  Render render_;
  std::shared_ptr<Listener> listener_;
};

}  // namespace collectived::daemon
