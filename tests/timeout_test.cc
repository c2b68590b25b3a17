// Per-operation deadlines chosen by the client (collective_comm_set_timeout):
// real daemons, real client processes. The daemons keep the default 30 s
// deadlines.operation_ms unless a case says otherwise, so an operation that
// fails within a couple of seconds failed by the client's deadline.
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <new>
#include <string>
#include <thread>

#include "client/collective.h"
#include "tests/support/collective_check.h"
#include "tests/support/harness.h"
#include "tests/support/nodes.h"

using namespace collectived;
using namespace collectived::test;
using namespace std::chrono_literals;

namespace {

using Clock = std::chrono::steady_clock;

/// A flag shared by the forked ranks: the waiting rank stays until the
/// failing one has its answer (its exit would fail the operation with
/// `remote` instead), and no longer.
class SharedFlag {
 public:
  SharedFlag()
      : p_(static_cast<std::atomic<int>*>(::mmap(nullptr, sizeof(std::atomic<int>),
                                                 PROT_READ | PROT_WRITE,
                                                 MAP_SHARED | MAP_ANONYMOUS, -1, 0))) {
    REQUIRE(p_ != MAP_FAILED);
    new (p_) std::atomic<int>(0);
  }
  ~SharedFlag() { ::munmap(p_, sizeof(std::atomic<int>)); }
  void set() { p_->store(1); }
  /// Until set() or `limit`.
  void wait(std::chrono::milliseconds limit) const {
    const auto until = Clock::now() + limit;
    while (p_->load() == 0 && Clock::now() < until) std::this_thread::sleep_for(10ms);
  }

 private:
  std::atomic<int>* p_;
};

/// Waits for `req` (-1: its own deadline), frees it; the time it took.
collective_result_t wait_free(collective_request_t* req, Clock::duration& took,
                              Clock::time_point since) {
  const collective_result_t rc = collective_wait(req, -1);
  took = Clock::now() - since;
  collective_request_free(req);
  return rc;
}

/// rc is a timeout that came in [lo, hi] and whose message has every part.
int expect_timeout(int rank, collective_result_t rc, Clock::duration took,
                   std::chrono::milliseconds lo, std::chrono::milliseconds hi,
                   std::initializer_list<std::string> parts) {
  const std::string msg = collective_last_error();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(took).count();
  if (rc != COLLECTIVE_TIMEOUT) {
    std::fprintf(stderr, "rank %d: expected a timeout, got %d after %lld ms: %s\n", rank, rc,
                 static_cast<long long>(ms), msg.c_str());
    return 20;
  }
  if (took < lo || took > hi) {
    std::fprintf(stderr, "rank %d: the timeout came after %lld ms, expected %lld-%lld: %s\n", rank,
                 static_cast<long long>(ms), static_cast<long long>(lo.count()),
                 static_cast<long long>(hi.count()), msg.c_str());
    return 21;
  }
  for (const auto& part : parts) {
    if (msg.find(part) == std::string::npos) {
      std::fprintf(stderr, "rank %d: \"%s\" not in: %s\n", rank, part.c_str(), msg.c_str());
      return 22;
    }
  }
  return 0;
}

}  // namespace

TEST_CASE("a collective with a 500 ms timeout fails within it, naming the rank that never submitted") {
  Daemon d;
  auto id = new_id(d.socket());
  SharedFlag done;
  run_ranks(2, [&](int rank) {
    RankCtx c = join(d.socket(), id, 2, rank, 4096);
    if (rank == 1) {  // alive, never submits
      done.wait(10s);
      return 0;
    }
    if (collective_comm_set_timeout(c.comm, 500) != COLLECTIVE_OK) return 10;
    if (collective_comm_timeout(c.comm) != 500) return 11;
    collective_request_t* req = nullptr;
    const auto t0 = Clock::now();
    if (collective_all_reduce(c.comm, c.send, c.recv, 16, COLLECTIVE_FLOAT32, COLLECTIVE_SUM,
                              &req) != COLLECTIVE_OK) {
      return 12;
    }
    Clock::duration took{};
    const auto rc = wait_free(req, took, t0);
    done.set();
    return expect_timeout(0, rc, took, 450ms, 2000ms,
                          {"timed out after 500 ms (the operation's timeout, set by rank 0; "
                           "deadlines.operation_ms is 30000)",
                           "ranks that did not submit it: rank 1 (pid"});
  });
  CHECK(d.log().find("deadline=\"500 ms (the operation's timeout") != std::string::npos);
}

