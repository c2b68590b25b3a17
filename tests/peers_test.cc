// Daemon-to-daemon connections between real collectived processes: several
// daemons on distinct loopback addresses (127.0.0.2, .3, .4) stand for nodes.
// They are reached through the client protocol (PeerPing, Status) and the C
// API (collective_peer_ping).
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <optional>
#include <random>
#include <thread>

#include "client/collective.h"
#include "ipc/peer.capnp.h"
#include "tests/support/harness.h"
#include "tests/support/nodes.h"

using namespace collectived;
using namespace collectived::test;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// The first log line with `event` that also contains every one of `parts`.
bool logged(const Daemon& d, const std::string& event, const std::vector<std::string>& parts) {
  const std::string log = d.log();
  std::size_t at = 0;
  while ((at = log.find("event=" + event + " ", at)) != std::string::npos) {
    const std::size_t start = log.rfind('\n', at) == std::string::npos ? 0 : log.rfind('\n', at);
    const std::string line = log.substr(start, log.find('\n', at) - start);
    if (std::all_of(parts.begin(), parts.end(), [&](const auto& p) { return contains(line, p); })) {
      return true;
    }
    ++at;
  }
  return false;
}

}  // namespace

TEST_CASE("two daemons: a ping opens an authenticated connection, a second one reuses it") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "two-node test cluster secret 0123456789\n");
  Node a{"a", "127.0.0.2", secret};
  Node b{"b", "127.0.0.3", secret};
  a.start();
  b.start();
  CHECK(a.daemon->wait_for_log("event=peer_listening address=" + a.address(), 5s));
  auto ca = client_of(a);
  auto cb = client_of(b);

  const Pong first = ping(*ca, b.address());
  REQUIRE_MESSAGE(first.code == Code::ok, first.error);
  CHECK(first.node == "b");
  CHECK(first.new_connection);
  CHECK(first.rtt_us > 0);
  CHECK(first.rtt_us < 1000000);
  CHECK(std::abs(first.skew_ms) < 1000);  // one clock on one machine

  const Pong second = ping(*ca, b.address());
  REQUIRE_MESSAGE(second.code == Code::ok, second.error);
  CHECK_FALSE(second.new_connection);

  std::string own;
  const auto rows = peers_of(*ca, &own);
  CHECK(own == a.address());
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].address == b.address());
  CHECK(rows[0].node == "b");
  CHECK(rows[0].state == wire::PeerLinkState::READY);
  CHECK(rows[0].outbound);
  CHECK(rows[0].streams == 2);
  CHECK(rows[0].congestion_control == "cubic");  // tcp.congestion_control's default
  CHECK(rows[0].connections == 1);
  CHECK(rows[0].errors == 0);
  CHECK(rows[0].bytes_sent > 0);
  CHECK(rows[0].bytes_received > 0);
  CHECK(rows[0].rtt_us > 0);

  // b sees the same connection, opened by a; pinging back reuses it.
  const auto at_b = peer_row(*cb, a.address());
  REQUIRE(at_b);
  CHECK(at_b->node == "a");
  CHECK(at_b->state == wire::PeerLinkState::READY);
  CHECK_FALSE(at_b->outbound);
  CHECK(at_b->connections == 1);
  CHECK(at_b->congestion_control == "cubic");  // accepted streams too
  const Pong back = ping(*cb, a.address());
  REQUIRE_MESSAGE(back.code == Code::ok, back.error);
  CHECK(back.node == "a");
  CHECK_FALSE(back.new_connection);
  CHECK(peer_row(*ca, b.address())->connections == 1);
  CHECK(peer_row(*cb, a.address())->connections == 1);

  // Heartbeats keep flowing both ways.
  const auto before = peer_row(*ca, b.address())->bytes_received;
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * kHeartbeatMs));
  CHECK(peer_row(*ca, b.address())->bytes_received > before);

  CHECK(logged(*a.daemon, "peer_connected", {"peer=" + b.address(), "node=b", "direction=outbound",
                                             "streams=2"}));
  CHECK(logged(*b.daemon, "peer_connected", {"peer=" + a.address(), "node=a", "direction=inbound"}));
}

