// fault_client: one kind of fault injected N times into a running daemon,
// through real client processes (scripts/faults drives it).
//
//   fault_client KIND --socket S --daemon-pid P --runs N --deadline-ms D
//
// Kinds:
//   kill-client  a client holding registrations, a communicator and a
//                submitted operation is killed with SIGKILL.
//   kill-rank    rank 1 of a 2-rank communicator is killed (SIGKILL) while
//                rank 0 waits in an all-reduce: rank 0 must fail at once (well
//                before the operation deadline) with an error naming rank 1
//                and its pid.
//   stop-rank    rank 1 is stopped (SIGSTOP: stuck, not dead) while rank 0
//                waits: rank 0 must fail with a timeout naming rank 1 no later
//                than the operation deadline (plus 1 s of sweep and
//                scheduling slack).
// Peer kinds (this program starts two daemons itself, node0 on 127.0.0.22 and
// node1 on 127.0.0.23 with a shared secret; --socket/--daemon-pid unused):
//   kill-peer    rank 0 (node0) waits in an all-reduce with rank 1 (node1);
//                node1's daemon is killed with SIGKILL: rank 0 must fail within
//                the operation deadline with an error naming node1; node1's
//                daemon is restarted on its port and must serve a new
//                communicator spanning both nodes.
//   cut-peer     as kill-peer, but the TCP connections between the daemons are
//                cut (ss -K destroys both ends: loopback only) instead: rank 0
//                must fail naming node1, and rank 1's next operation naming
//                node0, each within the deadline; then a new communicator
//                across both nodes must work (the daemons reconnect).
//                Both daemons stay up.
// After each run: the daemon is alive, and (within 3 s) the status request
// shows no registrations, communicators or operations in flight, one client
// (this program), and the daemon's descriptors (/proc/P/fd and status) are
// back to their number before the first run (a restarted node1: as many as
// node1 had before the first run); for the peer kinds, on node0
// (and on node1 for cut-peer) also the peer table: one peer, ready, with the
// same number of TCP streams as before.
// Prints "KIND: survived X/N" and exits 0 only if every run passed.
// nodes.h (the Node helper) includes doctest; this is no doctest program:
// its assertion macros compile to nothing here and no test registry is linked.
#define DOCTEST_CONFIG_DISABLE
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "client/collective.h"
#include "tests/support/harness.h"
#include "tests/support/nodes.h"

using namespace collectived;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

struct Args {
  std::string kind, socket;
  pid_t daemon_pid = 0;
  int runs = 100;
  int deadline_ms = 2000;
};

struct Snapshot {
  std::uint32_t clients = 0, registrations = 0, communicators = 0, in_flight = 0, fds_status = 0;
  std::size_t fds_proc = 0;
  std::uint32_t peers = 0, peers_ready = 0, streams = 0;  // the peer table
  std::string text() const {
    return "clients=" + std::to_string(clients) + " registrations=" + std::to_string(registrations) +
           " communicators=" + std::to_string(communicators) + " in_flight=" +
           std::to_string(in_flight) + " fds=" + std::to_string(fds_proc) + "/" +
           std::to_string(fds_status) + " peers=" + std::to_string(peers) + " ready=" +
           std::to_string(peers_ready) + " streams=" + std::to_string(streams);
  }
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const std::string& socket, pid_t daemon_pid) {
  Snapshot s;
  test::RawClient raw(socket);
  raw.hello();
  auto f = raw.status();
  if (!f || !f->message().isStatusReply()) return s;
  auto r = f->message().getStatusReply();
  s.clients = r.getClients().size();
  s.registrations = r.getRegistrations();
  s.communicators = r.getCommunicators();
  s.in_flight = r.getOperationsInFlight();
  s.fds_status = r.getOpenDescriptors();
  for (auto p : r.getPeers()) {
    ++s.peers;
    if (p.getState() == wire::PeerLinkState::READY) {
      ++s.peers_ready;
      s.streams += p.getStreams();
    }
  }
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(daemon_pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); ++it) {
    ++s.fds_proc;
  }
  return s;
}

