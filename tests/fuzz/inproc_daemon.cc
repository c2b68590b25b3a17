#include "tests/fuzz/inproc_daemon.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "config/profile.h"
#include "daemon/server.h"
#include "engine/log.h"
#include "ipc/error.h"
#include "ipc/frame.h"

namespace collectived::fuzz {
namespace {

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "fuzz harness: %s: %s\n", what, std::strerror(errno));
  std::abort();
}

std::uint16_t free_port() {
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    die("bind 127.0.0.1:0");
  }
  return ntohs(a.sin_port);
}

InprocDaemon* start() {
  std::signal(SIGPIPE, SIG_IGN);
  auto* d = new InprocDaemon;
  char tmpl[] = "/tmp/cdfuzz.XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) die("mkdtemp");
  d->dir = tmpl;
  d->socket = d->dir + "/cd.sock";
  d->peer_port = free_port();
  d->secret = std::string(32, 'k');
  const std::string secret_file = d->dir + "/secret";
  std::ofstream(secret_file) << d->secret;
  ::chmod(secret_file.c_str(), 0600);
  // Short deadlines so that inputs which leave work pending (a rendezvous
  // missing ranks, an operation never matched) are answered quickly.
  const std::vector<std::string> overrides = {
      "node.name=fuzz",
      "client.socket=" + d->socket,
      "client.allowed_uids=[" + std::to_string(::getuid()) + "]",
      "client.max_clients=1024",
      "peer.listen_address=127.0.0.1",
      "peer.port=" + std::to_string(d->peer_port),
      "peer.secret_file=" + secret_file,
      "deadlines.operation_ms=200",
      "deadlines.rendezvous_ms=200",
      "deadlines.client_request_ms=500",
      "deadlines.connect_ms=500",
      "workers.threads=2",
      // COLLECTIVED_FUZZ_LOG=debug shows what the daemon makes of the inputs.
      std::string("log.level=") +
          (std::getenv("COLLECTIVED_FUZZ_LOG") ? std::getenv("COLLECTIVED_FUZZ_LOG") : "error"),
  };
  config::Profile profile = config::load_profile_text("fuzz", "", overrides);
  // Leaked on purpose: the server lives until the process exits.
  auto* log = new engine::Logger(profile.log.level);
  auto* server = new daemon::Server(profile, {"", overrides}, *log);
  server->listen();
  d->rendezvous = server->rendezvous_address();
  d->max_frame_bytes = profile.client.max_frame_bytes;
  std::thread([server] { server->run(); }).detach();
  return d;
}

}  // namespace

const InprocDaemon& daemon() {
  static InprocDaemon* d = start();
  return *d;
}

UniqueFd connect_unix(const std::string& path) {
  UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  for (int i = 0; i < 200; ++i) {
    if (::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  die("connect to the in-process daemon");
}

UniqueFd connect_tcp(std::uint16_t port) {
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int i = 0; i < 200; ++i) {
    if (::connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  die("connect to the in-process daemon's peer port");
}

bool send_all(int fd, std::span<const std::byte> bytes, std::span<const int> fds) {
  // The daemon's own sender (descriptors with the first byte, EINTR and
  // partial writes handled). It refuses more than kMaxFdsPerFrame descriptors:
  // the rest are not sent; a header that announces more is still refused by
  // the daemon from the header alone.
  if (fds.size() > ipc::kMaxFdsPerFrame) fds = fds.first(ipc::kMaxFdsPerFrame);
  try {
    ipc::send_frame(fd, bytes, fds, std::chrono::steady_clock::now() + std::chrono::seconds(30));
    return true;
  } catch (const Error& e) {
    if (e.code() == Code::unavailable) return false;  // the daemon closed the connection
    std::fprintf(stderr, "fuzz harness: sending to the in-process daemon: %s\n", e.what());
    std::abort();
  }
}

void drain_until_closed(int fd, int seconds) {
  ::shutdown(fd, SHUT_WR);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  char buf[65536];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) {
      std::fprintf(stderr, "the daemon did not close the connection within %d s of EOF\n",
                   seconds);
      std::abort();
    }
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(left));
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) return;
    if (n < 0 && errno != EAGAIN && errno != EINTR) return;  // reset: closed too
  }
}

}  // namespace collectived::fuzz
