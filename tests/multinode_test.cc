// Communicators across nodes: 2, 3 and 4 real collectived processes on
// distinct loopback addresses stand for nodes, with 1-3 real client processes
// (ranks) each. The full correctness matrix, connection sharing, split,
// send/recv, mismatches, dead ranks, a killed peer daemon and its restart,
// deadlines, and a daemon with the wrong secret.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "client/collective.h"
#include "tests/support/collective_check.h"
#include "tests/support/harness.h"
#include "tests/support/nodes.h"

using namespace collectived;
using namespace collectived::test;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// Cluster, run_layout, all_reduce_wait, sum_check: tests/support/nodes.h.

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::uint32_t connections_to(const Node& from, const Node& to) {
  auto c = client_of(from);
  auto row = peer_row(*c, to.address());
  return row ? row->connections : 0;
}

}  // namespace

TEST_CASE("the full matrix across 2, 3 and 4 daemons with 1-3 ranks each") {
  const std::vector<std::vector<int>> layouts = {
      {0, 1},              // 2 daemons x 1 rank
      {0, 0, 1},           // 2 daemons: 2 + 1, the rendezvous daemon's ranks first
      {1, 0, 2},           // 3 daemons x 1, rank 0 not on the rendezvous daemon
      {0, 1, 2, 3, 3, 0, 3}};  // 4 daemons: 2, 1, 1, 3 ranks, interleaved
  for (const auto& layout : layouts) {
    const int ndaemons = *std::max_element(layout.begin(), layout.end()) + 1;
    CAPTURE(layout.size());
    CAPTURE(ndaemons);
    Cluster cl(ndaemons);
    run_layout(cl, layout, 4099 * 8 * 8 + 256, [](RankCtx& c) {
      run_matrix(c);
      return 0;
    });
  }
}

TEST_CASE(
    "small operations on more nodes than collectives.pairwise_max_nodes take the trees: the "
    "full matrix on 5 daemons, and the trees forced on 3") {
  {
    // 5 nodes (4 + 1): the recursive doubling all-reduce hands node 0's
    // contribution to node 1 and back; the matrix's sizes (up to 32 KiB)
    // are all below direct_max_bytes.
    Cluster cl(5, {"log.level=debug"});
    run_layout(cl, {0, 1, 2, 3, 4, 2}, 4099 * 8 * 8 + 256, [](RankCtx& c) {
      run_matrix(c);
      return 0;
    });
    for (const auto& node : cl.nodes) {
      CHECK(node.daemon->log().find("algorithm=recursive_doubling") != std::string::npos);
      CHECK(node.daemon->log().find(
                "op=broadcast bytes=8 nodes=5 parallel_passes=1 algorithm=tree") !=
            std::string::npos);
    }
  }
  // Forced at every size: 3 nodes (2 + 1), several ranks on one.
  Cluster cl(3, {"collectives.algorithm=tree", "tcp.chunk_bytes=64KiB"});
  run_layout(cl, {0, 1, 2, 1}, 4099 * 8 * 8 + 256, [](RankCtx& c) {
    run_matrix(c);
    return 0;
  });
}

TEST_CASE("the full matrix on the pairwise paths: one rank per node reads and writes the ranks' buffers in place") {
  // direct_max_bytes 0: every non-empty operation goes pairwise (up to 4
  // nodes), in 4 KiB chunks, so the nodes with one rank take the paths that
  // skip the local pass (node_algorithms.cc), beside nodes with several.
  const std::vector<std::vector<int>> layouts = {{0, 1}, {0, 1, 2, 2}};
  for (const auto& layout : layouts) {
    const int ndaemons = *std::max_element(layout.begin(), layout.end()) + 1;
    CAPTURE(layout.size());
    Cluster cl(ndaemons, {"collectives.direct_max_bytes=0", "tcp.chunk_bytes=4KiB"});
    run_layout(cl, layout, 4099 * 8 * 8 + 256, [](RankCtx& c) {
      run_matrix(c);
      return 0;
    });
  }
}