/// A pipe a child writes one byte to when it is ready.
struct Ready {
  int fd[2];
  Ready() {
    if (::pipe2(fd, O_CLOEXEC) != 0) std::abort();
  }
  ~Ready() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
  void signal() { (void)!::write(fd[1], "r", 1); }
  bool wait(std::chrono::milliseconds timeout) {
    pollfd p{fd[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return false;
    char c;
    return ::read(fd[0], &c, 1) == 1;
  }
};

bool join(const std::string& socket, const collective_unique_id_t& id, int n, int rank,
          collective_client_t** c, collective_comm_t** comm, float** buf, std::size_t count) {
  if (collective_connect(socket.c_str(), ("fault rank " + std::to_string(rank)).c_str(), c) != COLLECTIVE_OK)
    return false;
  if (collective_host_alloc(*c, count * sizeof(float), reinterpret_cast<void**>(buf)) != COLLECTIVE_OK)
    return false;
  return collective_comm_init_rank(*c, &id, n, rank, comm) == COLLECTIVE_OK;
}

collective_unique_id_t new_id(const std::string& socket) {
  collective_client_t* c = nullptr;
  collective_unique_id_t id{};
  if (collective_connect(socket.c_str(), "fault launcher", &c) != COLLECTIVE_OK ||
      collective_get_unique_id(c, &id) != COLLECTIVE_OK) {
    std::fprintf(stderr, "launcher: %s\n", collective_last_error());
    std::exit(1);
  }
  collective_disconnect(c);
  return id;
}

// One run; returns an empty string if it passed, else why not.
std::string run_once(const Args& a, int run) {
  constexpr std::size_t kCount = 1 << 16;
  if (a.kind == "kill-client") {
    Ready ready;
    const collective_unique_id_t id = new_id(a.socket);
    test::Child victim([&] {
      collective_client_t* c;
      collective_comm_t* comm;
      float* buf;
      if (!join(a.socket, id, 1, 0, &c, &comm, &buf, kCount)) return 1;
      void* more[3];
      for (auto*& p : more) collective_host_alloc(c, 4096, &p);
      collective_request_t* req;
      collective_all_reduce(comm, buf, buf, kCount, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &req);
      ready.signal();
      for (;;) ::pause();
    });
    if (!ready.wait(10s)) return "the client never got ready";
    std::this_thread::sleep_for(std::chrono::microseconds(run % 7 * 300));
    victim.kill(SIGKILL);
    victim.wait(5s);
    return "";
  }
  // kill-rank / stop-rank: rank 1 is the victim, rank 0 reports what it saw.
  const bool stop = a.kind == "stop-rank";
  Ready ready1, ready0;
  const collective_unique_id_t id = new_id(a.socket);
  test::Child victim([&] {
    collective_client_t* c;
    collective_comm_t* comm;
    float* buf;
    if (!join(a.socket, id, 2, 1, &c, &comm, &buf, kCount)) return 1;
    ready1.signal();
    for (;;) ::pause();  // never submits: rank 0 waits for it
  });
  const pid_t victim_pid = victim.pid();
  int pipe_fd[2];
  if (::pipe2(pipe_fd, O_CLOEXEC) != 0) std::abort();
  test::Child survivor([&] {
    ::close(pipe_fd[0]);
    collective_client_t* c;
    collective_comm_t* comm;
    float* buf;
    auto say = [&](const std::string& s) {
      (void)!::write(pipe_fd[1], s.data(), s.size());
      return 0;
    };
    if (!join(a.socket, id, 2, 0, &c, &comm, &buf, kCount)) return say(std::string("join: ") + collective_last_error());
    collective_request_t* req;
    if (collective_all_reduce(comm, buf, buf, kCount, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &req) != COLLECTIVE_OK)
      return say(std::string("submit: ") + collective_last_error());
    ready0.signal();
    const auto t0 = Clock::now();
    const collective_result_t rc = collective_wait(req, a.deadline_ms * 3);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    const std::string msg = collective_last_error();
    return say(std::to_string(rc) + " " + std::to_string(ms) + " " + msg);
  });
  ::close(pipe_fd[1]);
  if (!ready1.wait(10s) || !ready0.wait(10s)) {
    ::close(pipe_fd[0]);
    victim.kill(SIGKILL);
    return "the ranks never got ready";
  }
  std::this_thread::sleep_for(std::chrono::microseconds(run % 5 * 1000));
  victim.kill(stop ? SIGSTOP : SIGKILL);
  auto st = survivor.wait(std::chrono::milliseconds(a.deadline_ms * 4 + 5000));
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(pipe_fd[0], buf, sizeof buf)) > 0) out.append(buf, n);
  ::close(pipe_fd[0]);
  victim.kill(SIGKILL);
  victim.wait(5s);
  if (!st.exited) return "rank 0 did not finish (hung)";
  int rc = -1;
  long ms = -1;
  char text[4096] = {};
  if (std::sscanf(out.c_str(), "%d %ld %4095[^\n]", &rc, &ms, text) < 2) return "rank 0: " + out;
  const std::string msg = text;
  const std::string rank_named = "rank 1";
  const std::string pid_named = std::to_string(victim_pid);
  if (stop) {
    if (rc != COLLECTIVE_TIMEOUT) return "stopped rank: expected a timeout, got " + out;
    if (ms > a.deadline_ms + 1000) return "stopped rank: answered after " + std::to_string(ms) + " ms";
    if (msg.find(rank_named) == std::string::npos) return "stopped rank not named: " + msg;
  } else {
    if (rc != COLLECTIVE_REMOTE_ERROR) return "killed rank: expected a remote error, got " + out;
    if (ms > a.deadline_ms / 2) return "killed rank: noticed only after " + std::to_string(ms) + " ms";
    if (msg.find(rank_named) == std::string::npos || msg.find(pid_named) == std::string::npos)
      return "killed rank (pid " + pid_named + ") not named: " + msg;
  }
  return "";
}

