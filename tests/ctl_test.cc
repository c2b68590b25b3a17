// collectivectl against real daemons: status with a stuck operation naming the
// rank that did not arrive (pid, node), doctor with and without a daemon (this
// machine: no GPU, no HCA), peers pinged by doctor, profile check.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>

#include "client/collective.h"
#include "tests/support/harness.h"

using namespace collectived::test;
using namespace std::chrono_literals;

namespace {

ExitStatus ctl(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 30s) {
  std::vector<std::string> argv = {COLLECTIVECTL_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_program(argv, timeout, {{"COLLECTIVED_SOCKET", ""}});
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Facts of the machine the test runs on, read the way doctor reads them.
bool machine_has_hca() {
  const std::string dir = "/sys/class/infiniband";
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return false;
  auto r = run_program({"/bin/sh", "-c", "ls -A /sys/class/infiniband | head -1"}, 5s);
  return !r.output.empty();
}
bool machine_has_gpu() { return ::access("/dev/nvidiactl", F_OK) == 0; }

/// Rank 1 of a two-rank communicator in a child process: joins, then waits
/// (without submitting anything) until killed.
struct IdleRank {
  std::unique_ptr<Child> child;
  IdleRank(const std::string& socket, const collective_unique_id_t& id) {
    child = std::make_unique<Child>([socket, id] {
      collective_client_t* c = nullptr;
      collective_comm_t* comm = nullptr;
      if (collective_connect(socket.c_str(), "idle rank", &c) != COLLECTIVE_OK ||
          collective_comm_init_rank(c, &id, 2, 1, &comm) != COLLECTIVE_OK) {
        std::fprintf(stderr, "idle rank: %s\n", collective_last_error());
        return 10;
      }
      ::pause();
      return 0;
    });
  }
};

/// A daemon standing for one node on its own loopback address with a peer
/// listener on a free port.
std::unique_ptr<Daemon> start_node(const std::string& name, const std::string& ip,
                                   const std::string& secret, std::uint16_t& port) {
  static std::mt19937 rng(std::random_device{}());
  for (int attempt = 0;; ++attempt) {
    port = static_cast<std::uint16_t>(20000 + rng() % 40000);
    try {
      return std::make_unique<Daemon>(Daemon::Options{
          .overrides = {"node.name=" + name, "peer.listen_address=" + ip,
                        "peer.port=" + std::to_string(port), "peer.secret_file=" + secret}});
    } catch (const std::runtime_error& e) {
      if (attempt > 20) throw;
    }
  }
}

std::string make_secret(const TempDir& dir) {
  const std::string secret = dir.file("secret");
  write_file(secret, "ctl test cluster secret 0123456789abcdef\n");
  ::chmod(secret.c_str(), 0600);
  return secret;
}

}  // namespace

TEST_CASE("status, comms and peers name a stuck operation's missing rank with its pid and node") {
  Daemon d({.overrides = {"node.name=ctl-node"}});
  collective_client_t* c = nullptr;
  REQUIRE(collective_connect(d.socket().c_str(), "rank 0", &c) == COLLECTIVE_OK);
  collective_unique_id_t id;
  REQUIRE(collective_get_unique_id(c, &id) == COLLECTIVE_OK);
  IdleRank idle(d.socket(), id);
  collective_comm_t* comm = nullptr;
  REQUIRE(collective_comm_init_rank(c, &id, 2, 0, &comm) == COLLECTIVE_OK);
  void* buf = nullptr;
  REQUIRE(collective_host_alloc(c, 4096, &buf) == COLLECTIVE_OK);
  collective_request_t* req = nullptr;
  REQUIRE(collective_all_reduce(comm, buf, buf, 1024, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &req) ==
          COLLECTIVE_OK);
  ::usleep(100000);  // an age above zero

  const std::string rank1 = "rank 1 (pid " + std::to_string(idle.child->pid()) + " on ctl-node)";
  auto s = ctl({"status", "--socket", d.socket()});
  INFO(s.output);
  CHECK(s.exited);
  CHECK(s.code == 0);
  CHECK(has(s.output, "on ctl-node (pid " + std::to_string(d.pid()) + ")"));
  CHECK(has(s.output, "clients: 3"));  // both ranks and collectivectl itself
  CHECK(has(s.output, "in-flight operations: 1"));
  CHECK(has(s.output, "all_reduce(count=1024, dtype=float, op=sum)"));
  CHECK(has(s.output, "waiting"));
  CHECK(has(s.output, rank1));
  // No GPU here (no driver, or a build without CUDA): said on its own line.
  CHECK(has(s.output, "\ngpus:       none: no GPU"));

  auto j = ctl({"status", "--json", "--socket", d.socket()});
  INFO(j.output);
  CHECK(j.code == 0);
  CHECK(has(j.output, "\"missing_ranks\":[{\"rank\":1,\"pid\":" +
                          std::to_string(idle.child->pid()) + ",\"node\":\"ctl-node\"}]"));
  CHECK(has(j.output, "\"seq\":0"));
  CHECK(has(j.output, "\"operations_in_flight\":1"));
  // The verbs transport: off here, saying why.
  CHECK(has(j.output, "\"verbs\":{\"enabled\":false,\"reason\":\"no peer listener"));
  CHECK(has(j.output, "\"mr_cache_entries\":0"));
  CHECK(has(j.output, "\"gpu\":{\"available\":false,\"reason\":\"no GPU"));
  CHECK(has(j.output, "\"mps\":\"off\""));

  auto cm = ctl({"comms", "--socket", d.socket()});
  CHECK(cm.code == 0);
  CHECK(has(cm.output, "NEXT SEQ"));
  CHECK(has(cm.output, std::to_string(idle.child->pid())));
  CHECK(ctl({"comms", "--json", "--socket", d.socket()}).output.find("\"nranks\":2") !=
        std::string::npos);

  auto p = ctl({"peers", "--socket", d.socket()});
  CHECK(p.code == 0);
  CHECK(has(p.output, "none (peer.port is 0)"));
  CHECK(has(ctl({"peers", "--json", "--socket", d.socket()}).output, "\"peers\":[]"));

  // COLLECTIVED_SOCKET is honoured when --socket is not given.
  auto e = run_program({COLLECTIVECTL_BIN, "status", "--json"}, 30s,
                       {{"COLLECTIVED_SOCKET", d.socket()}});
  CHECK(e.code == 0);
  CHECK(has(e.output, "\"node\":\"ctl-node\""));

  idle.child->kill(SIGKILL);
  idle.child->wait(10s);
  collective_request_free(req);
  collective_comm_abort(comm);  // frees it (LeakSanitizer found it left behind)
  collective_disconnect(c);
}

TEST_CASE("across nodes: the node whose rank did not arrive shows the operation other nodes wait on") {
  TempDir dir;
  const std::string secret = make_secret(dir);
  std::uint16_t pa = 0, pb = 0;
  auto a = start_node("node-a", "127.0.0.2", secret, pa);
  auto b = start_node("node-b", "127.0.0.3", secret, pb);
  collective_client_t* c = nullptr;
  REQUIRE(collective_connect(a->socket().c_str(), "rank 0", &c) == COLLECTIVE_OK);
  collective_unique_id_t id;
  REQUIRE(collective_get_unique_id(c, &id) == COLLECTIVE_OK);
  IdleRank idle(b->socket(), id);  // rank 1 joins through node-b and never submits
  collective_comm_t* comm = nullptr;
  REQUIRE(collective_comm_init_rank(c, &id, 2, 0, &comm) == COLLECTIVE_OK);
  void* buf = nullptr;
  REQUIRE(collective_host_alloc(c, 4096, &buf) == COLLECTIVE_OK);
  collective_request_t* req = nullptr;
  REQUIRE(collective_all_reduce(comm, buf, buf, 256, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &req) ==
          COLLECTIVE_OK);
  const std::string rank1 = "rank 1 (pid " + std::to_string(idle.child->pid()) + " on node-b)";
  std::string out;
  CHECK(eventually(
      [&] {
        out = ctl({"status", "--socket", b->socket()}).output;
        return has(out, rank1);
      },
      10s));
  INFO(out);
  CHECK(has(out, "all_reduce(count=256, dtype=float, op=sum), waited on by node node-a"));
  CHECK(has(out, "waiting"));
  // On node-a the operation runs (its rank arrived) and rank 1 is remote.
  const std::string comms = ctl({"comms", "--socket", a->socket()}).output;
  INFO(comms);
  CHECK(has(comms, "remote"));
  CHECK(has(comms, "node-b"));
  idle.child->kill(SIGKILL);
  idle.child->wait(10s);
  collective_request_free(req);
  collective_comm_abort(comm);  // frees it (LeakSanitizer found it left behind)
  collective_disconnect(c);
}

TEST_CASE("without a daemon: status fails with exit 2, doctor says the daemon is not running") {
  TempDir dir;
  const std::string sock = dir.file("nobody.sock");
  auto s = ctl({"status", "--socket", sock});
  CHECK(s.code == 2);
  CHECK(has(s.output, "no collectived listening on " + sock));
  auto sj = ctl({"status", "--json", "--socket", sock});
  CHECK(sj.code == 2);
  CHECK(has(sj.output, "{\"error\":"));

  const auto t0 = std::chrono::steady_clock::now();
  auto d = ctl({"doctor", "--socket", sock});
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(d.output);
  CHECK(d.exited);
  CHECK(d.code == 2);  // documented: a FAIL (the daemon) makes exit code 2
  CHECK(has(d.output, "FAIL  daemon"));
  CHECK(has(d.output, "not running: no collectived listening on " + sock));
  CHECK(has(d.output, "fix: start it"));
  CHECK(took < 10s);
  auto dj = ctl({"doctor", "--json", "--socket", sock});
  CHECK(dj.code == 2);
  CHECK(has(dj.output, "\"exit_code\":2"));
  CHECK(has(dj.output, "{\"check\":\"daemon\",\"verdict\":\"FAIL\""));
}

TEST_CASE("doctor on this machine with a daemon running: no GPU and no HCA are said clearly") {
  TempDir dir;
  Daemon d({.overrides = {"node.name=doctor-node"}});
  // The profile doctor reads: the daemon's socket and mode.
  const std::string profile = dir.file("node.yaml");
  write_file(profile, "node: {name: doctor-node}\nclient: {socket: " + d.socket() +
                          ", socket_mode: \"0666\"}\n");
  const auto t0 = std::chrono::steady_clock::now();
  auto r = ctl({"doctor", "--profile", profile});
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(r.output);
  CHECK(r.exited);
  CHECK(took < 15s);
  CHECK(has(r.output, "PASS  profile"));
  CHECK(has(r.output, "PASS  daemon"));
  CHECK(has(r.output, "collectived 0.1.0 on doctor-node (pid " + std::to_string(d.pid()) + ")"));
  CHECK(has(r.output, "PASS  socket"));
  CHECK(has(r.output, "mode 0666"));
  // Every line is PASS, WARN, FAIL or SKIP, and the exit code follows the worst.
  bool warn = false, fail = false;
  std::size_t pos = 0;
  while (pos < r.output.size()) {
    const std::size_t end = r.output.find('\n', pos);
    const std::string line = r.output.substr(pos, end - pos);
    pos = end == std::string::npos ? r.output.size() : end + 1;
    if (line.empty() || line[0] == ' ') continue;
    if (line.rfind("0", 0) == 0 || std::isdigit(static_cast<unsigned char>(line[0]))) continue;
    const std::string v = line.substr(0, 4);
    CHECK((v == "PASS" || v == "WARN" || v == "FAIL" || v == "SKIP"));
    warn = warn || v == "WARN";
    fail = fail || v == "FAIL";
  }
  CHECK(r.code == (fail ? 2 : warn ? 1 : 0));
  if (!machine_has_hca()) {
    CHECK(has(r.output, "WARN  hca"));
    CHECK(has(r.output, "no RDMA device on this node"));
  }
  if (!machine_has_gpu()) {
    CHECK(has(r.output, "WARN  cuda"));
    CHECK(has(r.output, "no GPU on this node"));
    CHECK(has(r.output, "SKIP  gpudirect rdma"));
    CHECK(has(r.output, "off: no GPU"));
  }
  if (!machine_has_hca() && !machine_has_gpu()) {
    CHECK(r.code == 1);  // warnings only: the documented code for a node without GPU and HCA
  }
}

TEST_CASE("doctor pings every peer daemon of the profile: reachable, authenticated, RTT, skew") {
  TempDir dir;
  const std::string secret = make_secret(dir);
  std::uint16_t pa = 0, pb = 0;
  auto a = start_node("node-a", "127.0.0.2", secret, pa);
  auto b = start_node("node-b", "127.0.0.3", secret, pb);
  const std::string profile = dir.file("a.yaml");
  write_file(profile, "node: {name: node-a}\nclient: {socket: " + a->socket() +
                          ", socket_mode: \"0666\"}\npeer: {listen_address: 127.0.0.2, port: " +
                          std::to_string(pa) + ", secret_file: " + secret +
                          ", peers: [\"127.0.0.3:" + std::to_string(pb) + "\", \"127.0.0.4:" +
                          std::to_string(pb) + "\"]}\n");
  auto r = ctl({"doctor", "--profile", profile});
  INFO(r.output);
  CHECK(has(r.output, "PASS  secret"));
  CHECK(has(r.output, "PASS  peer 127.0.0.3:" + std::to_string(pb)));
  CHECK(has(r.output, "node node-b: reachable and authenticated, round trip"));
  CHECK(has(r.output, "FAIL  peer 127.0.0.4:" + std::to_string(pb)));  // nobody there
  CHECK(r.code == 2);
  // The peers table now lists node-b.
  auto p = ctl({"peers", "--socket", a->socket()});
  CHECK(has(p.output, "node-b"));
  CHECK(has(p.output, "ready"));
}

TEST_CASE("doctor: a libcufile.so.0 whose dependency is missing is a FAIL naming the dependency") {
  TempDir dir;
  // Only the library, not its dependency: what a GDS install missing libdl.so looks like.
  REQUIRE(run_program({"/bin/cp", FAKE_CUFILE, dir.file("libcufile.so.0")}, 10s).code == 0);
  auto r = run_program({COLLECTIVECTL_BIN, "doctor", "--socket", dir.file("none.sock")}, 30s,
                       {{"LD_LIBRARY_PATH", dir.path()}, {"COLLECTIVED_SOCKET", ""}});
  INFO(r.output);
  CHECK(has(r.output, "FAIL  gds"));
  CHECK(has(r.output, "libcufile.so.0 is installed but does not load"));
  CHECK(has(r.output, "libctl_missing_dep.so: cannot open shared object file"));
  CHECK(has(r.output, "fix: install the library the message names"));
  CHECK(r.code == 2);
}

TEST_CASE("doctor and status against a daemon that stopped answering finish within the timeout") {
  Daemon d;
  d.signal(SIGSTOP);  // a wedged event loop, as far as clients can tell
  const auto t0 = std::chrono::steady_clock::now();
  auto r = ctl({"doctor", "--socket", d.socket(), "--timeout-ms", "500"});
  const auto took = std::chrono::steady_clock::now() - t0;
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK(has(r.output, "FAIL  daemon"));
  CHECK(has(r.output, "not answering within 500 ms"));
  CHECK(took < 10s);
  auto s = ctl({"status", "--socket", d.socket(), "--timeout-ms", "500"});
  CHECK(s.code == 2);
  d.signal(SIGCONT);
}

TEST_CASE("profile check: valid, invalid with file:line:column: key, JSON") {
  TempDir dir;
  const std::string good = dir.file("good.yaml");
  write_file(good, "node: {name: n1}\ndeadlines:\n  operation_ms: 1000\n");
  auto g = ctl({"profile", "check", good});
  CHECK(g.code == 0);
  CHECK(has(g.output, good + ": valid (node n1"));
  const std::string bad = dir.file("bad.yaml");
  write_file(bad, "deadlines:\n  operaton_ms: 1000\n");
  auto b = ctl({"profile", "check", bad});
  CHECK(b.code == 2);
  CHECK(has(b.output, bad + ":2:3: deadlines.operaton_ms: unknown key (did you mean "
                            "'deadlines.operation_ms'?)"));
  auto bj = ctl({"profile", "check", "--json", bad});
  CHECK(bj.code == 2);
  CHECK(has(bj.output, "\"valid\":false"));
  CHECK(has(bj.output, "\"line\":2,\"column\":3,\"key\":\"deadlines.operaton_ms\""));
  auto o = ctl({"profile", "check", good, "--set", "metrics.listen=nowhere"});
  CHECK(o.code == 2);
  CHECK(has(o.output, "metrics.listen"));
}

TEST_CASE("usage: --help documents the exit codes; unknown commands exit 64") {
  auto h = ctl({"--help"});
  CHECK(h.code == 0);
  CHECK(has(h.output, "exit codes:"));
  CHECK(has(h.output, "64  bad command line"));
  CHECK(ctl({"frobnicate"}).code == 64);
  CHECK(ctl({"status", "--bogus"}).code == 64);
  CHECK(has(ctl({"version"}).output, "collectivectl 0.1.0"));
}