TEST_CASE("a send/recv group with a 500 ms timeout fails within it, naming the unmatched peer") {
  Daemon d;
  auto id = new_id(d.socket());
  SharedFlag done;
  run_ranks(2, [&](int rank) {
    RankCtx c = join(d.socket(), id, 2, rank, 4096);
    if (rank == 1) {
      done.wait(10s);
      return 0;
    }
    if (collective_comm_set_timeout(c.comm, 500) != COLLECTIVE_OK) return 10;
    collective_request_t* req = nullptr;
    const auto t0 = Clock::now();
    collective_group_start(c.comm);
    collective_send(c.comm, c.send, 8, COLLECTIVE_INT64, 1);
    if (collective_group_end(c.comm, &req) != COLLECTIVE_OK) return 12;
    Clock::duration took{};
    const auto rc = wait_free(req, took, t0);
    done.set();
    return expect_timeout(0, rc, took, 450ms, 2000ms,
                          {"timed out after 500 ms (the operation's timeout, set by rank 0; ",
                           "unmatched send to rank 1"});
  });
}

TEST_CASE("the earliest of the ranks' deadlines governs, whoever submitted first") {
  Daemon d;
  auto id = new_id(d.socket());
  SharedFlag done;
  run_ranks(3, [&](int rank) {
    RankCtx c = join(d.socket(), id, 3, rank, 4096);
    if (rank == 2) {
      done.wait(10s);
      return 0;
    }
    // Rank 0 (5 s) submits first; rank 1 (300 ms) 100 ms later: both fail
    // about 400 ms in, by rank 1's deadline.
    if (collective_comm_set_timeout(c.comm, rank == 0 ? 5000 : 300) != COLLECTIVE_OK) return 10;
    const auto t0 = Clock::now();
    if (rank == 1) std::this_thread::sleep_for(100ms);
    collective_request_t* req = nullptr;
    if (collective_barrier(c.comm, &req) != COLLECTIVE_OK) return 12;
    Clock::duration took{};
    const auto rc = wait_free(req, took, t0);
    const int result = expect_timeout(rank, rc, took, 350ms, 2000ms,
                                      {"timed out after 300 ms (the operation's timeout, set by "
                                       "rank 1; deadlines.operation_ms is 30000)",
                                       "ranks that did not submit it: rank 2 (pid"});
    if (rank == 0) {
      std::this_thread::sleep_for(100ms);  // rank 1 has its answer too
      done.set();
    }
    return result;
  });
}

TEST_CASE("timeout 0 restores the node's deadlines.operation_ms") {
  Daemon d({.overrides = {"deadlines.operation_ms=2000"}});
  auto id = new_id(d.socket());
  SharedFlag done;
  run_ranks(2, [&](int rank) {
    RankCtx c = join(d.socket(), id, 2, rank, 4096);
    if (rank == 1) {
      done.wait(10s);
      return 0;
    }
    if (collective_comm_set_timeout(c.comm, 300) != COLLECTIVE_OK) return 10;
    if (collective_comm_set_timeout(c.comm, 0) != COLLECTIVE_OK) return 11;
    if (collective_comm_timeout(c.comm) != 0) return 12;
    collective_request_t* req = nullptr;
    const auto t0 = Clock::now();
    if (collective_barrier(c.comm, &req) != COLLECTIVE_OK) return 13;
    Clock::duration took{};
    const auto rc = wait_free(req, took, t0);
    done.set();
    const int result = expect_timeout(0, rc, took, 1900ms, 4000ms,
                                      {"timed out after 2000 ms (deadlines.operation_ms) on node",
                                       "ranks that did not submit it: rank 1 (pid"});
    if (result == 0 && contains(collective_last_error(), "the operation's timeout")) return 14;
    return result;
  });
}

