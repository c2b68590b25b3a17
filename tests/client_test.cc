// libcollective against a real daemon: the C and C++ APIs, thread safety,
// error messages.
#include <doctest/doctest.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "client/collective.hpp"
#include "tests/support/harness.h"

using namespace collectived::test;
using namespace std::chrono_literals;

TEST_CASE("connecting to a socket with no daemon says so and names the path") {
  TempDir dir;
  collective_client_t* c = nullptr;
  const std::string path = dir.file("nobody-home.sock");
  CHECK(collective_connect(path.c_str(), nullptr, &c) == COLLECTIVE_UNAVAILABLE);
  CHECK(c == nullptr);
  const std::string msg = collective_last_error();
  CHECK(msg.find("no collectived listening on " + path) != std::string::npos);
  CHECK(std::string(collective_result_string(COLLECTIVE_UNAVAILABLE)) == "unavailable");
}

TEST_CASE("host buffers are shared with the daemon and released on free and on disconnect") {
  Daemon d;
  collective::Client client(d.socket().c_str(), "client_test");
  auto* a = static_cast<char*>(client.host_alloc(100));  // rounded up to a page
  auto* b = static_cast<char*>(client.host_alloc(3 << 20));
  std::memset(a, 1, 100);
  std::memset(b, 2, 3 << 20);
  auto s = client.status();
  CHECK(s.registrations == 2);
  CHECK(s.registered_bytes == 4096 + (3 << 20));
  CHECK(s.clients == 1);

  std::uint64_t handle = 0, offset = 0;
  CHECK(collective_host_lookup(client.get(), b + 12345, &handle, &offset) == COLLECTIVE_OK);
  CHECK(offset == 12345);
  CHECK(collective_host_lookup(client.get(), &handle, &handle, &offset) == COLLECTIVE_NOT_FOUND);

  client.host_free(a);
  CHECK(client.status().registrations == 1);
  CHECK_THROWS_AS(client.host_free(a), collective::Error);  // double free is an error, not UB

  {
    collective::Client other(d.socket().c_str(), "other");
    other.host_alloc(4096);
    CHECK(other.status().registrations == 2);
    CHECK(other.status().clients == 2);
  }  // disconnect releases the other client's buffer
  CHECK(eventually([&] { return client.status().registrations == 1; }, 5s));
}

TEST_CASE("one client used from many threads at once") {
  Daemon d;
  collective::Client client(d.socket().c_str(), "threads");
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      try {
        for (int i = 0; i < 50; ++i) {
          void* p = client.host_alloc(4096 * (1 + (t + i) % 4));
          std::memset(p, t, 4096);
          if (client.status().registrations == 0) failures++;
          client.host_free(p);
        }
      } catch (const std::exception& e) {
        failures++;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures == 0);
  CHECK(client.status().registrations == 0);
}

TEST_CASE("a registration beyond the node's limit fails with the profile key in the message") {
  Daemon d({.overrides = {"memory.max_registered_bytes=1MiB"}});
  collective::Client client(d.socket().c_str());
  client.host_alloc(512 << 10);
  try {
    client.host_alloc(1 << 20);
    FAIL("expected an error");
  } catch (const collective::Error& e) {
    CHECK(e.code() == COLLECTIVE_RESOURCE_EXHAUSTED);
    CHECK(std::string(e.what()).find("memory.max_registered_bytes") != std::string::npos);
  }
}

TEST_CASE("a daemon that stops mid-session fails later calls with a clear error") {
  Daemon d;
  collective::Client client(d.socket().c_str());
  REQUIRE(d.terminate(5s).code == 0);
  try {
    client.status();
    FAIL("expected an error");
  } catch (const collective::Error& e) {
    CHECK((e.code() == COLLECTIVE_ABORTED || e.code() == COLLECTIVE_UNAVAILABLE));
    CHECK(std::string(e.what()).find("stopping") != std::string::npos);
  }
}
