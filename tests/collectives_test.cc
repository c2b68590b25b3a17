// Collectives through a real daemon, from real client processes, checked
// against a reference computed here: every operation x dtype x reduction x
// in-place/out-of-place x odd and zero counts, for 2, 3 and 4 ranks; many
// communicators at once; split; send/recv; mismatches; dead, missing and
// aborting ranks.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/collective.h"
#include "ipc/half.h"
#include "tests/support/collective_check.h"
#include "tests/support/harness.h"

using namespace collectived;
using namespace collectived::test;
using namespace std::chrono_literals;

namespace {

}  // namespace

TEST_CASE("the full matrix across 2, 3 and 4 processes matches the reference") {
  Daemon d;
  for (int n = 2; n <= 4; ++n) {
    auto id = new_id(d.socket());
    run_ranks(n, [&](int rank) {
      RankCtx c = join(d.socket(), id, n, rank, 4099 * 8 * 4 + 256);
      run_matrix(c);
      if (collective_comm_destroy(c.comm) != COLLECTIVE_OK) c.report(collective_last_error());
      collective_disconnect(c.client);
      return c.failures == 0 ? 0 : 1;
    });
  }
  RawClient probe(d.socket());
  REQUIRE(probe.hello());
  auto s = probe.status();
  REQUIRE(s);
  CHECK(s->message().getStatusReply().getCommunicators() == 0);
  CHECK(s->message().getStatusReply().getRegistrations() == 0);
}

TEST_CASE("8 communicators used concurrently from the same processes") {
  Daemon d;
  constexpr int n = 4, kComms = 8;
  std::vector<collective_unique_id_t> ids;
  for (int i = 0; i < kComms; ++i) ids.push_back(new_id(d.socket()));
  run_ranks(n, [&](int rank) {
    collective_client_t* client = nullptr;
    if (collective_connect(d.socket().c_str(), "multi", &client) != COLLECTIVE_OK) return 10;
    // Join in a rank-dependent order: the rendezvous must not care.
    std::vector<collective_comm_t*> comms(kComms);
    std::vector<collective_request_t*> unused;
    std::vector<std::thread> joiners;
    std::atomic<int> bad{0};
    for (int i = 0; i < kComms; ++i) {
      const int c = (i + rank * 3) % kComms;
      joiners.emplace_back([&, c] {
        if (collective_comm_init_rank(client, &ids[c], n, rank, &comms[c]) != COLLECTIVE_OK) {
          std::fprintf(stderr, "rank %d comm %d: %s\n", rank, c, collective_last_error());
          bad++;
        }
      });
    }
    for (auto& t : joiners) t.join();
    if (bad) return 11;
    constexpr std::size_t count = 20000;
    std::vector<float*> bufs(kComms);
    for (int c = 0; c < kComms; ++c) {
      void* p = nullptr;
      if (collective_host_alloc(client, count * sizeof(float), &p) != COLLECTIVE_OK) return 12;
      bufs[c] = static_cast<float*>(p);
    }
    // Three rounds of in-place all-reduce on every communicator, all in flight at once.
    for (int c = 0; c < kComms; ++c)
      for (std::size_t i = 0; i < count; ++i) bufs[c][i] = static_cast<float>(rank + c + i % 7);
    std::vector<collective_request_t*> reqs;
    for (int round = 0; round < 3; ++round) {
      for (int c = 0; c < kComms; ++c) {
        collective_request_t* r = nullptr;
        if (collective_all_reduce(comms[c], bufs[c], bufs[c], count, COLLECTIVE_FLOAT32,
                                  round == 1 ? COLLECTIVE_MAX : COLLECTIVE_SUM, &r) != COLLECTIVE_OK)
          return 13;
        reqs.push_back(r);
      }
    }
    for (auto* r : reqs) {
      if (collective_wait(r, 30000) != COLLECTIVE_OK) {
        std::fprintf(stderr, "rank %d: %s\n", rank, collective_last_error());
        return 14;
      }
      collective_request_free(r);
    }
    // round 0: sum over ranks of (r + c + i%7) = 6 + 4(c + i%7); round 1: max (same on all);
    // round 2: x4.
    for (int c = 0; c < kComms; ++c)
      for (std::size_t i = 0; i < count; ++i) {
        const float want = 4.0f * (6.0f + 4.0f * static_cast<float>(c + i % 7));
        if (bufs[c][i] != want) {
          std::fprintf(stderr, "rank %d comm %d element %zu: %g != %g\n", rank, c, i, bufs[c][i], want);
          return 15;
        }
      }
    for (auto* c : comms) collective_comm_destroy(c);
    collective_disconnect(client);
    return 0;
  });
}

