#include "daemon/metrics.h"

#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <istream>
#include <optional>

#include "ipc/error.h"

namespace collectived::daemon {

namespace asio = boost::asio;

namespace {

// Label values of engine::OpKind, in its order.
constexpr std::array<std::string_view, Metrics::kKinds> kKindNames{
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
    "all_to_all", "barrier",    "comm_split",     "p2p"};
constexpr std::array<std::string_view, Metrics::kTransports> kTransportNames{"local", "tcp",
                                                                            "verbs"};

std::size_t transport_index(std::string_view transport) {
  for (std::size_t i = 0; i < kTransportNames.size(); ++i) {
    if (kTransportNames[i] == transport) return i;
  }
  return 0;
}

// Prometheus label values escape backslash, double quote and newline.
std::string label(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", v);
  return text;
}

class Writer {
 public:
  void family(std::string_view name, std::string_view type, std::string_view help) {
    out_ += "# HELP ";
    out_ += name;
    out_ += ' ';
    out_ += help;
    out_ += "\n# TYPE ";
    out_ += name;
    out_ += ' ';
    out_ += type;
    out_ += '\n';
  }
  void sample(std::string_view name, std::string_view labels, const std::string& value) {
    out_ += name;
    if (!labels.empty()) {
      out_ += '{';
      out_ += labels;
      out_ += '}';
    }
    out_ += ' ';
    out_ += value;
    out_ += '\n';
  }
  void sample(std::string_view name, std::string_view labels, std::uint64_t value) {
    sample(name, labels, std::to_string(value));
  }
  void gauge(std::string_view name, std::string_view help, std::uint64_t value) {
    family(name, "gauge", help);
    sample(name, "", value);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

}  // namespace

void Metrics::operation_finished(engine::OpKind kind, Code code, std::uint64_t bytes,
                                 engine::Clock::duration latency, std::string_view transport) {
  const auto k = static_cast<std::size_t>(kind);
  const auto c = static_cast<std::size_t>(code);
  if (k >= kKinds || c >= kCodes) return;
  operations_[k][c].fetch_add(1, std::memory_order_relaxed);
  if (code != Code::ok) return;  // a failed operation's time is its deadline, not a latency
  bytes_[k].fetch_add(bytes, std::memory_order_relaxed);
  Histogram& h = latency_[k][transport_index(transport)];
  const double seconds = std::chrono::duration<double>(latency).count();
  std::size_t b = 0;
  while (b < kBuckets.size() && seconds > kBuckets[b]) ++b;
  h.buckets[b].fetch_add(1, std::memory_order_relaxed);
  h.count.fetch_add(1, std::memory_order_relaxed);
  h.sum_ns.fetch_add(
      static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(latency).count()),
      std::memory_order_relaxed);
}

std::string Metrics::render(wire::StatusReply::Reader s) const {
  Writer w;
  const std::string node = "node=\"" + label(s.getNodeName().cStr()) + "\"";
  w.family("collectived_build_info", "gauge", "Version and node of this daemon (always 1).");
  w.sample("collectived_build_info",
           node + ",version=\"" + label(s.getDaemonVersion().cStr()) + "\",protocol=\"" +
               std::to_string(s.getProtocolVersion()) + "\"",
           1);
  w.family("collectived_uptime_seconds", "gauge", "Seconds since the daemon started.");
  w.sample("collectived_uptime_seconds", "", number(s.getUptimeMs() / 1000.0));

  // Operations, by kind and result code.
  w.family("collectived_operations_total", "counter",
           "Operations answered, by operation and result (ok or the error code).");
  for (std::size_t k = 0; k < kKinds; ++k) {
    for (std::size_t c = 0; c < kCodes; ++c) {
      const std::uint64_t n = operations_[k][c].load(std::memory_order_relaxed);
      if (n == 0 && c != 0) continue;  // ok always, errors once they happened
      w.sample("collectived_operations_total",
               "op=\"" + std::string(kKindNames[k]) + "\",result=\"" +
                   std::string(to_string(static_cast<Code>(c))) + "\"",
               n);
    }
  }
  w.family("collectived_operation_errors_total", "counter",
           "Operations that failed (any code), by operation.");
  for (std::size_t k = 0; k < kKinds; ++k) {
    std::uint64_t n = 0;
    for (std::size_t c = 1; c < kCodes; ++c) n += operations_[k][c].load(std::memory_order_relaxed);
    w.sample("collectived_operation_errors_total", "op=\"" + std::string(kKindNames[k]) + "\"", n);
  }
  w.family("collectived_operation_bytes_total", "counter",
           "Bytes of successful operations, as nccl-tests counts an operation's size.");
  for (std::size_t k = 0; k < kKinds; ++k) {
    w.sample("collectived_operation_bytes_total", "op=\"" + std::string(kKindNames[k]) + "\"",
             bytes_[k].load(std::memory_order_relaxed));
  }
  w.family("collectived_operation_duration_seconds", "histogram",
           "Successful operations from the first rank's submission to completion.");
  for (std::size_t k = 0; k < kKinds; ++k) {
    for (std::size_t t = 0; t < kTransports; ++t) {
      const Histogram& h = latency_[k][t];
      const std::uint64_t count = h.count.load(std::memory_order_relaxed);
      if (count == 0) continue;
      const std::string labels = "op=\"" + std::string(kKindNames[k]) + "\",transport=\"" +
                                 std::string(kTransportNames[t]) + "\"";
      std::uint64_t cumulative = 0;
      for (std::size_t b = 0; b <= kBuckets.size(); ++b) {
        cumulative += h.buckets[b].load(std::memory_order_relaxed);
        const std::string le = b < kBuckets.size() ? number(kBuckets[b]) : "+Inf";
        w.sample("collectived_operation_duration_seconds_bucket", labels + ",le=\"" + le + "\"",
                 cumulative);
      }
      w.sample("collectived_operation_duration_seconds_sum", labels,
               number(static_cast<double>(h.sum_ns.load(std::memory_order_relaxed)) * 1e-9));
      w.sample("collectived_operation_duration_seconds_count", labels, cumulative);
    }
  }

  // In flight: the age of the oldest operation is the one number a hang alert needs.
  std::uint64_t oldest_ms = 0;
  for (auto comm : s.getComms()) {
    for (auto op : comm.getOperations()) oldest_ms = std::max<std::uint64_t>(oldest_ms, op.getAgeMs());
  }
  w.gauge("collectived_communicators", "Communicators with ranks on this daemon.",
          s.getCommunicators());
  w.gauge("collectived_operations_in_flight", "Operations submitted and not yet answered.",
          s.getOperationsInFlight());
  w.family("collectived_oldest_operation_age_seconds", "gauge",
           "Age of the oldest operation in flight (0: none); alert when it nears "
           "deadlines.operation_ms.");
  w.sample("collectived_oldest_operation_age_seconds", "", number(oldest_ms / 1000.0));

  // Connections.
  w.gauge("collectived_clients", "Connected client sessions.", s.getClients().size());
  w.family("collectived_clients_accepted_total", "counter", "Client connections accepted.");
  w.sample("collectived_clients_accepted_total", "",
           clients_accepted_.load(std::memory_order_relaxed));
  w.family("collectived_clients_refused_total", "counter",
           "Client connections refused (not allowed by the profile, or client.max_clients).");
  w.sample("collectived_clients_refused_total", "",
           clients_refused_.load(std::memory_order_relaxed));
  std::array<std::uint64_t, 3> by_state{};
  for (auto p : s.getPeers()) {
    const auto st = static_cast<std::size_t>(p.getState());
    if (st < by_state.size()) ++by_state[st];
  }
  w.family("collectived_peers", "gauge", "Other nodes' daemons known since start, by state.");
  const std::array<std::string_view, 3> states{"connecting", "ready", "dead"};
  for (std::size_t i = 0; i < states.size(); ++i) {
    w.sample("collectived_peers", "state=\"" + std::string(states[i]) + "\"", by_state[i]);
  }
  if (s.getPeers().size() > 0) {
    w.family("collectived_peer_sent_bytes_total", "counter", "Bytes sent to a peer daemon.");
    for (auto p : s.getPeers())
      w.sample("collectived_peer_sent_bytes_total", "peer=\"" + label(p.getAddress().cStr()) + "\"",
               p.getBytesSent());
    w.family("collectived_peer_received_bytes_total", "counter",
             "Bytes received from a peer daemon.");
    for (auto p : s.getPeers())
      w.sample("collectived_peer_received_bytes_total",
               "peer=\"" + label(p.getAddress().cStr()) + "\"", p.getBytesReceived());
    w.family("collectived_peer_connection_errors_total", "counter",
             "Connections to a peer daemon that failed or were refused.");
    for (auto p : s.getPeers())
      w.sample("collectived_peer_connection_errors_total",
               "peer=\"" + label(p.getAddress().cStr()) + "\"", p.getErrors());
    w.family("collectived_peer_rtt_seconds", "gauge", "Last heartbeat round trip to a peer daemon.");
    for (auto p : s.getPeers())
      w.sample("collectived_peer_rtt_seconds", "peer=\"" + label(p.getAddress().cStr()) + "\"",
               number(p.getRttUs() * 1e-6));
    w.family("collectived_peer_clock_skew_seconds", "gauge",
             "A peer daemon's wall clock minus this node's.");
    for (auto p : s.getPeers())
      w.sample("collectived_peer_clock_skew_seconds",
               "peer=\"" + label(p.getAddress().cStr()) + "\"", number(p.getClockSkewMs() / 1000.0));
  }

  // Memory and process.
  w.gauge("collectived_registrations", "Client buffers registered with the daemon.",
          s.getRegistrations());
  w.gauge("collectived_registered_bytes", "Client memory mapped by the daemon.",
          s.getRegisteredBytes());
  w.gauge("collectived_pool_bytes", "Daemon-owned pool memory.", s.getPoolBytes());
  w.gauge("collectived_resident_bytes", "The daemon's resident memory (RSS).",
          s.getResidentBytes());
  w.gauge("collectived_open_fds", "The daemon's open file descriptors.", s.getOpenDescriptors());
  w.gauge("collectived_worker_threads", "Worker threads running operations.",
          s.getWorkerThreads());
  return w.take();
}

// ---- HTTP responder ------------------------------------------------------------------

struct MetricsServer::Listener : std::enable_shared_from_this<MetricsServer::Listener> {
  MetricsServer& owner;
  std::optional<asio::ip::tcp::acceptor> tcp;
  std::optional<asio::local::stream_protocol::acceptor> unix_socket;
  std::string address;
  std::string unix_path;
  bool closed = false;