// --- Peer kinds: two daemons standing for two nodes ---------------------------

/// The peer kinds' daemons log at FAULT_LOG_LEVEL (debug by default: a failed
/// run prints what both daemons logged during it).
std::string log_level() {
  const char* v = std::getenv("FAULT_LOG_LEVEL");
  return v && *v ? v : "debug";
}

/// The daemon's open descriptors, one "fd -> target" per line (to tell a leak
/// from a connection).
std::string fd_list(pid_t pid) {
  std::string out;
  std::error_code ec;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  for (auto it = std::filesystem::directory_iterator(dir, ec);
       !ec && it != std::filesystem::directory_iterator(); ++it) {
    std::error_code ec2;
    out += "    " + it->path().filename().string() + " -> " +
           std::filesystem::read_symlink(it->path(), ec2).string() + "\n";
  }
  return out;
}

/// node0 on 127.0.0.22 and node1 on 127.0.0.23 (addresses no other test uses),
/// one cluster secret, heartbeats every 200 ms.
struct Cluster {
  test::TempDir dir;
  std::vector<test::Node> nodes;
  explicit Cluster(int deadline_ms) {
    const std::string secret = test::write_secret(dir, "secret", "fault injection secret\n");
    for (int i = 0; i < 2; ++i) {
      test::Node n;
      n.name = "node" + std::to_string(i);
      n.ip = "127.0.0." + std::to_string(22 + i);
      n.secret_file = secret;
      n.extra = {"log.level=" + log_level(), "deadlines.operation_ms=" + std::to_string(deadline_ms),
                 "client.allowed_uids=[" + std::to_string(::getuid()) + "]"};
      nodes.push_back(std::move(n));
    }
    for (auto& n : nodes) n.start();
  }
  const std::string& socket(int i) const { return nodes[i].daemon->socket(); }
  pid_t pid(int i) const { return nodes[i].daemon->pid(); }
  Snapshot snap(int i) const { return snapshot(socket(i), pid(i)); }