TEST_CASE("comm_split groups by color, orders by key, and NOCOLOR gets no communicator") {
  Daemon d;
  auto id = new_id(d.socket());
  run_ranks(4, [&](int rank) {
    RankCtx c = join(d.socket(), id, 4, rank, 4096);
    collective_comm_t* sub = nullptr;
    const int color = rank == 3 ? COLLECTIVE_SPLIT_NOCOLOR : rank % 2;
    if (collective_comm_split(c.comm, color, -rank, &sub) != COLLECTIVE_OK) {
      std::fprintf(stderr, "rank %d: %s\n", rank, collective_last_error());
      return 10;
    }
    if (rank == 3) return sub == nullptr ? 0 : 11;
    // Color 0: old ranks {0, 2}, keys {0, -2}: new order 2, 0. Color 1: {1} alone.
    const int want_size = rank % 2 == 0 ? 2 : 1;
    const int want_rank = rank == 2 ? 0 : 0 + (rank == 0 ? 1 : 0);
    if (collective_comm_size(sub) != want_size || collective_comm_rank(sub) != want_rank) {
      std::fprintf(stderr, "rank %d: split gave rank %d of %d\n", rank, collective_comm_rank(sub),
                   collective_comm_size(sub));
      return 12;
    }
    auto* v = reinterpret_cast<std::int32_t*>(c.send);
    v[0] = rank + 1;
    collective_request_t* r = nullptr;
    if (collective_all_reduce(sub, v, c.recv, 1, COLLECTIVE_INT32, COLLECTIVE_SUM, &r) != COLLECTIVE_OK ||
        collective_wait(r, 10000) != COLLECTIVE_OK)
      return 13;
    collective_request_free(r);
    const int want = rank % 2 == 0 ? 1 + 3 : 2;
    if (reinterpret_cast<std::int32_t*>(c.recv)[0] != want) return 14;
    collective_comm_destroy(sub);
    collective_comm_destroy(c.comm);
    return 0;
  });
}

TEST_CASE("grouped send/recv: a ring exchange, self-sends, and a mismatched pair") {
  Daemon d;
  auto id = new_id(d.socket());
  constexpr int n = 3;
  run_ranks(n, [&](int rank) {
    RankCtx c = join(d.socket(), id, n, rank, 1 << 16);
    auto* s = reinterpret_cast<std::int64_t*>(c.send);
    auto* r = reinterpret_cast<std::int64_t*>(c.recv);
    constexpr std::size_t count = 1001;
    for (std::size_t i = 0; i < count; ++i) s[i] = rank * 100000 + static_cast<std::int64_t>(i);
    // Send to the right, receive from the left, and to ourselves, in one group.
    collective_group_start(c.comm);
    collective_send(c.comm, s, count, COLLECTIVE_INT64, (rank + 1) % n);
    collective_recv(c.comm, r, count, COLLECTIVE_INT64, (rank + n - 1) % n);
    collective_send(c.comm, s, 10, COLLECTIVE_INT64, rank);
    collective_recv(c.comm, r + 2000, 10, COLLECTIVE_INT64, rank);
    collective_request_t* req = nullptr;
    if (collective_group_end(c.comm, &req) != COLLECTIVE_OK || collective_wait(req, 10000) != COLLECTIVE_OK) {
      std::fprintf(stderr, "rank %d: %s\n", rank, collective_last_error());
      return 10;
    }
    collective_request_free(req);
    const int left = (rank + n - 1) % n;
    for (std::size_t i = 0; i < count; ++i)
      if (r[i] != left * 100000 + static_cast<std::int64_t>(i)) return 11;
    for (std::size_t i = 0; i < 10; ++i)
      if (r[2000 + i] != rank * 100000 + static_cast<std::int64_t>(i)) return 12;
    // Rank 0 sends 5 elements to rank 1, which expects 6: both get a mismatch.
    if (rank < 2) {
      collective_group_start(c.comm);
      if (rank == 0) collective_send(c.comm, s, 5, COLLECTIVE_INT64, 1);
      if (rank == 1) collective_recv(c.comm, r, 6, COLLECTIVE_INT64, 0);
      collective_group_end(c.comm, &req);
      const auto rc = collective_wait(req, 10000);
      collective_request_free(req);
      if (rc != COLLECTIVE_MISMATCH) return 13;
      const char* msg = collective_last_error();
      if (!contains(msg, "rank 0 sends 5 int64 to rank 1 but rank 1 receives 6 int64")) {
        std::fprintf(stderr, "rank %d: %s\n", rank, msg);
        return 14;
      }
    }
    // send/recv outside a group is a usage error.
    if (collective_send(c.comm, s, 1, COLLECTIVE_INT64, 0) != COLLECTIVE_INVALID_USAGE) return 15;
    // Nobody leaves (which would fail the others' operations) before all are done.
    collective_barrier(c.comm, &req);
    if (collective_wait(req, 10000) != COLLECTIVE_OK) return 16;
    collective_request_free(req);
    return 0;
  });
}