  explicit Listener(MetricsServer& o) : owner(o) {}

  template <typename Socket>
  void serve(Socket socket) {
    struct Conn {
      Socket socket;
      asio::streambuf in{8192};
      asio::steady_timer timer;
      std::string reply;
      Conn(Socket s, asio::io_context& io) : socket(std::move(s)), timer(io) {}
    };
    auto conn = std::make_shared<Conn>(std::move(socket), owner.io_);
    conn->timer.expires_after(std::chrono::seconds(5));
    conn->timer.async_wait([conn](boost::system::error_code ec) {
      if (!ec) {
        boost::system::error_code ignored;
        conn->socket.close(ignored);
      }
    });
    auto self = shared_from_this();
    asio::async_read_until(
        conn->socket, conn->in, "\r\n\r\n",
        [self, conn](boost::system::error_code ec, std::size_t) {
          if (self->closed) return;
          std::string status = "200 OK";
          std::string body;
          std::string type = "text/plain; version=0.0.4; charset=utf-8";
          if (ec) {
            if (ec == asio::error::operation_aborted || ec == asio::error::eof) {
              conn->timer.cancel();
              return;
            }
            status = "400 Bad Request";
            body = "request too large or malformed\n";
            type = "text/plain";
          } else {
            std::string line;
            std::istream is(&conn->in);
            std::getline(is, line);
            if (!line.empty() && line.back() == '\r') line.pop_back();
            const bool get = line.rfind("GET ", 0) == 0;
            const std::size_t sp = line.find(' ', 4);
            const std::string path = get ? line.substr(4, sp == std::string::npos ? sp : sp - 4)
                                         : std::string();
            if (!get) {
              status = "405 Method Not Allowed";
              body = "only GET is served\n";
              type = "text/plain";
            } else if (path == "/metrics" || path.rfind("/metrics?", 0) == 0) {
              try {
                body = self->owner.render_();
              } catch (const std::exception& e) {
                status = "500 Internal Server Error";
                body = std::string(e.what()) + "\n";
                type = "text/plain";
              }
            } else if (path == "/") {
              body = "collectived: metrics at /metrics\n";
              type = "text/plain";
            } else {
              status = "404 Not Found";
              body = "not found; metrics are at /metrics\n";
              type = "text/plain";
            }
          }
          conn->reply = "HTTP/1.0 " + status + "\r\nContent-Type: " + type +
                        "\r\nContent-Length: " + std::to_string(body.size()) +
                        "\r\nConnection: close\r\n\r\n" + body;
          asio::async_write(conn->socket, asio::buffer(conn->reply),
                            [conn](boost::system::error_code, std::size_t) {
                              boost::system::error_code ignored;
                              conn->socket.shutdown(Socket::shutdown_both, ignored);
                              conn->socket.close(ignored);
                              conn->timer.cancel();
                            });
        });
  }