TEST_CASE("collective_comm_set_timeout refuses negative values and a NULL communicator") {
  Daemon d;
  auto id = new_id(d.socket());
  run_ranks(1, [&](int rank) {
    RankCtx c = join(d.socket(), id, 1, rank, 4096);
    if (collective_comm_set_timeout(c.comm, 700) != COLLECTIVE_OK) return 10;
    if (collective_comm_set_timeout(c.comm, -1) != COLLECTIVE_INVALID_ARGUMENT) return 11;
    if (!contains(collective_last_error(), "negative")) return 12;
    if (collective_comm_timeout(c.comm) != 700) return 13;  // unchanged
    if (collective_comm_set_timeout(nullptr, 10) != COLLECTIVE_INVALID_ARGUMENT) return 14;
    if (collective_comm_timeout(nullptr) != 0) return 15;
    return 0;
  });
}

TEST_CASE("operations that complete within their timeout are unaffected by it") {
  Daemon d;
  auto id = new_id(d.socket());
  run_ranks(2, [&](int rank) {
    RankCtx c = join(d.socket(), id, 2, rank, 4096);
    if (collective_comm_set_timeout(c.comm, 500) != COLLECTIVE_OK) return 10;
    auto* s = reinterpret_cast<std::int32_t*>(c.send);
    auto* r = reinterpret_cast<std::int32_t*>(c.recv);
    for (int round = 0; round < 3; ++round) {
      // Rank 1 comes 200 ms late: within rank 0's 500 ms.
      if (rank == 1) std::this_thread::sleep_for(200ms);
      for (int i = 0; i < 64; ++i) s[i] = rank + i + round;
      collective_request_t* req = nullptr;
      if (collective_all_reduce(c.comm, s, r, 64, COLLECTIVE_INT32, COLLECTIVE_SUM, &req) !=
              COLLECTIVE_OK ||
          collective_wait(req, -1) != COLLECTIVE_OK) {
        std::fprintf(stderr, "rank %d: %s\n", rank, collective_last_error());
        return 11;
      }
      collective_request_free(req);
      for (int i = 0; i < 64; ++i) {
        if (r[i] != 1 + 2 * (i + round)) return 12;
      }
      collective_group_start(c.comm);
      collective_send(c.comm, s, 64, COLLECTIVE_INT32, 1 - rank);
      collective_recv(c.comm, r, 64, COLLECTIVE_INT32, 1 - rank);
      if (collective_group_end(c.comm, &req) != COLLECTIVE_OK || collective_wait(req, -1) != COLLECTIVE_OK) {
        std::fprintf(stderr, "rank %d: %s\n", rank, collective_last_error());
        return 13;
      }
      collective_request_free(req);
      for (int i = 0; i < 64; ++i) {
        if (r[i] != 1 - rank + i + round) return 14;
      }
    }
    return 0;
  });
}

TEST_CASE("across nodes: the client's timeout bounds the wait for the other node, naming it") {
  Cluster cl(2);
  SharedFlag done;
  run_layout(cl, {0, 1}, 4096, [&](RankCtx& c) {
    if (c.rank == 1) {
      done.wait(10s);
      return 0;
    }
    if (collective_comm_set_timeout(c.comm, 500) != COLLECTIVE_OK) return 10;
    collective_request_t* req = nullptr;
    const auto t0 = Clock::now();
    if (collective_all_reduce(c.comm, c.send, c.recv, 16, COLLECTIVE_FLOAT32, COLLECTIVE_SUM,
                              &req) != COLLECTIVE_OK) {
      return 12;
    }
    Clock::duration took{};
    const auto rc = wait_free(req, took, t0);
    done.set();
    return expect_timeout(0, rc, took, 450ms, 2000ms,
                          {"timed out after 500 ms (the operation's timeout, set by rank 0; ",
                           "waiting for node node1", "rank 1"});
  });
}