TEST_CASE("the pairwise paths with chunk reductions on the worker pool, several at once") {
  // workers.threads 4: NodeChannel::parallelism() is 2 here, so the pairwise
  // reduce-scatter reduces its chunks on the pool while the next ones come
  // in (on 2-3 threads it reduces them inline).
  Cluster cl(3, {"workers.threads=4", "collectives.direct_max_bytes=0", "tcp.chunk_bytes=4KiB",
                 "log.level=debug"});
  run_layout(cl, {0, 1, 2, 2}, 4099 * 8 * 8 + 256, [](RankCtx& c) {
    run_matrix(c);
    return 0;
  });
  for (const auto& node : cl.nodes) {
    CHECK(node.daemon->log().find("parallel_passes=2") != std::string::npos);
  }
}

TEST_CASE("large operations take the ring and chain paths and stay correct") {
  // The defaults (pairwise on 3 nodes at these sizes), and the ring forced:
  // its all-gather receives into place (posted) with 2 ranks on one node.
  for (const std::string algorithm : {"auto", "ring"}) {
    CAPTURE(algorithm);
    Cluster cl(3, {"collectives.direct_max_bytes=4KiB", "tcp.chunk_bytes=64KiB",
                   "collectives.algorithm=" + algorithm});
    run_layout(cl, {0, 1, 2, 1}, (1 << 20) * 4 * 4 + 4096, [](RankCtx& c) {
      // 1 Mi elements of int32 (4 MiB per rank) and an odd count.
      for (std::size_t count : {std::size_t{1} << 20, std::size_t{300001}}) {
        for (Op op : kOps) {
          const std::size_t per = (op == Op::all_gather || op == Op::all_to_all ||
                                   op == Op::reduce_scatter) ? count / 4 : count;
          run_case(c, op, COLLECTIVE_INT32, COLLECTIVE_SUM, per, false, 1, 7);
          run_case(c, op, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, per, true, 2, 8);
        }
      }
      return 0;
    });
  }
}

TEST_CASE("collective-perf --daemons: ranks on the daemons round robin, each rank's node named") {
  Cluster cl(2);
  auto r =
      run_program({perf_binary(), "-t", "3", "-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w",
                   "1", "--op", "all-gather", "--daemons", cl.socket(0) + "," + cl.socket(1)},
                  60s);
  INFO(r.output);
  CHECK(r.code == 0);
  // Ranks 0 and 2 on the first daemon (node0), rank 1 on the second (node1):
  // the header once named rank 0's node for every rank.
  CHECK(r.output.find("Rank  0 Group  0 on node node0 daemon " + cl.socket(0)) !=
        std::string::npos);
  CHECK(r.output.find("Rank  1 Group  0 on node node1 daemon " + cl.socket(1)) !=
        std::string::npos);
  CHECK(r.output.find("Rank  2 Group  0 on node node0 daemon " + cl.socket(0)) !=
        std::string::npos);
  CHECK(r.output.find("Out of bounds values : 0 OK") != std::string::npos);
}

TEST_CASE("large pairwise and chain operations: chunks received straight into the outputs stay "
          "correct, in and out of place") {
  // Default 1 MiB chunks: a chunk of 64 KiB or more that arrives after its
  // operation posted the output for it is read from the socket straight
  // there (peer protocol 3, `event=node_receive_placed` in the debug log);
  // one that comes first is copied as before. Odd counts, 1-2 ranks per node.
  const std::vector<std::vector<int>> layouts = {{0, 1}, {0, 1, 2, 2}, {0, 1, 2, 3}};
  int placed = 0;
  for (const auto& layout : layouts) {
    const int ndaemons = *std::max_element(layout.begin(), layout.end()) + 1;
    CAPTURE(layout.size());
    Cluster cl(ndaemons, {"log.level=debug"});
    const std::size_t count = 700001;  // int32/float: 2.7 MiB per rank
    run_layout(cl, layout, count * 4 * layout.size() + 4096, [&](RankCtx& c) {
      std::uint64_t salt = 1;
      for (int round = 0; round < 2; ++round) {
        for (bool in_place : {false, true}) {
          run_case(c, Op::all_gather, COLLECTIVE_INT32, COLLECTIVE_SUM, count / c.n, in_place, 0, salt++);
          run_case(c, Op::all_reduce, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, count, in_place, 0, salt++);
          run_case(c, Op::broadcast, COLLECTIVE_INT32, COLLECTIVE_SUM, count, in_place, c.n - 1, salt++);
        }
      }
      return 0;
    });
    for (const auto& node : cl.nodes) placed += count_of(node.daemon->log(), "event=node_receive_placed");
  }
  MESSAGE("chunks received in place: " << placed);
  CHECK(placed > 0);
}