TEST_CASE("separate send and receive groups: every rank sends first, then receives, and they meet") {
  // PyTorch's isend then irecv on every rank: the send groups wait for their
  // peers' receive groups, which come second in every rank's queue.
  Daemon d;
  auto id = new_id(d.socket());
  constexpr int n = 3;
  run_ranks(n, [&](int rank) {
    RankCtx c = join(d.socket(), id, n, rank, 1 << 16);
    auto* s = reinterpret_cast<std::int64_t*>(c.send);
    auto* r = reinterpret_cast<std::int64_t*>(c.recv);
    for (int i = 0; i < 64; ++i) s[i] = rank * 1000 + i;
    collective_request_t* sends[2] = {};
    collective_request_t* recvs[2] = {};
    for (int k = 0; k < 2; ++k) {  // two rounds: the pairs meet in order
      collective_group_start(c.comm);
      collective_send(c.comm, s + 32 * k, 32, COLLECTIVE_INT64, (rank + 1) % n);
      collective_group_end(c.comm, &sends[k]);
    }
    for (int k = 0; k < 2; ++k) {
      collective_group_start(c.comm);
      collective_recv(c.comm, r + 32 * k, 32, COLLECTIVE_INT64, (rank + n - 1) % n);
      collective_group_end(c.comm, &recvs[k]);
    }
    for (auto* q : {sends[0], sends[1], recvs[0], recvs[1]}) {
      if (collective_wait(q, 10000) != COLLECTIVE_OK) {
        std::fprintf(stderr, "rank %d: %s\n", rank, collective_last_error());
        return 10;
      }
      collective_request_free(q);
    }
    const int left = (rank + n - 1) % n;
    for (int i = 0; i < 64; ++i)
      if (r[i] != left * 1000 + i) return 11;
    collective_request_t* req = nullptr;
    collective_barrier(c.comm, &req);
    if (collective_wait(req, 10000) != COLLECTIVE_OK) return 12;
    collective_request_free(req);
    return 0;
  });
}

TEST_CASE("mismatched operations fail on every rank with both ranks and both values named") {
  Daemon d;
  auto id = new_id(d.socket());
  run_ranks(3, [&](int rank) {
    RankCtx c = join(d.socket(), id, 3, rank, 1 << 16);
    auto expect_mismatch = [&](collective_result_t submit_rc, collective_request_t* r,
                               std::initializer_list<std::string> parts) {
      collective_result_t rc = submit_rc;
      if (rc == COLLECTIVE_OK) rc = collective_wait(r, 10000);
      collective_request_free(r);
      const std::string msg = collective_last_error();
      if (rc != COLLECTIVE_MISMATCH) {
        std::fprintf(stderr, "rank %d: expected a mismatch, got %d: %s\n", rank, rc, msg.c_str());
        return false;
      }
      for (const auto& p : parts) {
        if (msg.find(p) == std::string::npos) {
          std::fprintf(stderr, "rank %d: '%s' lacks '%s'\n", rank, msg.c_str(), p.c_str());
          return false;
        }
      }
      return true;
    };
    collective_request_t* r = nullptr;
    // Count: rank 1 differs.
    auto rc = collective_all_reduce(c.comm, c.send, c.recv, rank == 1 ? 20 : 10, COLLECTIVE_FLOAT32,
                                    COLLECTIVE_SUM, &r);
    if (!expect_mismatch(rc, r, {"rank 1 (pid", "count=10", "count=20", "all_reduce"}))
      return 10;
    // Operation: rank 2 broadcasts while the others all-reduce.
    if (rank == 2) {
      rc = collective_broadcast(c.comm, c.send, c.recv, 10, COLLECTIVE_FLOAT32, 0, &r);
    } else {
      rc = collective_all_reduce(c.comm, c.send, c.recv, 10, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &r);
    }
    if (!expect_mismatch(rc, r, {"broadcast(count=10", "all_reduce(count=10", "rank 2 (pid"})) return 11;
    // Dtype, reduction and root.
    rc = collective_all_reduce(c.comm, c.send, c.recv, 10,
                               rank == 0 ? COLLECTIVE_FLOAT64 : COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &r);
    if (!expect_mismatch(rc, r, {"dtype=double", "dtype=float"})) return 12;
    rc = collective_all_reduce(c.comm, c.send, c.recv, 10, COLLECTIVE_FLOAT32,
                               rank == 2 ? COLLECTIVE_MAX : COLLECTIVE_SUM, &r);
    if (!expect_mismatch(rc, r, {"op=sum", "op=max"})) return 13;
    rc = collective_reduce(c.comm, c.send, c.recv, 10, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, rank == 1 ? 1 : 0, &r);
    if (!expect_mismatch(rc, r, {"root=0", "root=1"})) return 14;
    // The communicator is still usable afterwards.
    rc = collective_all_reduce(c.comm, c.send, c.recv, 10, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &r);
    if (rc != COLLECTIVE_OK || collective_wait(r, 10000) != COLLECTIVE_OK) return 15;
    collective_request_free(r);
    return 0;
  });
}

