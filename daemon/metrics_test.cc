#include "daemon/metrics.h"

#include <doctest/doctest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <capnp/message.h>
#include <cstdlib>
#include <string>
#include <thread>

using namespace collectived;
using namespace collectived::daemon;
namespace asio = boost::asio;

namespace {

bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

// A status as the server would fill it, with the fields metrics read.
struct Status {
  capnp::MallocMessageBuilder b;
  wire::StatusReply::Builder s = b.initRoot<wire::StatusReply>();
  Status() {
    s.setNodeName("node-a");
    s.setDaemonVersion("0.1.0");
    s.setProtocolVersion(1);
    s.setUptimeMs(2500);
    s.setRegisteredBytes(4096);
    s.setRegistrations(1);
    s.setResidentBytes(1 << 20);
    s.setCommunicators(1);
    s.setOperationsInFlight(1);
    s.initClients(2);
    auto comms = s.initComms(1);
    comms[0].setName("c1");
    auto ops = comms[0].initOperations(1);
    ops[0].setAgeMs(1500);
    auto peers = s.initPeers(1);
    peers[0].setAddress("127.0.0.2:47600");
    peers[0].setState(wire::PeerLinkState::READY);
    peers[0].setBytesSent(123);
    peers[0].setRttUs(250);
  }
};

// Runs an io_context on a thread for the lifetime of the object.
struct Loop {
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work = asio::make_work_guard(io);
  std::thread thread;
  void start() { thread = std::thread([this] { io.run(); }); }
  void stop() {
    work.reset();
    io.stop();
    if (thread.joinable()) thread.join();
  }
  ~Loop() { stop(); }
};

template <typename Protocol>
std::string http(const typename Protocol::endpoint& ep, const std::string& request) {
  asio::io_context io;
  typename Protocol::socket s(io);
  s.connect(ep);
  asio::write(s, asio::buffer(request));
  std::string out;
  boost::system::error_code ec;
  asio::read(s, asio::dynamic_buffer(out), ec);  // until the server closes
  return out;
}

}  // namespace

TEST_CASE("counters, histograms and gauges in the text exposition format") {
  Metrics m;
  using namespace std::chrono;
  m.operation_finished(engine::OpKind::all_reduce, Code::ok, 4096, microseconds(30), "local");
  m.operation_finished(engine::OpKind::all_reduce, Code::ok, 4096, milliseconds(3), "local");
  m.operation_finished(engine::OpKind::all_reduce, Code::timeout, 4096, seconds(30), "local");
  m.operation_finished(engine::OpKind::p2p, Code::ok, 100, microseconds(5), "tcp");
  m.client_accepted();
  m.client_accepted();
  m.client_refused();
  Status st;
  const std::string text = m.render(st.s.asReader());
  CHECK(has_line(text, "# TYPE collectived_operations_total counter"));
  CHECK(has_line(text, "collectived_operations_total{op=\"all_reduce\",result=\"ok\"} 2"));
  CHECK(has_line(text, "collectived_operations_total{op=\"all_reduce\",result=\"timeout\"} 1"));
  CHECK(has_line(text, "collectived_operations_total{op=\"broadcast\",result=\"ok\"} 0"));
  CHECK(text.find("op=\"broadcast\",result=\"timeout\"") == std::string::npos);
  CHECK(has_line(text, "collectived_operation_errors_total{op=\"all_reduce\"} 1"));
  CHECK(has_line(text, "collectived_operation_bytes_total{op=\"all_reduce\"} 8192"));
  CHECK(has_line(text, "# TYPE collectived_operation_duration_seconds histogram"));
  // 30 us falls in le=5e-05; 3 ms in le=0.005; buckets are cumulative.
  CHECK(has_line(text, "collectived_operation_duration_seconds_bucket{op=\"all_reduce\","
                       "transport=\"local\",le=\"2.5e-05\"} 0"));
  CHECK(has_line(text, "collectived_operation_duration_seconds_bucket{op=\"all_reduce\","
                       "transport=\"local\",le=\"5e-05\"} 1"));
  CHECK(has_line(text, "collectived_operation_duration_seconds_bucket{op=\"all_reduce\","
                       "transport=\"local\",le=\"0.005\"} 2"));
  CHECK(has_line(text, "collectived_operation_duration_seconds_bucket{op=\"all_reduce\","
                       "transport=\"local\",le=\"+Inf\"} 2"));
  CHECK(has_line(text, "collectived_operation_duration_seconds_count{op=\"all_reduce\","
                       "transport=\"local\"} 2"));
  CHECK(has_line(text, "collectived_operation_duration_seconds_sum{op=\"all_reduce\","
                       "transport=\"local\"} 0.00303"));
  CHECK(has_line(text, "collectived_operation_duration_seconds_count{op=\"p2p\","
                       "transport=\"tcp\"} 1"));
  CHECK(has_line(text, "collectived_clients 2"));
  CHECK(has_line(text, "collectived_clients_accepted_total 2"));
  CHECK(has_line(text, "collectived_clients_refused_total 1"));
  CHECK(has_line(text, "collectived_registered_bytes 4096"));
  CHECK(has_line(text, "collectived_oldest_operation_age_seconds 1.5"));
  CHECK(has_line(text, "collectived_peers{state=\"ready\"} 1"));
  CHECK(has_line(text, "collectived_peer_sent_bytes_total{peer=\"127.0.0.2:47600\"} 123"));
  CHECK(has_line(text, "collectived_peer_rtt_seconds{peer=\"127.0.0.2:47600\"} 0.00025"));
  CHECK(has_line(text, "collectived_build_info{node=\"node-a\",version=\"0.1.0\",protocol=\"1\"} 1"));
  // Every sample line belongs to a declared family (HELP and TYPE first).
  std::size_t pos = 0;
  std::string family;
  while (pos < text.size()) {
    const std::size_t end = text.find('\n', pos);
    REQUIRE(end != std::string::npos);
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.rfind("# TYPE ", 0) == 0) {
      family = line.substr(7, line.find(' ', 7) - 7);
    } else if (line[0] != '#') {
      INFO(line);
      CHECK((!family.empty() && line.rfind(family, 0) == 0));
    }
  }
}