  template <typename Acceptor>
  void accept_next(Acceptor& acceptor) {
    auto self = shared_from_this();
    acceptor.async_accept([self, &acceptor](boost::system::error_code ec, auto socket) {
      if (self->closed || ec == asio::error::operation_aborted) return;
      if (ec) {
        self->owner.log_.warn("metrics_accept_failed", {{"address", self->address},
                                                        {"error", ec.message()}});
      } else {
        self->serve(std::move(socket));
      }
      self->accept_next(acceptor);
    });
  }
};

MetricsServer::MetricsServer(asio::io_context& io, engine::Logger& log, Render render)
    : io_(io), log_(log), render_(std::move(render)) {}

MetricsServer::~MetricsServer() { close(); }

void MetricsServer::listen(const std::string& where, std::uint32_t socket_mode) {
  auto l = std::make_shared<Listener>(*this);
  boost::system::error_code ec;
  const auto fail = [&](const std::string& why) {
    throw Error(Code::system, "cannot serve metrics on " + where + " (metrics.listen): " + why);
  };
  if (!where.empty() && where.front() == '/') {
    using stream = asio::local::stream_protocol;
    ::unlink(where.c_str());  // the daemon owns this path; a stale file from a crash goes
    l->unix_socket.emplace(io_);
    l->unix_socket->open(stream(), ec);
    if (!ec) l->unix_socket->bind(stream::endpoint(where), ec);
    if (!ec) l->unix_socket->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) fail(ec.message());
    if (::chmod(where.c_str(), socket_mode) != 0) fail("chmod: " + std::string(std::strerror(errno)));
    l->address = where;
    l->unix_path = where;
    l->accept_next(*l->unix_socket);
  } else {
    const std::size_t colon = where.rfind(':');
    if (colon == std::string::npos) fail("expected host:port or an absolute path");
    std::string host = where.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    const auto addr = asio::ip::make_address(host, ec);
    if (ec) fail("'" + host + "' is not an IP address");
    const auto port = static_cast<unsigned short>(std::stoul(where.substr(colon + 1)));
    const asio::ip::tcp::endpoint ep(addr, port);
    l->tcp.emplace(io_);
    l->tcp->open(ep.protocol(), ec);
    if (!ec) l->tcp->set_option(asio::socket_base::reuse_address(true), ec);
    if (!ec) l->tcp->bind(ep, ec);
    if (!ec) l->tcp->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) fail(ec.message());
    const auto bound = l->tcp->local_endpoint();
    l->address = (bound.address().is_v6() ? "[" + bound.address().to_string() + "]"
                                          : bound.address().to_string()) +
                 ":" + std::to_string(bound.port());
    l->accept_next(*l->tcp);
  }
  listener_ = std::move(l);
}

std::string MetricsServer::address() const { return listener_ ? listener_->address : ""; }

void MetricsServer::close() {
  if (!listener_) return;
  listener_->closed = true;
  boost::system::error_code ignored;
  if (listener_->tcp) listener_->tcp->close(ignored);
  if (listener_->unix_socket) listener_->unix_socket->close(ignored);
  if (!listener_->unix_path.empty()) ::unlink(listener_->unix_path.c_str());
  listener_.reset();
}

}  // namespace collectived::daemon