TEST_CASE("loopback ping RTT through the C API (1000 pings)") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "rtt measurement cluster secret 01234");
  Node a{"a", "127.0.0.2", secret};
  Node b{"b", "127.0.0.3", secret};
  a.start();
  b.start();
  collective_client_t* c = nullptr;
  REQUIRE(collective_connect(a.daemon->socket().c_str(), "peers_test rtt", &c) == COLLECTIVE_OK);
  collective_peer_ping_t out{};
  REQUIRE(collective_peer_ping(c, b.address().c_str(), &out) == COLLECTIVE_OK);
  CHECK(std::string(out.node_name) == "b");
  CHECK(out.new_connection == 1);
  std::vector<double> daemon_us, client_us;
  for (int i = 0; i < 1000; ++i) {
    const auto t0 = Clock::now();
    REQUIRE(collective_peer_ping(c, b.address().c_str(), &out) == COLLECTIVE_OK);
    client_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    daemon_us.push_back(static_cast<double>(out.rtt_us));
    CHECK(out.new_connection == 0);
  }
  auto pct = [](std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v[static_cast<std::size_t>(q * (v.size() - 1))];
  };
  MESSAGE("daemon-to-daemon heartbeat RTT over loopback, 1000 pings: median "
          << pct(daemon_us, 0.5) << " us, p99 " << pct(daemon_us, 0.99)
          << " us; client-observed collective_peer_ping: median " << pct(client_us, 0.5)
          << " us, p99 " << pct(client_us, 0.99) << " us");
  CHECK(pct(daemon_us, 0.5) > 0);

  CHECK(collective_peer_ping(c, "no-port-here", &out) == COLLECTIVE_INVALID_ARGUMENT);
  CHECK(contains(collective_last_error(), "bad peer address \"no-port-here\""));
  collective_disconnect(c);
}

TEST_CASE("tcp.congestion_control applies to each daemon's own streams; a refused one is logged") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "congestion control test secret 0123\n");
  Node a{"a", "127.0.0.2", secret, {"tcp.congestion_control=reno"}};
  Node b{"b", "127.0.0.3", secret};
  Node c{"c", "127.0.0.4", secret, {"tcp.congestion_control=nosuchcc"}};
  a.start();
  b.start();
  c.start();
  CHECK(a.daemon->wait_for_log("congestion_control=reno", 5s));
  auto ca = client_of(a);
  auto cb = client_of(b);
  auto cc = client_of(c);
  REQUIRE(ping(*ca, b.address()).code == Code::ok);
  CHECK(peer_row(*ca, b.address())->congestion_control == "reno");
  CHECK(peer_row(*cb, a.address())->congestion_control == "cubic");  // b's own setting
  // A name the kernel does not have: said once, and the system's default used.
  CHECK(c.daemon->wait_for_log("event=peer_congestion_control wanted=nosuchcc", 5s));
  CHECK(c.daemon->wait_for_log("congestion_control=\"system default\"", 5s));
  REQUIRE(ping(*cc, b.address()).code == Code::ok);
  std::string system_default = read_file("/proc/sys/net/ipv4/tcp_congestion_control");
  while (!system_default.empty() &&
         std::isspace(static_cast<unsigned char>(system_default.back()))) {
    system_default.pop_back();
  }
  CHECK(peer_row(*cc, b.address())->congestion_control == system_default);
}