TEST_CASE("the HTTP responder serves /metrics on TCP and on a Unix socket") {
  Loop loop;
  engine::Logger log(config::LogLevel::error);
  int renders = 0;
  MetricsServer server(loop.io, log, [&] {
    ++renders;
    return std::string("collectived_up 1\n");
  });
  server.listen("127.0.0.1:0", 0600);
  MetricsServer unix_server(loop.io, log, [] { return std::string("x 1\n"); });
  char dir[] = "/tmp/metrics-test-XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/metrics.sock";
  unix_server.listen(path, 0640);
  loop.start();
  const std::string addr = server.address();
  REQUIRE(addr.rfind("127.0.0.1:", 0) == 0);
  const auto port = static_cast<unsigned short>(std::stoul(addr.substr(addr.rfind(':') + 1)));
  const asio::ip::tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), port);

  std::string reply = http<asio::ip::tcp>(ep, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
  CHECK(reply.rfind("HTTP/1.0 200 OK\r\n", 0) == 0);
  CHECK(reply.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
  CHECK(reply.find("Content-Length: 17\r\n") != std::string::npos);
  CHECK(reply.substr(reply.size() - 17) == "collectived_up 1\n");

  reply = http<asio::ip::tcp>(ep, "GET /nope HTTP/1.1\r\n\r\n");
  CHECK(reply.rfind("HTTP/1.0 404 Not Found\r\n", 0) == 0);
  reply = http<asio::ip::tcp>(ep, "POST /metrics HTTP/1.0\r\n\r\n");
  CHECK(reply.rfind("HTTP/1.0 405", 0) == 0);
  // A header block past 8 KiB is refused, and the server keeps serving.
  reply = http<asio::ip::tcp>(ep, "GET /metrics HTTP/1.0\r\nX: " + std::string(10000, 'a') +
                                      "\r\n\r\n");
  CHECK(reply.rfind("HTTP/1.0 400", 0) == 0);
  reply = http<asio::ip::tcp>(ep, "GET /metrics HTTP/1.0\r\n\r\n");
  CHECK(reply.rfind("HTTP/1.0 200 OK\r\n", 0) == 0);
  CHECK(renders == 2);

  CHECK(unix_server.address() == path);
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0640);
  reply = http<asio::local::stream_protocol>(asio::local::stream_protocol::endpoint(path),
                                             "GET /metrics HTTP/1.0\r\n\r\n");
  CHECK(reply.rfind("HTTP/1.0 200 OK\r\n", 0) == 0);
  loop.stop();
  unix_server.close();
  CHECK(::access(path.c_str(), F_OK) != 0);  // the socket file is removed
  ::rmdir(dir);
  server.close();
}

TEST_CASE("listen errors name the address and the profile key") {
  asio::io_context io;
  engine::Logger log(config::LogLevel::error);
  MetricsServer a(io, log, [] { return std::string(); });
  a.listen("127.0.0.1:0", 0600);
  MetricsServer b(io, log, [] { return std::string(); });
  try {
    b.listen(a.address(), 0600);
    FAIL("a second listener on the same port must fail");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find(a.address()) != std::string::npos);
    CHECK(std::string(e.what()).find("metrics.listen") != std::string::npos);
  }
}