TEST_CASE("a node that runs ahead waits until the receiver is ready: every chunk of a broadcast "
          "chain and of a pairwise or ring all-gather is received straight into place") {
  // The late ranks submit 150 ms after the early ones. Without the ready
  // handshake (node_algorithms.cc, tell_ready) the early node's chunks
  // arrived before the late node had posted its output, and were copied
  // from a fresh buffer instead (none placed).
  const std::string placed = "event=node_receive_placed";
  // Three rounds of an int32 broadcast from rank 0, which submits at once;
  // the others submit 150 ms later.
  auto late_broadcasts = [](Cluster& cl, std::size_t count, std::uint64_t salt) {
    run_layout(cl, {0, 1, 2}, count * 4 + 4096, [&](RankCtx& c) {
      for (int round = 0; round < 3; ++round) {
        if (c.rank != 0) std::this_thread::sleep_for(150ms);
        run_case(c, Op::broadcast, COLLECTIVE_INT32, COLLECTIVE_SUM, count, round == 1, 0,
                 salt + round);
      }
      return 0;
    });
  };
  SUBCASE("broadcast: the root is early") {
    Cluster cl(3, {"log.level=debug"});
    // int32: 2.67 MiB, between two and four 1 MiB chunks, so cut into four
    // of 684 KiB (engine::transfer_chunk), every chunk placeable.
    late_broadcasts(cl, 700001, 11);
    CHECK(count_of(cl.nodes[0].daemon->log(), placed) == 0);
    CHECK(count_of(cl.nodes[1].daemon->log(), placed) == 4 * 3);
    CHECK(count_of(cl.nodes[2].daemon->log(), placed) == 4 * 3);
  }
  SUBCASE(
      "broadcast below 512 KiB: the root does not wait, its chunk lands before the late node "
      "posts") {
    // Below kAllGatherReadyBytes the one-way trip of the ready message costs
    // more than copying an early message (node_algorithms.cc,
    // broadcast_waits): node 1, 150 ms late, finds the 256 KiB chunk already
    // in, and copies it (none placed), while the operation stays correct.
    Cluster cl(3, {"log.level=debug"});
    late_broadcasts(cl, 65536, 31);  // int32: 256 KiB, one placeable chunk
    CHECK(count_of(cl.nodes[1].daemon->log(), placed) == 0);
  }
  const std::size_t count = 400000;  // int32 per rank: 1 + 0.53 MiB
  auto late_all_gathers = [&](Cluster& cl) {
    run_layout(cl, {0, 1, 2}, count * 4 * 3 + 4096, [&](RankCtx& c) {
      for (int round = 0; round < 3; ++round) {
        std::this_thread::sleep_for(c.rank * 150ms);
        run_case(c, Op::all_gather, COLLECTIVE_INT32, COLLECTIVE_SUM, count, round == 1, 0, 21 + round);
      }
      return 0;
    });
  };
  SUBCASE("pairwise all-gather: rank r is r x 150 ms late") {
    Cluster cl(3, {"log.level=debug", "collectives.algorithm=pairwise"});
    late_all_gathers(cl);
    // Every node receives 2 chunks from each of the 2 others, 3 times.
    for (const auto& node : cl.nodes) CHECK(count_of(node.daemon->log(), placed) == 2 * 2 * 3);
  }
  SUBCASE("ring all-gather (the default from 8 MiB per node): rank r is r x 150 ms late") {
    Cluster cl(3, {"log.level=debug", "collectives.algorithm=ring"});
    late_all_gathers(cl);
    // Every node receives 2 segments from its left, each whole (chunks 8x
    // tcp.chunk_bytes), the one forwarded too, 3 times.
    for (const auto& node : cl.nodes) CHECK(count_of(node.daemon->log(), placed) == 2 * 3);
  }
}