  // What each daemon logged during one run, printed when the run fails.
  std::size_t log_mark[2] = {0, 0};
  std::string killed_log;  // node1's log up to its SIGKILL (kill-peer)
  void mark_logs() {
    for (int i = 0; i < 2; ++i) log_mark[i] = nodes[i].daemon ? nodes[i].daemon->log().size() : 0;
    killed_log.clear();
  }
  std::string run_log(int i) const {
    if (!nodes[i].daemon) return "";
    const std::string all = nodes[i].daemon->log();
    return log_mark[i] <= all.size() ? all.substr(log_mark[i]) : all;
  }
  /// node1 is about to be replaced: keep what it logged in this run.
  void keep_killed_log() {
    killed_log = run_log(1);
    log_mark[1] = 0;
  }
  std::string run_logs() const {
    std::string out;
    const auto add = [&](const std::string& title, const std::string& text) {
      out += "  --- " + title + " (" + std::to_string(text.size()) + " bytes)\n" + text;
      if (!text.empty() && text.back() != '\n') out += '\n';
    };
    add("node0's log during the run", run_log(0));
    if (!killed_log.empty()) add("node1's log during the run, up to its SIGKILL", killed_log);
    add(killed_log.empty() ? "node1's log during the run" : "the restarted node1's log", run_log(1));
    return out;
  }
};

/// Destroys every TCP connection to either daemon's peer listener (both ends;
/// SOCK_DESTROY through `ss -K`, loopback addresses only). Returns how many
/// sockets it destroyed, or -1 if ss failed.
int cut_connections(const Cluster& cl) {
  std::string filter;
  for (const auto& n : cl.nodes) {
    const std::string ep = n.ip + ":" + std::to_string(n.port);
    filter += std::string(filter.empty() ? "" : " or ") + "dst " + ep + " or src " + ep;
  }
  const std::string cmd = "ss -K -t -n state established '( " + filter + " )' 2>&1";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) return -1;
  int sockets = 0;
  char line[512];
  while (std::fgets(line, sizeof line, f)) {
    if (std::strstr(line, "127.0.0.")) ++sockets;
  }
  return ::pclose(f) == 0 ? sockets : -1;
}

/// A child's one-line answer "rc ms message" through a pipe.
struct Answer {
  int fd[2];
  Answer() {
    if (::pipe2(fd, O_CLOEXEC) != 0) std::abort();
  }
  ~Answer() {
    ::close(fd[0]);
    if (fd[1] >= 0) ::close(fd[1]);
  }
  int say(const std::string& s) {
    (void)!::write(fd[1], s.data(), s.size());
    return 0;
  }
  void parent_side() {
    ::close(fd[1]);
    fd[1] = -1;
  }
  std::string read() {
    std::string out;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fd[0], buf, sizeof buf)) > 0) out.append(buf, n);
    return out;
  }
};

struct Outcome {
  int rc = -1;
  long ms = -1;
  std::string msg, raw;
  bool parse(const std::string& out) {
    raw = out;
    char text[4096] = {};
    if (std::sscanf(out.c_str(), "%d %ld %4095[^\n]", &rc, &ms, text) < 2) return false;
    msg = text;
    return true;
  }
};

/// Submits an all-reduce of `count` floats and waits (up to 3 deadlines);
/// returns "rc ms message".
std::string timed_all_reduce(collective_comm_t* comm, float* buf, std::size_t count, int deadline_ms) {
  collective_request_t* req = nullptr;
  const auto t0 = Clock::now();
  collective_result_t rc =
      collective_all_reduce(comm, buf, buf, count, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &req);
  if (rc == COLLECTIVE_OK) rc = collective_wait(req, deadline_ms * 3);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  const std::string msg = collective_last_error();
  collective_request_free(req);
  return std::to_string(rc) + " " + std::to_string(ms) + " " + msg;
}

/// Fills with rank + 1, all-reduces, checks the sum (1 + 2 = 3 everywhere).
bool checked_all_reduce(collective_comm_t* comm, float* buf, std::size_t count, int rank) {
  for (std::size_t i = 0; i < count; ++i) buf[i] = static_cast<float>(rank + 1);
  collective_request_t* req = nullptr;
  collective_result_t rc =
      collective_all_reduce(comm, buf, buf, count, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &req);
  if (rc == COLLECTIVE_OK) rc = collective_wait(req, 20000);
  collective_request_free(req);
  if (rc != COLLECTIVE_OK) return false;
  for (std::size_t i = 0; i < count; ++i) {
    if (buf[i] != 3.0f) return false;
  }
  return true;
}