TEST_CASE("three daemons: every pair connects once, whichever side pinged first") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "three-node cluster secret 0123456789");
  Node a{"a", "127.0.0.2", secret};
  Node b{"b", "127.0.0.3", secret};
  Node c{"c", "127.0.0.4", secret};
  a.start();
  b.start();
  c.start();
  auto ca = client_of(a);
  auto cb = client_of(b);
  auto cc = client_of(c);
  CHECK(ping(*ca, b.address()).new_connection);
  CHECK(ping(*ca, c.address()).new_connection);
  CHECK(ping(*cb, c.address()).new_connection);
  CHECK_FALSE(ping(*cc, a.address()).new_connection);  // a opened it
  CHECK_FALSE(ping(*cb, a.address()).new_connection);
  CHECK_FALSE(ping(*cc, b.address()).new_connection);
  struct Expect {
    RawClient* client;
    std::vector<std::pair<std::string, std::string>> peers;  // address, node
  };
  for (const Expect& e :
       {Expect{ca.get(), {{b.address(), "b"}, {c.address(), "c"}}},
        Expect{cb.get(), {{a.address(), "a"}, {c.address(), "c"}}},
        Expect{cc.get(), {{a.address(), "a"}, {b.address(), "b"}}}}) {
    const auto rows = peers_of(*e.client);
    REQUIRE(rows.size() == 2);
    for (const auto& [address, node] : e.peers) {
      CAPTURE(address);
      const auto r = peer_row(*e.client, address);
      REQUIRE(r);
      CHECK(r->node == node);
      CHECK(r->state == wire::PeerLinkState::READY);
      CHECK(r->connections == 1);
      CHECK(r->streams == 2);
    }
  }
}

TEST_CASE("a daemon with the wrong secret is refused, and both sides log why") {
  TempDir dir;
  Node a{"a", "127.0.0.2", write_secret(dir, "secret-a", "the secret of cluster one 0123456789")};
  Node b{"b", "127.0.0.3", write_secret(dir, "secret-b", "the secret of cluster two 0123456789")};
  a.start();
  b.start();
  auto ca = client_of(a);
  const Pong p = ping(*ca, b.address());
  CHECK(p.code == Code::permission_denied);
  CHECK(contains(p.error, "node b refused node a (" + a.address() + "): authentication failed"));
  CHECK(contains(p.error, "peer.secret_file must hold the same bytes on both nodes"));
  CHECK(a.daemon->wait_for_log("event=peer_refused", 5s));
  CHECK(b.daemon->wait_for_log("event=peer_refused", 5s));
  CHECK(logged(*a.daemon, "peer_refused",
               {"peer=" + b.address(), "node=b", "code=\"permission denied\"", "authentication failed"}));
  // The acceptor names the remote address the connection came from.
  CHECK(logged(*b.daemon, "peer_refused",
               {"remote=127.0.0.2:", "node=a", "direction=inbound", "authentication failed"}));
  const auto row = peer_row(*ca, b.address());
  REQUIRE(row);
  CHECK(row->state == wire::PeerLinkState::DEAD);
  CHECK(row->errors == 1);
  CHECK(contains(row->last_error, "authentication failed"));
  // b never considered a a peer.
  auto cb = client_of(b);
  CHECK(peers_of(*cb).empty());
}

TEST_CASE("a killed peer is dead within 3 heartbeats; a ping fails naming it; a restart reconnects") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "kill and restart cluster secret 0123");
  Node a{"a", "127.0.0.2", secret};
  Node b{"b", "127.0.0.3", secret};
  a.start();
  b.start();
  auto ca = client_of(a);
  REQUIRE(ping(*ca, b.address()).code == Code::ok);

  const auto t0 = Clock::now();
  b.daemon->signal(SIGKILL);
  b.daemon->wait(5s);
  REQUIRE(eventually([&] { return peer_row(*ca, b.address())->state == wire::PeerLinkState::DEAD; },
                     5s));
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  CHECK(took.count() <= 3 * kHeartbeatMs);
  CHECK(logged(*a.daemon, "peer_dead", {"peer=" + b.address(), "node=b"}));

  const Pong p = ping(*ca, b.address());
  CHECK(p.code == Code::unavailable);
  CHECK(contains(p.error, "node b (" + b.address() + ")"));
  CHECK(contains(p.error, "Connection refused"));

  b.start(/*same_port=*/true);
  const Pong again = ping(*ca, b.address());
  REQUIRE_MESSAGE(again.code == Code::ok, again.error);
  CHECK(again.node == "b");
  CHECK(again.new_connection);
  const auto row = peer_row(*ca, b.address());
  REQUIRE(row);
  CHECK(row->state == wire::PeerLinkState::READY);
  CHECK(row->connections == 3);  // the first, the refused attempt, the new one
  CHECK(row->errors == 2);
}