TEST_CASE("a rank killed mid-operation: the others get an error naming it, the daemon cleans up") {
  Daemon d({.overrides = {"deadlines.operation_ms=20000"}});
  auto id = new_id(d.socket());
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  auto* shared = static_cast<std::atomic<int>*>(
      ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  shared[0] = 0;
  std::vector<std::unique_ptr<Child>> kids;
  for (int rank = 0; rank < 3; ++rank) {
    kids.push_back(std::make_unique<Child>([&, rank] {
      RankCtx c = join(d.socket(), id, 3, rank, 1 << 20);
      shared[1 + rank] = static_cast<int>(::getpid());
      if (rank == 2) {
        char x = 'r';
        if (::write(ready[1], &x, 1) != 1) return 1;
        ::pause();  // killed here, never submits
        return 0;
      }
      collective_request_t* r = nullptr;
      const auto t0 = std::chrono::steady_clock::now();
      collective_all_reduce(c.comm, c.send, c.recv, 1000, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &r);
      shared[0]++;
      const auto rc = collective_wait(r, 30000);
      const auto took = std::chrono::steady_clock::now() - t0;
      const std::string msg = collective_last_error();
      if (rc != COLLECTIVE_REMOTE_ERROR) {
        std::fprintf(stderr, "rank %d: got %d: %s\n", rank, rc, msg.c_str());
        return 10;
      }
      if (msg.find("rank 2 (pid " + std::to_string(shared[3].load()) + ")") == std::string::npos ||
          msg.find("all_reduce") == std::string::npos || msg.find("disconnected") == std::string::npos) {
        std::fprintf(stderr, "rank %d: %s\n", rank, msg.c_str());
        return 11;
      }
      if (took > 5s) return 12;  // the kill is noticed at once, not at the deadline
      // Later operations fail at once too.
      collective_request_t* r2 = nullptr;
      collective_barrier(c.comm, &r2);
      if (collective_wait(r2, 5000) != COLLECTIVE_REMOTE_ERROR) return 13;
      return 0;
    }));
  }
  char x = 0;
  REQUIRE(::read(ready[0], &x, 1) == 1);
  REQUIRE(eventually([&] { return shared[0].load() == 2; }, 10s));
  std::this_thread::sleep_for(100ms);  // both submissions reach the daemon
  kids[2]->kill(SIGKILL);
  CHECK(kids[0]->wait(30s).code == 0);
  CHECK(kids[1]->wait(30s).code == 0);
  kids[2]->wait(5s);
  CHECK(d.alive());
  CHECK(d.wait_for_log("event=rank_died", 5s));
  RawClient probe(d.socket());
  REQUIRE(probe.hello());
  CHECK(eventually(
      [&] {
        auto s = probe.status();
        return s && s->message().getStatusReply().getRegistrations() == 0 &&
               s->message().getStatusReply().getCommunicators() == 0;
      },
      5s));
  ::munmap(shared, 4096);
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST_CASE("a rank that never submits: the others time out with the missing rank named") {
  Daemon d({.overrides = {"deadlines.operation_ms=400"}});
  auto id = new_id(d.socket());
  run_ranks(3, [&](int rank) {
    RankCtx c = join(d.socket(), id, 3, rank, 4096);
    collective_request_t* r = nullptr;
    if (rank == 1) {
      std::this_thread::sleep_for(1500ms);  // alive, but late
      // Its late submission of the expired sequence number fails at once.
      collective_barrier(c.comm, &r);
      const auto rc = collective_wait(r, 5000);
      if (rc != COLLECTIVE_TIMEOUT) {
        std::fprintf(stderr, "rank 1: %d %s\n", rc, collective_last_error());
        return 20;
      }
      return 0;
    }
    const auto t0 = std::chrono::steady_clock::now();
    collective_barrier(c.comm, &r);
    const auto rc = collective_wait(r, 10000);
    const auto took = std::chrono::steady_clock::now() - t0;
    const std::string msg = collective_last_error();
    if (rc != COLLECTIVE_TIMEOUT) return 10;
    if (msg.find("ranks that did not submit it: rank 1 (pid") == std::string::npos) {
      std::fprintf(stderr, "rank %d: %s\n", rank, msg.c_str());
      return 11;
    }
    if (took < 350ms || took > 1500ms) return 12;
    std::this_thread::sleep_for(1500ms);  // stay until rank 1 has seen its error
    return 0;
  });
}

TEST_CASE("rendezvous: missing ranks are named at the deadline; duplicates and size mismatches are refused") {
  Daemon d({.overrides = {"deadlines.rendezvous_ms=500"}});
  auto id = new_id(d.socket());
  run_ranks(2, [&](int rank) {
    collective_client_t* client = nullptr;
    if (collective_connect(d.socket().c_str(), "rv", &client) != COLLECTIVE_OK) return 9;
    collective_comm_t* comm = nullptr;
    const auto rc = collective_comm_init_rank(client, &id, 4, rank, &comm);
    const std::string msg = collective_last_error();
    if (rc != COLLECTIVE_TIMEOUT || msg.find("missing ranks: 2, 3") == std::string::npos) {
      std::fprintf(stderr, "rank %d: %d %s\n", rank, rc, msg.c_str());
      return 10;
    }
    return 0;
  });
  auto id2 = new_id(d.socket());
  run_ranks(2, [&](int which) {
    collective_client_t* client = nullptr;
    if (collective_connect(d.socket().c_str(), "rv", &client) != COLLECTIVE_OK) return 9;
    collective_comm_t* comm = nullptr;
    if (which == 1) std::this_thread::sleep_for(100ms);
    // Both claim rank 0: the second is refused; the first times out.
    const auto rc = collective_comm_init_rank(client, &id2, which == 0 ? 2 : 3, 0, &comm);
    if (which == 1) return rc == COLLECTIVE_MISMATCH ? 0 : 10;
    return rc == COLLECTIVE_TIMEOUT ? 0 : 11;
  });
}

TEST_CASE("comm_abort fails the other ranks' pending operations, naming the aborting rank") {
  Daemon d;
  auto id = new_id(d.socket());
  run_ranks(2, [&](int rank) {
    RankCtx c = join(d.socket(), id, 2, rank, 4096);
    if (rank == 0) {
      std::this_thread::sleep_for(200ms);
      return collective_comm_abort(c.comm) == COLLECTIVE_OK ? 0 : 10;
    }
    collective_request_t* r = nullptr;
    collective_barrier(c.comm, &r);
    const auto rc = collective_wait(r, 10000);
    const std::string msg = collective_last_error();
    if (rc != COLLECTIVE_ABORTED || msg.find("aborted by rank 0 (pid") == std::string::npos) {
      std::fprintf(stderr, "rank 1: %d %s\n", rc, msg.c_str());
      return 11;
    }
    return collective_comm_destroy(c.comm) == COLLECTIVE_OK ? 0 : 12;
  });
}

TEST_CASE("buffers outside registrations are refused, in the client and in the daemon") {
  Daemon d;
  auto id = new_id(d.socket());
  run_ranks(1, [&](int) {
    RankCtx c = join(d.socket(), id, 1, 0, 4096);
    collective_request_t* r = nullptr;
    std::vector<float> plain(16);
    if (collective_all_reduce(c.comm, plain.data(), c.recv, 16, COLLECTIVE_FLOAT32, COLLECTIVE_SUM,
                              &r) != COLLECTIVE_INVALID_ARGUMENT)
      return 10;
    if (!contains(collective_last_error(), "not inside memory from collective_host_alloc")) return 11;
    if (collective_all_reduce(c.comm, c.send + 4000, c.recv, 100, COLLECTIVE_FLOAT32, COLLECTIVE_SUM,
                              &r) != COLLECTIVE_INVALID_ARGUMENT)
      return 12;
    if (!contains(collective_last_error(), "run past the end")) return 13;
    return 0;
  });
  // The daemon's own check, with a client that lies about offsets.
  RawClient raw(d.socket());
  REQUIRE(raw.hello());
  const auto [comm, handle] = raw_comm_with_memory(raw, d.socket(), 2, 4096);
  capnp::MallocMessageBuilder op;
  auto om = op.initRoot<wire::Message>();
  om.setId(4);
  auto col = om.initCollective();
  col.setComm(comm);
  col.setKind(wire::OpKind::ALL_REDUCE);
  col.setDtype(COLLECTIVE_FLOAT32);
  col.setCount(100);
  col.getSend().setHandle(handle);
  col.getSend().setOffset(4000);
  col.getRecv().setHandle(handle);
  raw.send(op);
  auto res = raw.receive(5s);
  REQUIRE(res);
  CHECK(error_code(*res) == Code::invalid_argument);
  CHECK(error_message(*res).find("outside registration") != std::string::npos);
  // Another client's communicator handle is not usable.
  RawClient other(d.socket());
  REQUIRE(other.hello());
  om.setId(5);
  other.send(op);
  auto res2 = other.receive(5s);
  REQUIRE(res2);
  CHECK(error_code(*res2) == Code::permission_denied);
}

TEST_CASE("comm_destroy: a rank that left is named in the others' later errors") {
  Daemon d;
  auto id = new_id(d.socket());
  run_ranks(2, [&](int rank) {
    RankCtx c = join(d.socket(), id, 2, rank, 4096);
    if (rank == 0) return collective_comm_destroy(c.comm) == COLLECTIVE_OK ? 0 : 10;
    std::this_thread::sleep_for(300ms);
    collective_request_t* r = nullptr;
    collective_barrier(c.comm, &r);
    const auto rc = collective_wait(r, 5000);
    if (rc != COLLECTIVE_REMOTE_ERROR || !contains(collective_last_error(), "rank 0 (pid")) {
      std::fprintf(stderr, "%s\n", collective_last_error());
      return 11;
    }
    return collective_comm_destroy(c.comm) == COLLECTIVE_OK ? 0 : 12;
  });
}

TEST_CASE("collective_test polls to completion; a wait that runs out leaves the request valid") {
  Daemon d;
  auto id = new_id(d.socket());
  run_ranks(2, [&](int rank) {
    RankCtx c = join(d.socket(), id, 2, rank, 4096);
    auto* v = reinterpret_cast<std::int32_t*>(c.send);
    v[0] = rank + 1;
    if (rank == 1) std::this_thread::sleep_for(300ms);  // rank 0's wait runs out first
    collective_request_t* r = nullptr;
    if (collective_all_reduce(c.comm, v, c.recv, 1, COLLECTIVE_INT32, COLLECTIVE_SUM, &r) !=
        COLLECTIVE_OK)
      return 10;
    if (rank == 0) {
      if (collective_wait(r, 50) != COLLECTIVE_TIMEOUT) return 11;
      if (!contains(collective_last_error(), "still pending")) return 12;
    }
    int done = 0;
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (!done && std::chrono::steady_clock::now() < until) {
      if (collective_test(r, &done) != COLLECTIVE_OK) return 13;
      if (!done) std::this_thread::sleep_for(1ms);
    }
    if (!done) return 14;
    if (collective_wait(r, 0) != COLLECTIVE_OK) return 15;  // completed requests stay completed
    collective_request_free(r);
    return reinterpret_cast<std::int32_t*>(c.recv)[0] == 3 ? 0 : 16;
  });
}

TEST_CASE("a unique id taken to another daemon is refused, naming both") {
  Daemon a, b;
  auto id = new_id(a.socket());
  collective_client_t* client = nullptr;
  REQUIRE(collective_connect(b.socket().c_str(), "elsewhere", &client) == COLLECTIVE_OK);
  collective_comm_t* comm = nullptr;
  CHECK(collective_comm_init_rank(client, &id, 2, 1, &comm) == COLLECTIVE_UNAVAILABLE);
  const std::string msg = collective_last_error();
  CHECK(msg.find("names rendezvous daemon local:" + std::to_string(a.pid()) + "@") !=
        std::string::npos);
  CHECK(msg.find("(local:" + std::to_string(b.pid()) + "@") != std::string::npos);
  collective_disconnect(client);
}