TEST_CASE("a second communicator over the same nodes opens no new connection; many at once") {
  Cluster cl(2);
  run_layout(cl, {0, 1}, 1 << 16, [](RankCtx& c) { return sum_check(c, c.comm, 1000) ? 0 : 1; });
  const std::uint32_t before = connections_to(cl.nodes[0], cl.nodes[1]) +
                               connections_to(cl.nodes[1], cl.nodes[0]);
  CHECK(before >= 1);
  // 8 communicators at once over the same two nodes, operations interleaved.
  constexpr int kComms = 8;
  std::vector<collective_unique_id_t> ids;
  for (int k = 0; k < kComms; ++k) ids.push_back(new_id(cl.socket(k % 2)));
  run_ranks(4, [&](int rank) {
    collective_client_t* client = nullptr;
    if (collective_connect(cl.socket(rank % 2).c_str(), "multi", &client) != COLLECTIVE_OK) return 10;
    void* s = nullptr;
    void* r = nullptr;
    if (collective_host_alloc(client, 1 << 16, &s) != COLLECTIVE_OK ||
        collective_host_alloc(client, 1 << 16, &r) != COLLECTIVE_OK) {
      return 11;
    }
    std::vector<collective_comm_t*> comms(kComms);
    for (int k = 0; k < kComms; ++k) {
      if (collective_comm_init_rank(client, &ids[k], 4, rank, &comms[k]) != COLLECTIVE_OK) {
        std::fprintf(stderr, "init %d: %s\n", k, collective_last_error());
        return 12;
      }
    }
    // Every communicator has an operation in flight at once.
    std::vector<collective_request_t*> reqs(kComms);
    auto* sv = static_cast<std::int32_t*>(s);
    auto* rv = static_cast<std::int32_t*>(r);
    for (int k = 0; k < kComms; ++k) {
      for (int i = 0; i < 100; ++i) sv[k * 100 + i] = (rank + 1) * (k + 1);
      if (collective_all_reduce(comms[k], sv + k * 100, rv + k * 100, 100, COLLECTIVE_INT32,
                                COLLECTIVE_SUM, &reqs[k]) != COLLECTIVE_OK) {
        return 13;
      }
    }
    int bad = 0;
    for (int k = 0; k < kComms; ++k) {
      if (collective_wait(reqs[k], 20000) != COLLECTIVE_OK) {
        std::fprintf(stderr, "comm %d: %s\n", k, collective_last_error());
        ++bad;
      }
      collective_request_free(reqs[k]);
      for (int i = 0; i < 100; ++i) bad += rv[k * 100 + i] != 10 * (k + 1);
    }
    for (auto* c : comms) collective_comm_destroy(c);
    collective_disconnect(client);
    return bad == 0 ? 0 : 14;
  });
  const std::uint32_t after = connections_to(cl.nodes[0], cl.nodes[1]) +
                              connections_to(cl.nodes[1], cl.nodes[0]);
  CHECK(after == before);
}