TEST_CASE("a peer that stops answering (SIGSTOP) is declared dead after 3 missed heartbeats") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "stopped peer cluster secret 0123456");
  Node a{"a", "127.0.0.2", secret};
  Node b{"b", "127.0.0.3", secret};
  a.start();
  b.start();
  auto ca = client_of(a);
  REQUIRE(ping(*ca, b.address()).code == Code::ok);
  const auto t0 = Clock::now();
  b.daemon->signal(SIGSTOP);
  REQUIRE(eventually([&] { return peer_row(*ca, b.address())->state == wire::PeerLinkState::DEAD; },
                     10s));
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
  CHECK(took.count() >= 3 * kHeartbeatMs - 50);
  CHECK(took.count() <= 5 * kHeartbeatMs + 500);
  CHECK(logged(*a.daemon, "peer_dead", {"node=b", "missed 3 heartbeats"}));
  const Pong p = ping(*ca, b.address());  // the stopped daemon's kernel still accepts
  CHECK(p.code == Code::timeout);
  CHECK(contains(p.error, "node b (" + b.address() + ")"));
  b.daemon->signal(SIGCONT);
  // b wakes up to a closed connection.
  CHECK(b.daemon->wait_for_log("event=peer_dead", 5s));
}

TEST_CASE("a peer that stops cleanly tells why; its address then refuses") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "clean stop cluster secret 012345678");
  Node a{"a", "127.0.0.2", secret};
  Node b{"b", "127.0.0.3", secret};
  a.start();
  b.start();
  auto ca = client_of(a);
  REQUIRE(ping(*ca, b.address()).code == Code::ok);
  const auto status = b.daemon->terminate(10s);
  CHECK(status.exited);
  CHECK(status.code == 0);
  REQUIRE(eventually([&] { return peer_row(*ca, b.address())->state == wire::PeerLinkState::DEAD; },
                     5s));
  CHECK(contains(peer_row(*ca, b.address())->last_error,
                 "collectived on node b is stopping (SIGTERM)"));
}

TEST_CASE("a protocol version mismatch is refused, naming both versions on both sides") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "version test cluster secret 01234567");
  Node a{"a", "127.0.0.2", secret};
  Node c{"c", "127.0.0.4", secret};
  c.test_hooks = {"peer_version=99"};
  a.start();
  c.start();
  CHECK(c.daemon->wait_for_log("event=test_hook", 5s));
  auto ca = client_of(a);
  auto cc = client_of(c);
  const std::string ours = "speaks peer protocol " + std::to_string(peerwire::PEER_PROTOCOL_VERSION);
  SUBCASE("the new one dials the old one") {
    const Pong p = ping(*cc, a.address());
    CHECK(p.code == Code::protocol);
    CHECK(contains(p.error, "node a refused node c (" + c.address() +
                                "): peer protocol version mismatch: node c"));
    CHECK(contains(p.error, "speaks peer protocol 99, node a"));
    CHECK(contains(p.error, ours + ";"));
    CHECK(a.daemon->wait_for_log("event=peer_refused", 5s));
    CHECK(logged(*a.daemon, "peer_refused", {"node=c", "speaks peer protocol 99", ours}));
    CHECK(logged(*c.daemon, "peer_refused", {"node=a", "speaks peer protocol 99", ours}));
  }
  SUBCASE("the old one dials the new one") {
    const Pong p = ping(*ca, c.address());
    CHECK(p.code == Code::protocol);
    CHECK(contains(p.error, "node c refused node a"));
    CHECK(contains(p.error, ours + ", node c"));
    CHECK(contains(p.error, "speaks peer protocol 99;"));
    CHECK(c.daemon->wait_for_log("event=peer_refused", 5s));
    CHECK_MESSAGE(logged(*a.daemon, "peer_refused", {"peer=" + c.address(), "node=c", "code=\"protocol error\""}),
                  a.daemon->log());
  }
}

