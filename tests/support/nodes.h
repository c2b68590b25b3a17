// Daemons standing for nodes in integration tests: each on its own loopback
// address (127.0.0.2, .3, ...) and peer port, with a cluster secret; and
// what their status says about their peers.
#pragma once

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "client/collective.h"
#include "ipc/protocol.capnp.h"
#include "tests/support/collective_check.h"
#include "tests/support/harness.h"

namespace collectived::test {

using namespace std::chrono_literals;

/// deadlines.heartbeat_ms of test nodes: 200, or COLLECTIVED_TEST_HEARTBEAT_MS
/// (scripts/sanitizers: sanitizer builds on a loaded 2-core machine missed
/// 3 heartbeats of 200 ms in multinode_test's 4-daemon matrix).
inline const int kHeartbeatMs = [] {
  const char* v = std::getenv("COLLECTIVED_TEST_HEARTBEAT_MS");
  return v && std::atoi(v) > 0 ? std::atoi(v) : 200;
}();

inline std::string write_secret(const TempDir& dir, const std::string& name, const std::string& text,
                         mode_t mode = 0600) {
  const std::string path = dir.file(name);
  write_file(path, text);
  ::chmod(path.c_str(), mode);
  return path;
}

/// A collectived standing for one node: its own loopback address, peer port
/// and client socket.
struct Node {
  std::string name;
  std::string ip;
  std::string secret_file;
  std::vector<std::string> extra{};
  std::map<std::string, std::string> env{};
  std::vector<std::string> test_hooks{};  ///< --test-hook NAME=VALUE (daemon/options.h)
  std::string profile_file{};  ///< --profile (optional): a file a test may rewrite and reload
  std::uint16_t port = 0;
  std::unique_ptr<Daemon> daemon{};

  std::string address() const { return ip + ":" + std::to_string(port); }

  Daemon::Options options() const {
    Daemon::Options o;
    o.overrides = {"node.name=" + name,
                   "peer.listen_address=" + ip,
                   "peer.port=" + std::to_string(port),
                   "peer.secret_file=" + secret_file,
                   "deadlines.heartbeat_ms=" + std::to_string(kHeartbeatMs),
                   "deadlines.connect_ms=3000",
                   "tcp.streams_per_peer=2"};
    o.overrides.insert(o.overrides.end(), extra.begin(), extra.end());
    o.env = env;
    o.test_hooks = test_hooks;
    o.profile_file = profile_file;
    return o;
  }

  /// Starts on a port from 20000..59999, another one while ports are busy;
  /// `same_port`: restart on the port it had.
  Node& start(bool same_port = false) {
    static std::mt19937 rng(std::random_device{}());
    for (int attempt = 0;; ++attempt) {
      if (!same_port) port = static_cast<std::uint16_t>(20000 + rng() % 40000);
      try {
        daemon = std::make_unique<Daemon>(options());
        return *this;
      } catch (const std::runtime_error& e) {
        const bool busy = std::string(e.what()).find("Address already in use") != std::string::npos;
        if (same_port || !busy || attempt > 20) throw;
      }
    }
  }
};

/// Nodes of one test sharing a cluster secret (in `dir`). With
/// COLLECTIVED_TEST_LOGS=DIR every daemon's log is kept there when it goes.
struct Cluster {
  TempDir dir;
  std::vector<Node> nodes;

  /// No nodes yet: add() them, then start().
  Cluster() = default;
  /// `n` started nodes node0, node1, ... on 127.0.0.2, .3, ..., each with `extra`.
  /// Heartbeats every 1 s: loopback tests that use this do not test them (a
  /// killed daemon's connection closes at once), and 200 ms was missed under
  /// load and in sanitizer builds.
  explicit Cluster(int n, const std::vector<std::string>& extra = {}) {
    for (int i = 0; i < n; ++i) {
      Node& node = add("node" + std::to_string(i), "127.0.0." + std::to_string(i + 2));
      // Three streams per peer: the default (auto) gives one where the
      // daemon has no copy threads (below 4 cores, as on CI), and the
      // matrix is to cross the spreading of messages over several streams
      // (and their reassembly) on every machine. Tests may set their own.
      node.extra = {"deadlines.heartbeat_ms=1000", "tcp.streams_per_peer=3"};
      node.extra.insert(node.extra.end(), extra.begin(), extra.end());
    }
    start();
  }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;
  ~Cluster() {
    if (const char* keep = std::getenv("COLLECTIVED_TEST_LOGS")) {
      for (auto& n : nodes) {
        if (n.daemon) {
          write_file(std::string(keep) + "/" + n.name + "-" + std::to_string(n.port) + ".log",
                     n.daemon->log());
        }
      }
    }
  }

  /// The cluster secret's file.
  const std::string& secret() {
    if (secret_.empty()) secret_ = write_secret(dir, "secret", "test cluster secret\n");
    return secret_;
  }
  /// A node with the cluster secret, not started.
  Node& add(std::string name, std::string ip) {
    Node node;
    node.name = std::move(name);
    node.ip = std::move(ip);
    node.secret_file = secret();
    nodes.push_back(std::move(node));
    return nodes.back();
  }
  /// Starts every node not running yet.
  void start() {
    for (auto& node : nodes) {
      if (!node.daemon) node.start();
    }
  }
  const std::string& socket(int i) const { return nodes[i].daemon->socket(); }

