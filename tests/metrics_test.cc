// The Prometheus endpoint of a real daemon, scraped over TCP and over a Unix
// socket while real clients run collectives: operations, bytes, latency
// histograms, errors (a timeout), connections, memory, the oldest operation.
#include <doctest/doctest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "client/collective.h"
#include "tests/support/harness.h"

using namespace collectived;
using namespace collectived::test;
using namespace std::chrono_literals;

namespace {

std::string metrics_address(const Daemon& d) {
  RawClient c(d.socket());
  c.hello();
  auto reply = c.status();
  REQUIRE(reply != nullptr);
  return reply->message().getStatusReply().getMetricsAddress().cStr();
}

/// One HTTP/1.0 GET; the whole response.
std::string http_get(const std::string& address, const std::string& path = "/metrics") {
  int fd = -1;
  if (address.front() == '/') {
    fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    std::snprintf(sa.sun_path, sizeof sa.sun_path, "%s", address.c_str());
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  } else {
    const auto colon = address.rfind(':');
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))));
    ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  REQUIRE(::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size()));
  std::string out;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  return out;
}

/// The value of the sample line starting with `series` ("name{labels}"), or -1.
double sample(const std::string& text, const std::string& series) {
  const std::size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::strtod(text.c_str() + at + 1 + series.size() + 1, nullptr);
}

struct Rank {
  collective_client_t* client = nullptr;
  collective_comm_t* comm = nullptr;
  float* buf = nullptr;
};

/// Two ranks in this process (two connections), joined to one communicator.
std::pair<Rank, Rank> two_ranks(const std::string& socket) {
  Rank a, b;
  REQUIRE(collective_connect(socket.c_str(), "rank 0", &a.client) == COLLECTIVE_OK);
  REQUIRE(collective_connect(socket.c_str(), "rank 1", &b.client) == COLLECTIVE_OK);
  collective_unique_id_t id;
  REQUIRE(collective_get_unique_id(a.client, &id) == COLLECTIVE_OK);
  std::thread t([&] { REQUIRE(collective_comm_init_rank(b.client, &id, 2, 1, &b.comm) == 0); });
  REQUIRE(collective_comm_init_rank(a.client, &id, 2, 0, &a.comm) == COLLECTIVE_OK);
  t.join();
  for (Rank* r : {&a, &b}) {
    void* p = nullptr;
    REQUIRE(collective_host_alloc(r->client, 1 << 20, &p) == COLLECTIVE_OK);
    r->buf = static_cast<float*>(p);
  }
  return {a, b};
}

void all_reduce_both(Rank& a, Rank& b, std::size_t count) {
  collective_request_t* ra = nullptr;
  collective_request_t* rb = nullptr;
  REQUIRE(collective_all_reduce(a.comm, a.buf, a.buf, count, COLLECTIVE_FLOAT32, COLLECTIVE_SUM,
                                &ra) == COLLECTIVE_OK);
  REQUIRE(collective_all_reduce(b.comm, b.buf, b.buf, count, COLLECTIVE_FLOAT32, COLLECTIVE_SUM,
                                &rb) == COLLECTIVE_OK);
  REQUIRE(collective_wait(ra, -1) == COLLECTIVE_OK);
  REQUIRE(collective_wait(rb, -1) == COLLECTIVE_OK);
  collective_request_free(ra);
  collective_request_free(rb);
}

}  // namespace

