// The broker of the clients' kernel set-up (direct_broker.h): rounds answered
// when every rank joined, and every way a communicator is declined.
#include "daemon/direct_broker.h"

#include <doctest/doctest.h>

#include <thread>

using collectived::daemon::DirectBroker;
using namespace std::chrono_literals;

namespace {

struct Answer {
  bool called = false;
  std::vector<std::string> blobs;
  std::string declined;
  DirectBroker::Reply reply() {
    return [this](const std::vector<std::string>& b, const std::string& d) {
      CHECK_FALSE(called);  // once
      called = true;
      blobs = b;
      declined = d;
    };
  }
};

}  // namespace

TEST_CASE("direct broker: a round is answered with every rank's blob, in rank order, once all joined") {
  DirectBroker b;
  Answer a0, a1, a2;
  b.join(7, 1, 2, 3, 1, 5, 12, "two", a2.reply());
  b.join(7, 1, 0, 3, 1, 5, 10, "zero", a0.reply());
  CHECK_FALSE(a0.called);
  CHECK_FALSE(a2.called);
  b.join(7, 1, 1, 3, 1, 5, 11, "one", a1.reply());
  for (Answer* a : {&a0, &a1, &a2}) {
    REQUIRE(a->called);
    CHECK(a->declined.empty());
    CHECK(a->blobs == std::vector<std::string>{"zero", "one", "two"});
  }
  // Later rounds are separate; host collectives after round 1 do not matter.
  b.host_collective(7, 1, 9, 11);
  Answer r0, r1;
  b.join(7, 2, 0, 2 + 1, 1, 5, 10, "h0", r0.reply());
  b.join(7, 2, 1, 3, 1, 5, 11, "h1", r1.reply());
  CHECK_FALSE(r0.called);
  Answer r2;
  b.join(7, 2, 2, 3, 1, 5, 12, "h2", r2.reply());
  CHECK(r0.called);
  CHECK(r0.declined.empty());
  CHECK(r2.blobs.size() == 3);
  b.comm_gone(7);
  CHECK(b.size() == 0);
}

TEST_CASE("direct broker: a rank on host memory where the others join declines the communicator, before or after the joins") {
  DirectBroker b;
  SUBCASE("host collectives below the joining position do not matter") {
    b.host_collective(3, 1, 3, 42);
    b.host_collective(3, 0, 4, 41);
    Answer a0, a1;
    b.join(3, 1, 0, 2, 1, 5, 10, "x", a0.reply());
    b.join(3, 1, 1, 2, 1, 5, 11, "y", a1.reply());
    REQUIRE(a0.called);
    CHECK(a0.declined.empty());
    CHECK(a1.blobs == std::vector<std::string>{"x", "y"});
  }
  SUBCASE("the host collective at the position first: the joins are declined at once, naming the rank") {
    b.host_collective(3, 1, 5, 42);
    Answer a;
    b.join(3, 1, 0, 2, 1, 5, 10, "x", a.reply());
    REQUIRE(a.called);
    CHECK(a.declined.find("rank 1 (pid 42)") != std::string::npos);
    CHECK(a.declined.find("host memory") != std::string::npos);
  }
  SUBCASE("a join waiting: declined when the host collective at its position comes") {
    Answer a;
    b.join(3, 1, 0, 2, 1, 5, 10, "x", a.reply());
    b.host_collective(3, 1, 4, 42);  // an earlier one: nothing yet
    CHECK_FALSE(a.called);
    b.host_collective(3, 1, 5, 42);
    REQUIRE(a.called);
    CHECK(a.declined.find("rank 1") != std::string::npos);
    // The rank that made the host collective may still join later: the same answer.
    Answer late;
    b.join(3, 1, 1, 2, 1, 5, 11, "y", late.reply());
    REQUIRE(late.called);
    CHECK(late.declined == a.declined);
  }
}

TEST_CASE("direct broker: ranks on several nodes, a client gone, the deadline: declined, saying why") {
  DirectBroker b;
  SUBCASE("several nodes") {
    Answer a;
    b.join(5, 1, 0, 4, 2, 5, 10, "x", a.reply());
    REQUIRE(a.called);
    CHECK(a.declined.find("2 nodes") != std::string::npos);
  }
  SUBCASE("a waiting rank's client disconnects") {
    Answer a0, a1;
    b.join(5, 1, 0, 3, 1, 5, 10, "x", a0.reply());
    b.join(5, 1, 1, 3, 1, 5, 11, "y", a1.reply());
    b.session_gone(11);
    REQUIRE(a0.called);
    CHECK(a0.declined.find("rank 1's client disconnected") != std::string::npos);
    CHECK_FALSE(a1.called);  // its reply is dropped with its session
  }
  SUBCASE("the deadline names the ranks that did not join") {
    Answer a;
    b.join(5, 1, 1, 3, 1, 5, 11, "y", a.reply());
    b.check_deadlines(1000ms);
    CHECK_FALSE(a.called);
    std::this_thread::sleep_for(20ms);
    b.check_deadlines(10ms);
    REQUIRE(a.called);
    CHECK(a.declined.find("rank(s) 0, 2 did not reach") != std::string::npos);
  }
  SUBCASE("the communicator destroyed") {
    Answer a;
    b.join(5, 1, 1, 3, 1, 5, 11, "y", a.reply());
    b.comm_gone(5);
    REQUIRE(a.called);
    CHECK(a.declined.find("destroyed") != std::string::npos);
  }
}