TEST_CASE("split and send/recv across nodes") {
  Cluster cl(2);
  run_layout(cl, {0, 1, 0, 1}, 1 << 16, [](RankCtx& c) {
    // Colors by node (children on one node each) and across nodes.
    for (int mode = 0; mode < 2; ++mode) {
      const int color = mode == 0 ? c.rank % 2 : c.rank / 2;
      collective_comm_t* child = nullptr;
      if (collective_comm_split(c.comm, color, -c.rank, &child) != COLLECTIVE_OK || !child) {
        c.report(std::string("split: ") + collective_last_error());
        return 1;
      }
      // Keys are -rank: the higher parent rank comes first in the child.
      const int want_rank = mode == 0 ? (c.rank < 2 ? 1 : 0) : 1 - c.rank % 2;
      if (collective_comm_size(child) != 2 || collective_comm_rank(child) != want_rank) {
        c.report("split: rank " + std::to_string(collective_comm_rank(child)) + " of " +
                 std::to_string(collective_comm_size(child)) + ", expected " +
                 std::to_string(want_rank) + " of 2");
      }
      sum_check(c, child, 333);
      collective_comm_destroy(child);
    }
    // A ring of sends: every rank sends to the next and receives from the previous.
    const int n = c.n, next = (c.rank + 1) % n, prev = (c.rank + n - 1) % n;
    auto* s = reinterpret_cast<std::int64_t*>(c.send);
    auto* r = reinterpret_cast<std::int64_t*>(c.recv);
    for (int i = 0; i < 1000; ++i) s[i] = c.rank * 1000000 + i;
    collective_request_t* req = nullptr;
    if (collective_group_start(c.comm) != COLLECTIVE_OK ||
        collective_send(c.comm, s, 1000, COLLECTIVE_INT64, next) != COLLECTIVE_OK ||
        collective_recv(c.comm, r, 1000, COLLECTIVE_INT64, prev) != COLLECTIVE_OK ||
        collective_group_end(c.comm, &req) != COLLECTIVE_OK ||
        collective_wait(req, 20000) != COLLECTIVE_OK) {
      c.report(std::string("send/recv: ") + collective_last_error());
    }
    collective_request_free(req);
    for (int i = 0; i < 1000; ++i) {
      if (r[i] != prev * 1000000 + i) {
        c.report("send/recv element " + std::to_string(i));
        break;
      }
    }
    // A send completes once its data is on the way: without this barrier a
    // rank could leave (breaking the communicator) before its peer received.
    collective_request_t* b = nullptr;
    if (collective_barrier(c.comm, &b) != COLLECTIVE_OK || collective_wait(b, 20000) != COLLECTIVE_OK) {
      c.report(std::string("barrier: ") + collective_last_error());
    }
    collective_request_free(b);
    return 0;
  });
}

TEST_CASE("sends never received stop at memory.max_unreceived_bytes, naming the sender; the nodes serve on") {
  // node1 may hold 1 MiB that no operation has taken; rank 0 sends 256 KiB
  // at a time to rank 1, which never receives. Without the bound node1 would
  // keep all 16 MiB (and, in a loop, grow until killed).
  Cluster cl(2, {"memory.max_unreceived_bytes=1MiB"});
  constexpr std::size_t kPiece = 256 << 10;
  run_layout(cl, {0, 1}, kPiece, [](RankCtx& c) {
    auto expect_limit = [&](collective_result_t rc, const char* where) {
      const char* msg = collective_last_error();
      if (rc != COLLECTIVE_RESOURCE_EXHAUSTED || !contains(msg, "memory.max_unreceived_bytes") ||
          !contains(msg, "node node1 holds") || !contains(msg, "from rank 0 to rank 1") ||
          !contains(msg, "node0")) {
        c.report(std::string(where) + ": expected the limit naming node1, rank 0 and node0, got " +
                 std::to_string(rc) + ": " + msg);
      }
    };
    if (c.rank == 1) {
      // Blocks on rank 0's all-reduce, which never comes: the break ends it.
      expect_limit(all_reduce_wait(c.comm, c.send, c.recv, 16, 20000), "rank 1's all-reduce");
      c.comm = nullptr;  // broken: not destroyed
      return 0;
    }
    collective_result_t rc = COLLECTIVE_OK;
    for (int i = 0; i < 64 && rc == COLLECTIVE_OK; ++i) {
      collective_request_t* req = nullptr;
      rc = collective_group_start(c.comm);
      if (rc == COLLECTIVE_OK) rc = collective_send(c.comm, c.send, kPiece, COLLECTIVE_UINT8, 1);
      if (rc == COLLECTIVE_OK) rc = collective_group_end(c.comm, &req);
      if (rc == COLLECTIVE_OK) rc = collective_wait(req, 20000);
      collective_request_free(req);
    }
    if (rc == COLLECTIVE_OK) rc = all_reduce_wait(c.comm, c.send, c.recv, 16, 20000);
    expect_limit(rc, "rank 0");
    c.comm = nullptr;
    return 0;
  });
  // The break cost only that communicator: a new one over the same nodes works.
  run_layout(cl, {0, 1}, 1 << 16, [](RankCtx& c) {
    sum_check(c, c.comm, 1000);
    return 0;
  });
}