TEST_CASE("peer listener configuration errors stop the daemon with a clear message") {
  TempDir dir;
  SUBCASE("a missing secret file") {
    Node a{"a", "127.0.0.2", dir.file("no-such-secret")};
    a.port = 47999;
    auto o = a.options();
    o.wait_ready = false;
    Daemon d(o);
    const auto status = d.wait(10s);
    CHECK(status.exited);
    CHECK(status.code == 1);
    CHECK(contains(d.log(), "event=fatal"));
    CHECK(contains(d.log(), dir.file("no-such-secret") + " (peer.secret_file)"));
  }
  SUBCASE("an empty secret file") {
    Node a{"a", "127.0.0.2", write_secret(dir, "empty", "")};
    a.port = 47999;
    auto o = a.options();
    o.wait_ready = false;
    Daemon d(o);
    CHECK(d.wait(10s).code == 1);
    CHECK(contains(d.log(), "(peer.secret_file) is empty"));
  }
  SUBCASE("a port another daemon holds") {
    const std::string secret = write_secret(dir, "secret", "busy port cluster secret 0123456789");
    Node a{"a", "127.0.0.2", secret};
    a.start();
    Node b{"b", "127.0.0.2", secret};
    b.port = a.port;
    auto o = b.options();
    o.wait_ready = false;
    Daemon d(o);
    CHECK(d.wait(10s).code == 1);
    CHECK(contains(d.log(), "cannot listen for peer daemons on " + a.address() +
                                " (peer.listen_address, peer.port): Address already in use"));
  }
}

TEST_CASE("peer.port 0 (the default) listens for no peers but can still reach them") {
  TempDir dir;
  const std::string secret = write_secret(dir, "secret", "outbound only cluster secret 0123456",
                                          0644);
  Node b{"b", "127.0.0.3", secret};
  b.start();
  CHECK(b.daemon->wait_for_log("event=peer_secret_insecure", 5s));
  CHECK(contains(b.daemon->log(), "chmod 600"));
  Daemon a(Daemon::Options{{"node.name=a", "peer.secret_file=" + secret}});
  CHECK(a.wait_for_log("event=peer_listener_disabled", 5s));
  RawClient ca(a.socket());
  ca.hello();
  std::string own = "unset";
  CHECK(peers_of(ca, &own).empty());
  CHECK(own.empty());
  const Pong p = ping(ca, b.address());
  REQUIRE_MESSAGE(p.code == Code::ok, p.error);
  CHECK(p.node == "b");
  // b knows a by its address and connection, with all of its streams.
  auto cb = client_of(b);
  const auto rows = peers_of(*cb);
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].node == "a");
  CHECK(rows[0].address.rfind("127.0.0.1/", 0) == 0);
  CHECK(rows[0].state == wire::PeerLinkState::READY);
  // The initiator's tcp.streams_per_peer, the default 0 (auto): 4 where copy
  // threads run (tcp.io_threads, from 4 cores on), else 1.
  CHECK(rows[0].streams == (std::thread::hardware_concurrency() >= 4 ? 4u : 1u));
  // No secret configured at all: a ping says what is missing.
  Daemon lone(Daemon::Options{{"node.name=lone", "peer.secret_file="}});
  RawClient cl(lone.socket());
  cl.hello();
  const Pong q = ping(cl, b.address());
  CHECK(q.code == Code::invalid_argument);
  CHECK(contains(q.error, "peer.secret_file is empty"));
}