/// A new communicator with rank 0 on node0 and rank 1 on node1: one checked
/// all-reduce, destroyed. Empty if it worked.
std::string serve_check(const Cluster& cl) {
  const collective_unique_id_t id = new_id(cl.socket(0));
  std::vector<std::unique_ptr<test::Child>> ranks;
  Answer said[2];
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<test::Child>([&, r] {
      ::close(said[1 - r].fd[1]);
      collective_client_t* c;
      collective_comm_t* comm;
      float* buf;
      const auto t0 = Clock::now();
      const auto fail = [&](const char* step, int code) {
        const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
        said[r].say(std::string(step) + " after " + std::to_string(ms) + " ms: " + collective_last_error());
        return code;
      };
      if (!join(cl.socket(r), id, 2, r, &c, &comm, &buf, 4096)) return fail("join", 1);
      if (!checked_all_reduce(comm, buf, 4096, r)) return fail("all-reduce", 2);
      collective_comm_destroy(comm);
      collective_disconnect(c);
      return 0;
    }));
  }
  for (auto& a : said) a.parent_side();
  std::string why;
  for (int r = 0; r < 2; ++r) {
    auto st = ranks[r]->wait(30s);
    if (!st.exited || st.code != 0) {
      why += "rank " + std::to_string(r) + (st.exited ? " exit " + std::to_string(st.code) : " hung or killed");
      ranks[r]->kill(SIGKILL);
      ranks[r]->wait(5s);
      const std::string text = said[r].read();
      why += (text.empty() ? std::string() : " (" + text + ")") + "; ";
    }
  }
  return why.empty() ? "" : "a new communicator across both nodes failed: " + why;
}

