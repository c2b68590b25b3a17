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
// After each run: the daemon is alive, and (within 3 s) the status request
// shows no registrations, communicators or operations in flight, one client
// (this program), and the daemon's descriptors (/proc/P/fd and status) are
// back to their number before the first run.
// Prints "KIND: survived X/N" and exits 0 only if every run passed.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "client/collective.h"
#include "tests/support/harness.h"

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
  std::string text() const {
    return "clients=" + std::to_string(clients) + " registrations=" + std::to_string(registrations) +
           " communicators=" + std::to_string(communicators) + " in_flight=" +
           std::to_string(in_flight) + " fds=" + std::to_string(fds_proc) + "/" +
           std::to_string(fds_status);
  }
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const Args& a) {
  Snapshot s;
  test::RawClient raw(a.socket);
  raw.hello();
  auto f = raw.status();
  if (!f || !f->message().isStatusReply()) return s;
  auto r = f->message().getStatusReply();
  s.clients = r.getClients().size();
  s.registrations = r.getRegistrations();
  s.communicators = r.getCommunicators();
  s.in_flight = r.getOperationsInFlight();
  s.fds_status = r.getOpenDescriptors();
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(a.daemon_pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); ++it) {
    ++s.fds_proc;
  }
  return s;
}

/// A pipe a child writes one byte to when it is ready.
struct Ready {
  int fd[2];
  Ready() {
    if (::pipe(fd) != 0) std::abort();
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

bool join(const Args& a, const collective_unique_id_t& id, int n, int rank,
          collective_client_t** c, collective_comm_t** comm, float** buf, std::size_t count) {
  if (collective_connect(a.socket.c_str(), ("fault rank " + std::to_string(rank)).c_str(), c) != COLLECTIVE_OK)
    return false;
  if (collective_host_alloc(*c, count * sizeof(float), reinterpret_cast<void**>(buf)) != COLLECTIVE_OK)
    return false;
  return collective_comm_init_rank(*c, &id, n, rank, comm) == COLLECTIVE_OK;
}

collective_unique_id_t new_id(const Args& a) {
  collective_client_t* c = nullptr;
  collective_unique_id_t id{};
  if (collective_connect(a.socket.c_str(), "fault launcher", &c) != COLLECTIVE_OK ||
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
    const collective_unique_id_t id = new_id(a);
    test::Child victim([&] {
      collective_client_t* c;
      collective_comm_t* comm;
      float* buf;
      if (!join(a, id, 1, 0, &c, &comm, &buf, kCount)) return 1;
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
  const collective_unique_id_t id = new_id(a);
  test::Child victim([&] {
    collective_client_t* c;
    collective_comm_t* comm;
    float* buf;
    if (!join(a, id, 2, 1, &c, &comm, &buf, kCount)) return 1;
    ready1.signal();
    for (;;) ::pause();  // never submits: rank 0 waits for it
  });
  const pid_t victim_pid = victim.pid();
  int pipe_fd[2];
  if (::pipe(pipe_fd) != 0) std::abort();
  test::Child survivor([&] {
    ::close(pipe_fd[0]);
    collective_client_t* c;
    collective_comm_t* comm;
    float* buf;
    auto say = [&](const std::string& s) {
      (void)!::write(pipe_fd[1], s.data(), s.size());
      return 0;
    };
    if (!join(a, id, 2, 0, &c, &comm, &buf, kCount)) return say(std::string("join: ") + collective_last_error());
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
  if (a.kind != "kill-client" && a.kind != "kill-rank" && a.kind != "stop-rank") {
    std::fprintf(stderr, "usage: fault_client kill-client|kill-rank|stop-rank --socket S --daemon-pid P "
                         "[--runs N] [--deadline-ms D]\n");
    return 2;
  }
  ::signal(SIGPIPE, SIG_IGN);
  const Snapshot base = snapshot(a);
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
    const bool clean = test::eventually([&] { return (now = snapshot(a)) == base; }, 3s);
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