TEST_CASE("a mismatch across nodes is named on both nodes; the communicator goes on") {
  Cluster cl(2);
  run_layout(cl, {0, 1}, 1 << 16, [](RankCtx& c) {
    auto* s = reinterpret_cast<std::int32_t*>(c.send);
    auto* r = reinterpret_cast<std::int32_t*>(c.recv);
    const collective_result_t rc = all_reduce_wait(c.comm, s, r, c.rank == 0 ? 10 : 20);
    const char* msg = collective_last_error();
    if (rc != COLLECTIVE_MISMATCH || !contains(msg, "count=10") || !contains(msg, "count=20") ||
        !contains(msg, "node node")) {
      c.report(std::string("expected a mismatch naming both ranks and nodes, got ") +
               std::to_string(rc) + ": " + msg);
    }
    sum_check(c, c.comm, 77);
    return 0;
  });
}

TEST_CASE(
    "daemons whose profiles choose different algorithms fail the operation at once, naming "
    "both plans; the communicator goes on") {
  // One node told collectives.algorithm=ring, the others left on auto
  // (pairwise on 3 nodes): their messages would never meet, and the
  // operation would wait out its deadline naming nobody's mistake.
  Cluster cl;
  for (int i = 0; i < 3; ++i) {
    Node& n = cl.add("node" + std::to_string(i), "127.0.0." + std::to_string(i + 2));
    n.extra = {"deadlines.heartbeat_ms=1000", "deadlines.operation_ms=30000"};
    if (i == 0) n.extra.push_back("collectives.algorithm=ring");
  }
  cl.start();
  run_layout(cl, {0, 1, 2}, 1 << 20, [](RankCtx& c) {
    const auto t0 = Clock::now();
    const collective_result_t rc = all_reduce_wait(c.comm, c.send, c.recv, 1 << 16);
    const char* msg = collective_last_error();
    if (rc != COLLECTIVE_MISMATCH || !contains(msg, "ring") || !contains(msg, "pairwise") ||
        !contains(msg, "node0") || !contains(msg, "collectives.algorithm")) {
      c.report(std::string("expected a mismatch naming both algorithms and node0, got ") +
               std::to_string(rc) + ": " + msg);
    }
    if (Clock::now() - t0 > 10s) c.report("the mismatch took as long as a timeout");
    // The override holds at every size (the others take the direct exchange
    // here): the next operation is answered the same way, not left hanging.
    const auto t1 = Clock::now();
    if (all_reduce_wait(c.comm, c.send, c.recv, 7) != COLLECTIVE_MISMATCH) {
      c.report(std::string("expected a second mismatch, got: ") + collective_last_error());
    }
    if (Clock::now() - t1 > 10s) c.report("the second mismatch took as long as a timeout");
    return 0;
  });
}

TEST_CASE(
    "a reload that changes one node's collectives.algorithm fails the operations after it "
    "with a mismatch; reloaded back, the communicator runs again") {
  Cluster cl;
  const std::string file = cl.dir.file("node1.yaml");
  write_file(file, "collectives:\n  algorithm: auto\n");
  for (int i = 0; i < 2; ++i) {
    Node& n = cl.add("node" + std::to_string(i), "127.0.0." + std::to_string(i + 2));
    n.extra = {"deadlines.heartbeat_ms=1000", "deadlines.operation_ms=30000"};
    if (i == 1) n.profile_file = file;
  }
  cl.start();
  const Daemon& node1 = *cl.nodes[1].daemon;
  // SIGHUP until the change is logged: under TSan a signal may wait long
  // for its thread (lifecycle_test), and a reload is idempotent.
  auto reload = [&](const char* algorithm, const std::string& logged, int nth) {
    write_file(file, std::string("collectives:\n  algorithm: ") + algorithm + "\n");
    for (int i = 0; i < 15; ++i) {
      ::kill(node1.pid(), SIGHUP);
      if (node1.wait_for_log(logged, 2s) && count_of(node1.log(), "event=reloaded") >= nth)
        return true;
    }
    return false;
  };
  run_layout(cl, {0, 1}, 1 << 16, [&](RankCtx& c) {
    sum_check(c, c.comm, 100);
    // Rank 1 (on node1) reloads its node before its next operation; rank 0
    // goes on at once: either way node1 plans the operation after the reload.
    if (c.rank == 1 && !reload("ring", "key=collectives.algorithm from=auto to=ring", 1)) {
      c.report("node1 did not log the reload to ring");
      return 1;
    }
    const collective_result_t rc = all_reduce_wait(c.comm, c.send, c.recv, 100);
    const char* msg = collective_last_error();
    if (rc != COLLECTIVE_MISMATCH || !contains(msg, "as ring") ||
        !contains(msg, "recursive_doubling") || !contains(msg, "collectives.algorithm")) {
      c.report(std::string("expected a mismatch of plans, got ") + std::to_string(rc) + ": " + msg);
    }
    if (c.rank == 1 && !reload("auto", "key=collectives.algorithm from=ring to=auto", 2)) {
      c.report("node1 did not log the reload back to auto");
      return 1;
    }
    sum_check(c, c.comm, 100);
    return 0;
  });
}