std::string run_peer_once(const Args& a, Cluster& cl, int run) {
  constexpr std::size_t kCount = 1 << 16;
  const bool cut = a.kind == "cut-peer";
  Ready ready0, ready1, go1;
  Answer ans0, ans1;
  const collective_unique_id_t id = new_id(cl.socket(0));
  // Rank 1 on node1: one all-reduce with rank 0 (the link is up and used),
  // then nothing until told (cut-peer: its next operation must fail).
  test::Child rank1([&] {
    ::close(ans0.fd[1]);  // rank 0's answer reaches EOF when rank 0 exits
    collective_client_t* c;
    collective_comm_t* comm;
    float* buf;
    if (!join(cl.socket(1), id, 2, 1, &c, &comm, &buf, kCount)) return ans1.say("-1 0 join: " + std::string(collective_last_error()));
    if (!checked_all_reduce(comm, buf, kCount, 1)) return ans1.say("-1 0 first all-reduce: " + std::string(collective_last_error()));
    ready1.signal();
    if (!go1.wait(std::chrono::milliseconds(a.deadline_ms * 6 + 10000))) return ans1.say("-1 0 never told to go");
    return ans1.say(timed_all_reduce(comm, buf, kCount, a.deadline_ms));
  });
  // Rank 0 on node0: the same first all-reduce, then a second one that waits
  // for rank 1 when the fault strikes.
  test::Child rank0([&] {
    ::close(ans1.fd[1]);
    collective_client_t* c;
    collective_comm_t* comm;
    float* buf;
    if (!join(cl.socket(0), id, 2, 0, &c, &comm, &buf, kCount)) return ans0.say("-1 0 join: " + std::string(collective_last_error()));
    if (!checked_all_reduce(comm, buf, kCount, 0)) return ans0.say("-1 0 first all-reduce: " + std::string(collective_last_error()));
    ready0.signal();
    return ans0.say(timed_all_reduce(comm, buf, kCount, a.deadline_ms));
  });
  ans0.parent_side();
  ans1.parent_side();
  if (!ready1.wait(20s) || !ready0.wait(20s)) {
    rank0.kill(SIGKILL);
    rank1.kill(SIGKILL);
    rank0.wait(5s);
    rank1.wait(5s);
    return "the ranks never got ready: rank 0: " + ans0.read() + "; rank 1: " + ans1.read();
  }
  std::this_thread::sleep_for(std::chrono::microseconds(run % 5 * 1000 + 20000));
  std::string why;
  if (cut) {
    const int n = cut_connections(cl);
    if (n <= 0) why = "ss -K destroyed no connection (" + std::to_string(n) + "): no SOCK_DESTROY in this kernel?";
  } else {
    cl.nodes[1].daemon->signal(SIGKILL);
  }
  auto check = [&](test::Child& rank, Answer& ans, const char* who, const std::string& culprit) {
    auto st = rank.wait(std::chrono::milliseconds(a.deadline_ms * 4 + 5000));
    Outcome o;
    if (!st.exited) return std::string(who) + " did not finish (hung)";
    if (!o.parse(ans.read())) return std::string(who) + ": " + o.raw;
    if (o.rc == COLLECTIVE_OK) return std::string(who) + ": the operation succeeded across the fault";
    if (o.ms > a.deadline_ms) return std::string(who) + ": answered after " + std::to_string(o.ms) + " ms: " + o.msg;
    if (o.msg.find(culprit) == std::string::npos) return std::string(who) + ": " + culprit + " not named: " + o.msg;
    return std::string();
  };
  if (why.empty()) why = check(rank0, ans0, "rank 0", "node1");
  if (cut) {
    go1.signal();
    if (why.empty()) why = check(rank1, ans1, "rank 1", "node0");
  }
  // Whichever rank was not waited for above (harmless for one that was:
  // Child::kill and wait do nothing once it has been reaped).
  rank0.kill(SIGKILL);
  rank1.kill(SIGKILL);
  rank0.wait(5s);
  rank1.wait(5s);
  if (!cut) {
    // The killed node comes back on its port.
    cl.nodes[1].daemon->wait(5s);
    cl.keep_killed_log();
    cl.nodes[1].daemon.reset();
    try {
      cl.nodes[1].start(true);
    } catch (const std::exception& e) {
      return why.empty() ? std::string("node1 did not restart: ") + e.what() : why;
    }
  }
  if (!cl.nodes[0].daemon->alive()) return "node0's daemon died";
  if (!cl.nodes[1].daemon->alive()) return "node1's daemon died";
  if (why.empty()) why = serve_check(cl);
  return why;
}