 private:
  std::string secret_;
};

/// Runs one rank per entry of `layout` (rank -> node), each joining a new
/// communicator through its node's daemon, then `body(ctx)`; checks that every
/// rank exits 0 (body's result, then no failures reported).
inline void run_layout(const Cluster& cl, const std::vector<int>& layout, std::size_t bytes,
                       const std::function<int(RankCtx&)>& body,
                       std::chrono::milliseconds timeout = 240s) {
  const auto id = new_id(cl.socket(0));
  const int n = static_cast<int>(layout.size());
  run_ranks(
      n,
      [&](int rank) {
        RankCtx c = join(cl.socket(layout[rank]), id, n, rank, bytes);
        c.tolerant = true;
        const int rc = body(c);
        if (c.comm) collective_comm_destroy(c.comm);
        collective_disconnect(c.client);
        return rc != 0 ? rc : (c.failures == 0 ? 0 : 1);
      },
      timeout);
}

/// An int32 sum all-reduce of `count` elements, waited for up to `timeout_ms`.
inline collective_result_t all_reduce_wait(collective_comm_t* comm, const void* s, void* r,
                                           std::size_t count, int timeout_ms = 20000) {
  collective_request_t* req = nullptr;
  collective_result_t rc =
      collective_all_reduce(comm, s, r, count, COLLECTIVE_INT32, COLLECTIVE_SUM, &req);
  if (rc == COLLECTIVE_OK) rc = collective_wait(req, timeout_ms);
  collective_request_free(req);
  return rc;
}

/// Fills `count` int32 with `rank + 1 + i`, all-reduces, checks every element
/// is the sum; reports (c.report) and returns false otherwise.
inline bool sum_check(RankCtx& c, collective_comm_t* comm, std::size_t count,
                      int timeout_ms = 20000) {
  auto* s = reinterpret_cast<std::int32_t*>(c.send);
  auto* r = reinterpret_cast<std::int32_t*>(c.recv);
  const int me = collective_comm_rank(comm), n = collective_comm_size(comm);
  for (std::size_t i = 0; i < count; ++i) s[i] = me + 1 + static_cast<int>(i);
  if (all_reduce_wait(comm, s, r, count, timeout_ms) != COLLECTIVE_OK) {
    c.report(std::string("all_reduce: ") + collective_last_error());
    return false;
  }
  for (std::size_t i = 0; i < count; ++i) {
    const std::int32_t want = n * (n + 1) / 2 + n * static_cast<int>(i);
    if (r[i] != want) {
      c.report("element " + std::to_string(i) + " is " + std::to_string(r[i]) + ", expected " +
               std::to_string(want));
      return false;
    }
  }
  return true;
}

struct Pong {
  Code code = Code::ok;
  std::string error;
  std::string node;
  std::uint64_t rtt_us = 0;
  double skew_ms = 0;
  bool new_connection = false;
};

inline std::unique_ptr<RawClient> client_of(const Node& n) {
  auto c = std::make_unique<RawClient>(n.daemon->socket());
  auto hello = c->hello();
  REQUIRE(hello);
  REQUIRE(hello->message().isHelloReply());
  return c;
}

inline Pong ping(RawClient& c, const std::string& address) {
  static std::uint64_t next_id = 100;
  const std::uint64_t id = ++next_id;
  capnp::MallocMessageBuilder b;
  auto m = b.initRoot<wire::Message>();
  m.setId(id);
  m.initPeerPing().setAddress(address);
  c.send(b);
  auto f = c.receive(15s);
  REQUIRE(f);
  REQUIRE(f->message().getId() == id);
  Pong p;
  if (f->message().isError()) {
    p.code = error_code(*f);
    p.error = error_message(*f);
    return p;
  }
  REQUIRE(f->message().isPeerPong());
  auto r = f->message().getPeerPong();
  p.node = r.getNode().cStr();
  p.rtt_us = r.getRttUs();
  p.skew_ms = r.getSkewMs();
  p.new_connection = r.getNewConnection();
  return p;
}

struct PeerRow {
  std::string address;
  std::string node;
  wire::PeerLinkState state = wire::PeerLinkState::DEAD;
  bool outbound = false;
  std::uint32_t streams = 0;
  std::string congestion_control;
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t rtt_us = 0;
  std::uint64_t errors = 0;
  std::uint32_t connections = 0;
  std::uint64_t connected_ms = 0;
  std::string last_error;
};

inline std::vector<PeerRow> peers_of(RawClient& c, std::string* own_address = nullptr) {
  auto f = c.status();
  REQUIRE(f);
  REQUIRE(f->message().isStatusReply());
  auto s = f->message().getStatusReply();
  if (own_address) *own_address = s.getPeerAddress().cStr();
  std::vector<PeerRow> rows;
  for (auto p : s.getPeers()) {
    PeerRow r;
    r.address = p.getAddress().cStr();
    r.node = p.getNode().cStr();
    r.state = p.getState();
    r.outbound = p.getOutbound();
    r.streams = p.getStreams();
    r.congestion_control = p.getCongestionControl().cStr();
    r.bytes_sent = p.getBytesSent();
    r.bytes_received = p.getBytesReceived();
    r.rtt_us = p.getRttUs();
    r.errors = p.getErrors();
    r.connections = p.getConnections();
    r.connected_ms = p.getConnectedMs();
    r.last_error = p.getLastError().cStr();
    rows.push_back(std::move(r));
  }
  return rows;
}

inline std::optional<PeerRow> peer_row(RawClient& c, const std::string& address) {
  for (auto& r : peers_of(c)) {
    if (r.address == address) return r;
  }
  return std::nullopt;
}

}  // namespace collectived::test