TEST_CASE("a rank killed on one node fails the others' operations naming it") {
  Cluster cl(2);
  run_layout(cl, {0, 1}, 1 << 16, [](RankCtx& c) {
    if (c.rank == 1) std::_Exit(0);  // dies without leaving
    const auto t0 = Clock::now();
    const collective_result_t rc =
        all_reduce_wait(c.comm, c.send, c.recv, 100);
    const char* msg = collective_last_error();
    if (rc == COLLECTIVE_OK || !contains(msg, "rank 1") || !contains(msg, "node1") ||
        !contains(msg, "disconnected")) {
      c.report(std::string("expected an error naming rank 1 on node1, got: ") + msg);
    }
    if (Clock::now() - t0 > 10s) c.report("the error took too long");
    c.comm = nullptr;  // broken: not destroyed
    return 0;
  });
}

TEST_CASE("an operation whose ranks on another node never come times out naming that node") {
  Cluster cl(2, {"deadlines.operation_ms=1500"});
  run_layout(cl, {0, 1}, 1 << 16, [](RankCtx& c) {
    if (c.rank == 1) {
      std::this_thread::sleep_for(3s);
      return 0;
    }
    const auto t0 = Clock::now();
    const collective_result_t rc = all_reduce_wait(c.comm, c.send, c.recv, 100);
    const auto took = Clock::now() - t0;
    const char* msg = collective_last_error();
    if (rc != COLLECTIVE_TIMEOUT || !contains(msg, "node1") || !contains(msg, "rank 1")) {
      c.report(std::string("expected a timeout naming node1 and rank 1, got: ") + msg);
    }
    if (took > 5s) c.report("the timeout came late");
    return 0;
  });
}

TEST_CASE("a peer daemon killed mid-operation fails it naming the node; restarted, it serves again") {
  Cluster cl(2);
  {
    const auto id = new_id(cl.socket(0));
    Child rank0([&] {
      RankCtx c = join(cl.socket(0), id, 2, 0, 1 << 16);
      if (!sum_check(c, c.comm, 10)) return 1;
      const auto t0 = Clock::now();
      const collective_result_t rc = all_reduce_wait(c.comm, c.send, c.recv, 100);
      const char* msg = collective_last_error();
      if (rc == COLLECTIVE_OK || !contains(msg, "node1") || !contains(msg, "unreachable")) {
        std::fprintf(stderr, "expected an error naming node1, got %d: %s\n", rc, msg);
        return 2;
      }
      if (Clock::now() - t0 > 10s) return 3;
      return 0;
    });
    Child rank1([&] {
      RankCtx c = join(cl.socket(1), id, 2, 1, 1 << 16);
      if (!sum_check(c, c.comm, 10)) return 1;
      std::this_thread::sleep_for(60s);  // never submits the second operation
      return 0;
    });
    std::this_thread::sleep_for(1500ms);  // both are past the first operation
    cl.nodes[1].daemon->signal(SIGKILL);
    auto s0 = rank0.wait(20s);
    CHECK(s0.exited);
    CHECK(s0.code == 0);
    rank1.kill(SIGKILL);
    rank1.wait(5s);
  }
  cl.nodes[1].daemon.reset();
  cl.nodes[1].start(true);
  run_layout(cl, {0, 1, 1}, 1 << 16, [](RankCtx& c) { return sum_check(c, c.comm, 1000) ? 0 : 1; });
}