int peer_main(const Args& a) {
  std::unique_ptr<Cluster> cl;
  try {
    cl = std::make_unique<Cluster>(a.deadline_ms);
  } catch (const std::exception& e) {
    std::printf("%s: the daemons did not start: %s\n", a.kind.c_str(), e.what());
    return 1;
  }
  // The link up and used once, then the base line.
  if (std::string why = serve_check(*cl); !why.empty()) {
    std::printf("%s: before the first fault: %s\n", a.kind.c_str(), why.c_str());
    return 1;
  }
  Snapshot base0, base1;
  test::eventually([&] { return (base0 = cl->snap(0)).clients == 1 && base0.peers_ready == 1; }, 5s);
  test::eventually([&] { return (base1 = cl->snap(1)).clients == 1 && base1.peers_ready == 1; }, 5s);
  std::printf("%s: before: node0 %s; node1 %s\n", a.kind.c_str(), base0.text().c_str(), base1.text().c_str());
  int survived = 0;
  std::string last;
  for (int run = 0; run < a.runs; ++run) {
    const auto t0 = Clock::now();
    cl->mark_logs();
    std::string why = run_peer_once(a, *cl, run);
    if (!cl->nodes[0].daemon->alive()) {
      std::printf("%s: run %d: NODE0'S DAEMON DIED: %s\n", a.kind.c_str(), run, why.c_str());
      std::printf("%s\n", cl->nodes[0].daemon->log().c_str());
      break;
    }
    // node0 always, node1 when it was not restarted (a restarted daemon has
    // its own base line: no registrations or communicators, one peer).
    Snapshot now0, now1;
    const bool clean0 = test::eventually([&] { return (now0 = cl->snap(0)) == base0; }, 3s);
    bool clean1 = true;
    if (a.kind == "cut-peer") {
      clean1 = test::eventually([&] { return (now1 = cl->snap(1)) == base1; }, 3s);
    } else {
      clean1 = test::eventually([&] {
        now1 = cl->snap(1);
        // Its descriptors too: the daemon inherits none of ours (harness),
        // so a restarted node1 in the same state has as many as the first.
        return now1.registrations == 0 && now1.communicators == 0 && now1.in_flight == 0 &&
               now1.clients == 1 && now1.peers == 1 && now1.fds_proc == base1.fds_proc &&
               now1.fds_status == base1.fds_status;
      }, 3s);
    }
    if (why.empty() && !clean0) why = "leak on node0: " + now0.text() + " (before: " + base0.text() + ")";
    if (why.empty() && !clean1) why = "leak on node1: " + now1.text() + " (before: " + base1.text() + ")";
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    if (why.empty()) {
      ++survived;
    } else {
      std::printf("%s: run %d (%lld ms): %s\n%s", a.kind.c_str(), run, static_cast<long long>(ms),
                  why.c_str(), cl->run_logs().c_str());
      if (why.starts_with("leak")) {
        std::printf("  --- node0's descriptors\n%s  --- node1's descriptors\n%s",
                    fd_list(cl->pid(0)).c_str(), fd_list(cl->pid(1)).c_str());
      }
    }
    if (std::getenv("FAULT_VERBOSE")) {
      std::printf("%s: run %d: node0 %s; node1 %s\n", a.kind.c_str(), run, now0.text().c_str(),
                  now1.text().c_str());
      if (now1.fds_proc != base1.fds_proc) {
        std::printf("  --- node1's descriptors (%zu, %zu before)\n%s", now1.fds_proc, base1.fds_proc,
                    fd_list(cl->pid(1)).c_str());
      }
    }
    last = "node0 " + now0.text() + "; node1 " + now1.text();
  }
  std::printf("%s: survived %d/%d; after: %s\n", a.kind.c_str(), survived, a.runs, last.c_str());
  return survived == a.runs ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (argc < 2) return 2;
  a.kind = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--socket") a.socket = argv[i + 1];
    else if (k == "--daemon-pid") a.daemon_pid = std::atoi(argv[i + 1]);
    else if (k == "--runs") a.runs = std::atoi(argv[i + 1]);
    else if (k == "--deadline-ms") a.deadline_ms = std::atoi(argv[i + 1]);
  }
  const bool peer_kind = a.kind == "kill-peer" || a.kind == "cut-peer";
  if (a.kind != "kill-client" && a.kind != "kill-rank" && a.kind != "stop-rank" && !peer_kind) {
    std::fprintf(stderr, "usage: fault_client kill-client|kill-rank|stop-rank --socket S --daemon-pid P "
                         "[--runs N] [--deadline-ms D]\n"
                         "       fault_client kill-peer|cut-peer [--runs N] [--deadline-ms D]\n");
    return 2;
  }
  ::signal(SIGPIPE, SIG_IGN);
  if (peer_kind) return peer_main(a);
  const Snapshot base = snapshot(a.socket, a.daemon_pid);
  std::printf("%s: before: %s\n", a.kind.c_str(), base.text().c_str());
  int survived = 0;
  std::string last_state;
  for (int run = 0; run < a.runs; ++run) {
    std::string why = run_once(a, run);
    if (::kill(a.daemon_pid, 0) != 0) {
      std::printf("%s: run %d: THE DAEMON DIED\n", a.kind.c_str(), run);
      break;
    }
    Snapshot now;
    const bool clean = test::eventually([&] { return (now = snapshot(a.socket, a.daemon_pid)) == base; }, 3s);
    if (why.empty() && !clean) why = "leak: " + now.text() + " (before: " + base.text() + ")";
    if (why.empty()) {
      ++survived;
    } else {
      std::printf("%s: run %d: %s\n", a.kind.c_str(), run, why.c_str());
    }
    last_state = now.text();
  }
  std::printf("%s: survived %d/%d; after: %s\n", a.kind.c_str(), survived, a.runs, last_state.c_str());
  return survived == a.runs ? 0 : 1;
}