TEST_CASE("scraping a daemon over TCP: operations, bytes, latency, errors, connections, memory") {
  Daemon d({.overrides = {"metrics.listen=127.0.0.1:0", "deadlines.operation_ms=300"}});
  const std::string addr = metrics_address(d);
  REQUIRE(addr.rfind("127.0.0.1:", 0) == 0);
  CHECK(d.log().find("metrics=" + addr) != std::string::npos);

  std::string text = http_get(addr);
  INFO(text);
  CHECK(text.rfind("HTTP/1.0 200 OK\r\n", 0) == 0);
  CHECK(text.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
  CHECK(sample(text, "collectived_operations_total{op=\"all_reduce\",result=\"ok\"}") == 0);
  auto [a, b] = two_ranks(d.socket());
  for (int i = 0; i < 5; ++i) all_reduce_both(a, b, 1024);
  collective_request_t* qa = nullptr;
  collective_request_t* qb = nullptr;
  REQUIRE(collective_barrier(a.comm, &qa) == COLLECTIVE_OK);
  REQUIRE(collective_barrier(b.comm, &qb) == COLLECTIVE_OK);
  REQUIRE(collective_wait(qa, -1) == COLLECTIVE_OK);
  REQUIRE(collective_wait(qb, -1) == COLLECTIVE_OK);
  collective_request_free(qa);
  collective_request_free(qb);

  // A timeout: rank 0 submits, rank 1 never does.
  collective_request_t* stuck = nullptr;
  REQUIRE(collective_broadcast(a.comm, a.buf, a.buf, 16, COLLECTIVE_FLOAT32, 0, &stuck) ==
          COLLECTIVE_OK);
  // Its age counts from when the daemon took it, which may be after the
  // call returned (ASan on a loaded machine: 11 ms later): in flight first.
  CHECK(test::eventually([&] {
    return sample(http_get(addr), "collectived_operations_in_flight") == 1;
  }, 5s));
  ::usleep(100000);
  text = http_get(addr);
  CHECK(sample(text, "collectived_operations_in_flight") == 1);
  CHECK(sample(text, "collectived_oldest_operation_age_seconds") >= 0.09);
  CHECK(collective_wait(stuck, -1) == COLLECTIVE_TIMEOUT);
  collective_request_free(stuck);
  // The log line says what, who (rank, pid, node) and what to do.
  const std::string log = d.log();
  INFO(log);
  CHECK(log.find("event=operation_timeout") != std::string::npos);
  CHECK(log.find("missing=\"rank 1 (pid " + std::to_string(::getpid()) + ")\"") !=
        std::string::npos);
  CHECK(log.find("action=\"look at what the missing ranks") != std::string::npos);

  text = http_get(addr);
  CHECK(sample(text, "collectived_operations_total{op=\"all_reduce\",result=\"ok\"}") == 5);
  CHECK(sample(text, "collectived_operations_total{op=\"barrier\",result=\"ok\"}") == 1);
  CHECK(sample(text, "collectived_operations_total{op=\"broadcast\",result=\"timeout\"}") == 1);
  CHECK(sample(text, "collectived_operation_errors_total{op=\"broadcast\"}") == 1);
  CHECK(sample(text, "collectived_operation_bytes_total{op=\"all_reduce\"}") == 5 * 4096);
  CHECK(sample(text, "collectived_operation_duration_seconds_count{op=\"all_reduce\","
                     "transport=\"local\"}") == 5);
  CHECK(sample(text, "collectived_operation_duration_seconds_bucket{op=\"all_reduce\","
                     "transport=\"local\",le=\"+Inf\"}") == 5);
  CHECK(sample(text, "collectived_operation_duration_seconds_sum{op=\"all_reduce\","
                     "transport=\"local\"}") > 0);
  CHECK(sample(text, "collectived_operations_in_flight") == 0);
  CHECK(sample(text, "collectived_oldest_operation_age_seconds") == 0);
  CHECK(sample(text, "collectived_clients") >= 2);
  CHECK(sample(text, "collectived_clients_accepted_total") >= 3);
  CHECK(sample(text, "collectived_communicators") == 1);
  CHECK(sample(text, "collectived_registrations") == 2);
  CHECK(sample(text, "collectived_registered_bytes") == 2 << 20);
  CHECK(sample(text, "collectived_resident_bytes") > 0);
  CHECK(sample(text, "collectived_open_fds") > 0);

  CHECK(http_get(addr, "/other").rfind("HTTP/1.0 404", 0) == 0);
  collective_comm_destroy(a.comm);  // frees them (LeakSanitizer found them left behind)
  collective_comm_destroy(b.comm);
  collective_disconnect(a.client);
  collective_disconnect(b.client);
}

TEST_CASE("metrics on a Unix socket; the socket file goes with the daemon") {
  TempDir dir;
  const std::string path = dir.file("metrics.sock");
  auto d = std::make_unique<Daemon>(Daemon::Options{.overrides = {"metrics.listen=" + path}});
  CHECK(metrics_address(*d) == path);
  const std::string text = http_get(path);
  CHECK(text.rfind("HTTP/1.0 200 OK\r\n", 0) == 0);
  CHECK(text.find("collectived_build_info{") != std::string::npos);
  auto s = d->terminate(10s);
  CHECK(s.exited);
  CHECK(s.code == 0);
  CHECK(::access(path.c_str(), F_OK) != 0);
}

TEST_CASE("a metrics address that cannot be bound stops the daemon with the key named") {
  Daemon first({.overrides = {"metrics.listen=127.0.0.1:0"}});
  const std::string taken = metrics_address(first);
  Daemon::Options o;
  o.overrides = {"metrics.listen=" + taken};
  o.wait_ready = false;
  Daemon second(o);
  auto s = second.wait(10s);
  CHECK(s.exited);
  CHECK(s.code != 0);
  CHECK(second.log().find("metrics.listen") != std::string::npos);
  CHECK(second.log().find(taken) != std::string::npos);
}