TEST_CASE("a peer daemon killed while large all-gathers stream into the outputs fails the "
          "operation naming the node; the survivor serves on") {
  // 16 MiB per rank back to back: most of the time a chunk from node1 is
  // being read straight into rank 0's output (placed) when node1 dies. The
  // operation must still end with node1's name, and node0 must not wait for
  // more than the connection's end before answering.
  Cluster cl(2, {"log.level=debug"});
  const std::size_t count = std::size_t{4} << 20;  // int32
  const std::size_t bytes = count * 4 * 2 + 4096;
  const auto id = new_id(cl.socket(0));
  auto gather_until_error = [&](int rank, int max_ops) {
    RankCtx c = join(cl.socket(rank), id, 2, rank, bytes);
    for (int k = 0; k < max_ops; ++k) {
      collective_request_t* req = nullptr;
      const auto t0 = Clock::now();
      collective_result_t rc =
          collective_all_gather(c.comm, c.send, c.recv, count, COLLECTIVE_INT32, &req);
      if (rc == COLLECTIVE_OK) rc = collective_wait(req, 30000);
      collective_request_free(req);
      if (rc == COLLECTIVE_OK) continue;
      if (rank == 1) return 0;  // its own daemon is gone
      const char* msg = collective_last_error();
      if (!contains(msg, "node1")) {
        std::fprintf(stderr, "expected an error naming node1, got %d: %s\n", rc, msg);
        return 2;
      }
      if (Clock::now() - t0 > 10s) return 3;
      return 0;
    }
    return 5;  // never failed
  };
  Child rank0([&] { return gather_until_error(0, 100000); });
  Child rank1([&] { return gather_until_error(1, 100000); });
  // Until chunks are being placed on node0 (the path under test), then a
  // moment more so that the kill lands inside a stream of them.
  const auto until = Clock::now() + 60s;
  std::string log0;
  while (Clock::now() < until) {
    log0 = cl.nodes[0].daemon->log();
    if (log0.find("event=node_receive_placed") != std::string::npos) break;
    std::this_thread::sleep_for(100ms);
  }
  std::this_thread::sleep_for(300ms);
  cl.nodes[1].daemon->signal(SIGKILL);
  auto s0 = rank0.wait(30s);
  CHECK(s0.exited);
  CHECK(s0.code == 0);
  auto s1 = rank1.wait(30s);
  CHECK(s1.exited);
  CHECK(log0.find("event=node_receive_placed") != std::string::npos);
  // node0 serves a new communicator with a restarted node1.
  cl.nodes[1].daemon.reset();
  cl.nodes[1].start(true);
  run_layout(cl, {0, 1, 1}, 1 << 16, [](RankCtx& c) { return sum_check(c, c.comm, 1000) ? 0 : 1; });
}

TEST_CASE("a node with the wrong secret cannot join a communicator") {
  Cluster cl(1);
  Node bad;
  bad.name = "intruder";
  bad.ip = "127.0.0.9";
  bad.secret_file = write_secret(cl.dir, "wrong", "not the cluster secret\n");
  bad.start();
  const auto id = new_id(cl.socket(0));
  auto st = run_child(
      [&] {
        collective_client_t* client = nullptr;
        collective_comm_t* comm = nullptr;
        if (collective_connect(bad.daemon->socket().c_str(), "x", &client) != COLLECTIVE_OK) return 10;
        const collective_result_t rc = collective_comm_init_rank(client, &id, 2, 1, &comm);
        const char* msg = collective_last_error();
        if (rc == COLLECTIVE_OK || !contains(msg, "rendezvous daemon")) {
          std::fprintf(stderr, "expected a refusal, got %d: %s\n", rc, msg);
          return 1;
        }
        std::fprintf(stderr, "refused as expected: %s\n", msg);
        return 0;
      },
      30s);
  CHECK(st.exited);
  CHECK(st.code == 0);
}
