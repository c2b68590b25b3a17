// soak_client: many ranks (processes) doing random collectives, dtypes,
// reductions and sizes on several communicators through the public C API,
// every result checked against tests/support/reference.h. Used by
// scripts/soak (bounded time, then the daemon's memory and descriptors are
// compared with their starting level) and scripts/load (latency).
//
//   soak_client run --socket S [--socket S2 ...] --ranks N --comms C --seconds T [--seed X]
//       [--max-count E] [--small]            # --small: 1..64 elements, latency report
//   soak_client status --socket S            # one line: key=value of the daemon's status
//
// With several --socket (daemons standing for nodes), rank r connects to the
// (r mod n)-th; the unique ids come from the first.
// Every rank follows the same pseudo-random plan (seeded by --seed), so the
// ranks of a communicator submit the same operations in the same order. Each
// round submits one operation on each of up to C communicators at once, then
// waits for all of them. Every 8 rounds the ranks agree (an all-reduce of
// max over "time is up") whether to stop, so they stop together. Now and then
// a round also frees and re-allocates a buffer (registration churn) or splits
// a communicator, uses the child and destroys it.
// Exit 0 only if every operation succeeded and matched the reference.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "client/collective.h"
#include "tests/support/reference.h"

namespace ref = collectived::test::reference;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string mode;
  std::string socket;
  std::vector<std::string> sockets;  ///< every --socket; rank r uses sockets[r % size]
  int ranks = 4;
  int comms = 4;
  double seconds = 10;
  std::uint64_t seed = 1;
  std::size_t max_count = 1 << 14;
  bool small = false;
  std::string latency_dir;  ///< --latency-dir: each rank writes its latencies (us) there
};

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: soak_client run --socket S [--ranks N] [--comms C] [--seconds T] "
               "[--seed X] [--max-count E] [--small]\n"
               "       soak_client status --socket S\n");
  std::exit(2);
}

Args parse(int argc, char** argv) {
  if (argc < 2) usage();
  Args a;
  a.mode = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (k == "--socket") a.sockets.push_back(val());
    else if (k == "--ranks") a.ranks = std::stoi(val());
    else if (k == "--comms") a.comms = std::stoi(val());
    else if (k == "--seconds") a.seconds = std::stod(val());
    else if (k == "--seed") a.seed = std::stoull(val());
    else if (k == "--max-count") a.max_count = std::stoull(val());
    else if (k == "--small") a.small = true;
    else if (k == "--latency-dir") a.latency_dir = val();
    else usage();
  }
  if (a.sockets.empty() || a.ranks < 1 || a.comms < 1) usage();
  a.socket = a.sockets[0];
  // Small operations need small buffers. Sized for the default 16 Ki
  // elements, each of 64 ranks had 16 x 2 buffers of 8 MiB and cleared one
  // before every operation: 16 GiB of memfd pages touched on a 24 GiB
  // machine, and first-touch page faults that made each submission take
  // about a second (what scripts/load measured as p99 46 s).
  if (a.small) a.max_count = std::min<std::size_t>(a.max_count, 64);
  return a;
}

enum class Op { all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, barrier, sendrecv };
const char* kOpNames[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast",
                          "reduce",     "all_to_all", "barrier",        "sendrecv"};

/// One planned operation, the same on every rank.
struct Plan {
  Op op;
  collective_dtype_t dtype;
  collective_redop_t redop;
  std::size_t count;
  int root;
  bool in_place;
  std::uint64_t salt;
};

struct CommState {
  collective_comm_t* comm = nullptr;
  char* send = nullptr;
  char* recv = nullptr;
  std::size_t bytes = 0;
};

struct Rank {
  const Args& args;
  int rank;
  collective_client_t* client = nullptr;
  std::vector<CommState> comms;
  std::uint64_t ops = 0, failures = 0;
  std::vector<double> latencies_us;
  Clock::time_point began = Clock::now();
  double setup_ms = 0, start_wait_ms = 0;

  void fail(const std::string& what) {
    if (++failures <= 10) std::fprintf(stderr, "soak rank %d: %s\n", rank, what.c_str());
  }
};

std::size_t buffer_bytes(const Args& a) { return a.max_count * 8 * static_cast<std::size_t>(a.ranks) + 64; }

Plan make_plan(std::mt19937_64& rng, const Args& a, int n) {
  Plan p;
  p.op = static_cast<Op>(rng() % 8);
  p.dtype = static_cast<collective_dtype_t>(rng() % 10);
  p.redop = static_cast<collective_redop_t>(rng() % 5);
  // Sizes: mostly small, sometimes up to max_count (log-uniform).
  const std::size_t hi = a.max_count;
  const int bits = static_cast<int>(rng() % (64 - __builtin_clzll(hi) + 1));
  p.count = std::min<std::size_t>(hi, (std::size_t{1} << bits) - 1 + rng() % 3);
  if (p.op == Op::barrier) p.count = 0;
  p.root = static_cast<int>(rng() % n);
  p.in_place = (rng() % 3) == 0 && p.op != Op::sendrecv;
  p.salt = rng();
  return p;
}

/// Prepares the inputs of `p` on this rank and submits it.
collective_result_t submit(CommState& c, const Plan& p, collective_request_t** req,
                           char** out) {
  const int n = collective_comm_size(c.comm), rank = collective_comm_rank(c.comm);
  const collective_dtype_t d = p.dtype;
  const std::size_t es = collective_dtype_size(d), count = p.count;
  const std::size_t send_elems =
      (p.op == Op::reduce_scatter || p.op == Op::all_to_all) ? count * n : count;
  char* sbuf = c.send + es;  // odd offsets on purpose
  char* rbuf = c.recv + 3 * es;
  if (p.in_place) {
    sbuf = rbuf;
    if (p.op == Op::all_gather) sbuf = rbuf + rank * count * es;
  }
  *out = rbuf;
  if (p.in_place && p.op == Op::reduce_scatter) *out = rbuf + rank * count * es;
  std::memset(c.recv, 0xa5, c.bytes);
  for (std::size_t i = 0; i < send_elems; ++i) {
    ref::put(d, sbuf, i, ref::input_bits(d, p.redop, rank, i, p.salt));
  }
  switch (p.op) {
    case Op::all_reduce: return collective_all_reduce(c.comm, sbuf, *out, count, d, p.redop, req);
    case Op::all_gather: return collective_all_gather(c.comm, sbuf, *out, count, d, req);
    case Op::reduce_scatter:
      return collective_reduce_scatter(c.comm, sbuf, *out, count, d, p.redop, req);
    case Op::broadcast: return collective_broadcast(c.comm, sbuf, *out, count, d, p.root, req);
    case Op::reduce: return collective_reduce(c.comm, sbuf, *out, count, d, p.redop, p.root, req);
    case Op::all_to_all: return collective_all_to_all(c.comm, sbuf, *out, count, d, req);
    case Op::barrier: return collective_barrier(c.comm, req);
    case Op::sendrecv: {
      // A ring: send to the next rank, receive from the previous one.
      collective_result_t rc = collective_group_start(c.comm);
      if (rc == COLLECTIVE_OK) rc = collective_send(c.comm, sbuf, count, d, (rank + 1) % n);
      if (rc == COLLECTIVE_OK) rc = collective_recv(c.comm, *out, count, d, (rank + n - 1) % n);
      if (rc == COLLECTIVE_OK) rc = collective_group_end(c.comm, req);
      return rc;
    }
  }
  return COLLECTIVE_INVALID_ARGUMENT;
}

/// Checks the output of `p` on this rank; the number of wrong elements.
std::size_t check(const CommState& c, const Plan& p, const char* out, bool tolerant) {
  const int n = collective_comm_size(c.comm), rank = collective_comm_rank(c.comm);
  const collective_dtype_t d = p.dtype;
  std::size_t wrong = 0;
  std::vector<std::uint64_t> in(n);
  bool reduced_value = false;
  auto expect = [&](std::size_t at, std::uint64_t want) {
    const std::uint64_t got = ref::get(d, out, at);
    if (got != want && !(tolerant && reduced_value && ref::close_enough(d, p.redop, got, want, in))) ++wrong;
  };
  auto reduced = [&](std::size_t j) {
    reduced_value = true;
    for (int k = 0; k < n; ++k) in[k] = ref::input_bits(d, p.redop, k, j, p.salt);
    return ref::reduce(d, p.redop, in);
  };
  const std::size_t count = p.count;
  switch (p.op) {
    case Op::all_reduce:
      for (std::size_t i = 0; i < count; ++i) expect(i, reduced(i));
      break;
    case Op::reduce:
      if (rank == p.root)
        for (std::size_t i = 0; i < count; ++i) expect(i, reduced(i));
      break;
    case Op::reduce_scatter:
      for (std::size_t i = 0; i < count; ++i) expect(i, reduced(rank * count + i));
      break;
    case Op::broadcast:
      for (std::size_t i = 0; i < count; ++i) expect(i, ref::input_bits(d, p.redop, p.root, i, p.salt));
      break;
    case Op::all_gather:
      for (int k = 0; k < n; ++k)
        for (std::size_t i = 0; i < count; ++i)
          expect(k * count + i, ref::input_bits(d, p.redop, k, i, p.salt));
      break;
    case Op::all_to_all:
      for (int k = 0; k < n; ++k)
        for (std::size_t i = 0; i < count; ++i)
          expect(k * count + i, ref::input_bits(d, p.redop, k, rank * count + i, p.salt));
      break;
    case Op::barrier:
      break;
    case Op::sendrecv:
      for (std::size_t i = 0; i < count; ++i)
        expect(i, ref::input_bits(d, p.redop, (rank + n - 1) % n, i, p.salt));
      break;
  }
  return wrong;
}

bool alloc_buffers(Rank& r, CommState& c) {
  c.bytes = buffer_bytes(r.args);
  if (collective_host_alloc(r.client, c.bytes, reinterpret_cast<void**>(&c.send)) != COLLECTIVE_OK ||
      collective_host_alloc(r.client, c.bytes, reinterpret_cast<void**>(&c.recv)) != COLLECTIVE_OK) {
    r.fail(std::string("host_alloc: ") + collective_last_error());
    return false;
  }
  return true;
}

/// All ranks: true if any rank's `flag` is set (all-reduce max on comm 0).
bool any(Rank& r, bool flag) {
  CommState& c = r.comms[0];
  auto* v = reinterpret_cast<std::uint32_t*>(c.send);
  *v = flag ? 1 : 0;
  collective_request_t* req = nullptr;
  collective_result_t rc = collective_all_reduce(c.comm, v, v, 1, COLLECTIVE_UINT32, COLLECTIVE_MAX, &req);
  if (rc == COLLECTIVE_OK) rc = collective_wait(req, 60000);
  collective_request_free(req);
  if (rc != COLLECTIVE_OK) {
    r.fail(std::string("stop vote: ") + collective_last_error());
    return true;
  }
  return *v != 0;
}

int run_rank(const Args& a, int rank, const std::vector<collective_unique_id_t>& ids) {
  Rank r{a, rank, nullptr, {}, 0, 0, {}, Clock::now(), 0, 0};
  const std::string name = "soak rank " + std::to_string(rank);
  // Ranks spread over the daemons given (nodes): communicators span them all.
  const std::string& socket = a.sockets[rank % a.sockets.size()];
  if (collective_connect(socket.c_str(), name.c_str(), &r.client) != COLLECTIVE_OK) {
    std::fprintf(stderr, "soak rank %d: connect: %s\n", rank, collective_last_error());
    return 1;
  }
  r.comms.resize(a.comms);
  for (int k = 0; k < a.comms; ++k) {
    if (collective_comm_init_rank(r.client, &ids[k], a.ranks, rank, &r.comms[k].comm) != COLLECTIVE_OK) {
      std::fprintf(stderr, "soak rank %d: comm_init %d: %s\n", rank, k, collective_last_error());
      return 1;
    }
    if (!alloc_buffers(r, r.comms[k])) return 1;
  }
  // Every rank waits here until all have set up their communicators: setting
  // up 16 communicators of 64 ranks on 2 cores takes tens of seconds, and
  // without this start line each rank's clock started at a different time
  // and the first operations' latencies were the other ranks' set-up time
  // (scripts/load's p99 of 46 s).
  const auto setup_done = Clock::now();
  const bool stop_now = any(r, false);
  const auto start = Clock::now();
  r.setup_ms = std::chrono::duration<double, std::milli>(setup_done - r.began).count();
  r.start_wait_ms = std::chrono::duration<double, std::milli>(start - setup_done).count();
  if (stop_now) return 1;
  std::mt19937_64 rng(a.seed);  // the same plan on every rank
  const auto end = start + std::chrono::duration<double>(a.seconds);
  std::uint64_t rounds = 0;
  for (;;) {
    if (rounds % 8 == 0 && any(r, Clock::now() >= end)) break;
    ++rounds;
    const int width = 1 + static_cast<int>(rng() % a.comms);
    const int first = static_cast<int>(rng() % a.comms);
    std::vector<Plan> plans;
    std::vector<collective_request_t*> reqs(width, nullptr);
    std::vector<char*> outs(width, nullptr);
    std::vector<collective_result_t> rcs(width, COLLECTIVE_OK);
    std::vector<Clock::time_point> submitted(width);
    for (int w = 0; w < width; ++w) {
      plans.push_back(make_plan(rng, a, a.ranks));
      CommState& c = r.comms[(first + w) % a.comms];
      submitted[w] = Clock::now();
      rcs[w] = submit(c, plans[w], &reqs[w], &outs[w]);
    }
    for (int w = 0; w < width; ++w) {
      CommState& c = r.comms[(first + w) % a.comms];
      const Plan& p = plans[w];
      if (rcs[w] == COLLECTIVE_OK) rcs[w] = collective_wait(reqs[w], 60000);
      collective_request_free(reqs[w]);
      // Submission (inputs written, request sent) to completion seen by this rank.
      if (a.small) {
        r.latencies_us.push_back(
            std::chrono::duration<double, std::micro>(Clock::now() - submitted[w]).count());
      }
      ++r.ops;
      const std::string what = std::string(kOpNames[static_cast<int>(p.op)]) + " " +
                               collective_dtype_name(p.dtype) + " " + collective_redop_name(p.redop) +
                               " count " + std::to_string(p.count) + (p.in_place ? " in-place" : "") +
                               " on comm " + std::to_string((first + w) % a.comms);
      if (rcs[w] != COLLECTIVE_OK) {
        r.fail(what + ": " + collective_last_error());
        continue;
      }
      if (const std::size_t wrong = check(c, p, outs[w], a.sockets.size() > 1)) {
        r.fail(what + ": " + std::to_string(wrong) + " wrong elements");
      }
    }
    // Registration churn: one communicator's buffers are freed and allocated again.
    if (rng() % 16 == 0) {
      CommState& c = r.comms[rng() % a.comms];
      collective_host_free(r.client, c.send);
      collective_host_free(r.client, c.recv);
      if (!alloc_buffers(r, c)) break;
    }
    // A split into halves, one all-reduce on the child, destroy.
    if (a.ranks > 1 && rng() % 32 == 0) {
      CommState& parent = r.comms[rng() % a.comms];
      collective_comm_t* child = nullptr;
      const int color = rank % 2;
      if (collective_comm_split(parent.comm, color, -rank, &child) != COLLECTIVE_OK) {
        r.fail(std::string("comm_split: ") + collective_last_error());
      } else {
        CommState cs{child, parent.send, parent.recv, parent.bytes};
        Plan p{Op::all_reduce, COLLECTIVE_INT32, COLLECTIVE_SUM, 33, 0, false, rng()};
        collective_request_t* req = nullptr;
        char* out = nullptr;
        collective_result_t rc = submit(cs, p, &req, &out);
        if (rc == COLLECTIVE_OK) rc = collective_wait(req, 60000);
        collective_request_free(req);
        if (rc != COLLECTIVE_OK) r.fail(std::string("all_reduce on a split: ") + collective_last_error());
        else if (check(cs, p, out, a.sockets.size() > 1) != 0) r.fail("all_reduce on a split: wrong result");
        if (collective_comm_destroy(child) != COLLECTIVE_OK) {
          r.fail(std::string("comm_destroy: ") + collective_last_error());
        }
      }
    }
  }
  for (auto& c : r.comms) {
    collective_comm_destroy(c.comm);
    collective_host_free(r.client, c.send);
    collective_host_free(r.client, c.recv);
  }
  collective_disconnect(r.client);
  std::printf("rank=%d rounds=%" PRIu64 " operations=%" PRIu64 " failures=%" PRIu64
              " setup_ms=%.0f start_wait_ms=%.0f",
              rank, rounds, r.ops, r.failures, r.setup_ms, r.start_wait_ms);
  if (!a.latency_dir.empty()) {
    if (std::FILE* f = std::fopen((a.latency_dir + "/rank-" + std::to_string(rank)).c_str(), "w")) {
      for (double l : r.latencies_us) std::fprintf(f, "%.1f\n", l);
      std::fclose(f);
    }
  }
  if (a.small && !r.latencies_us.empty()) {
    auto& l = r.latencies_us;
    std::sort(l.begin(), l.end());
    std::printf(" p50_us=%.1f p99_us=%.1f max_us=%.1f", l[l.size() / 2], l[l.size() * 99 / 100],
                l.back());
  }
  std::printf("\n");
  std::fflush(stdout);
  return r.failures == 0 ? 0 : 1;
}

int status(const Args& a) {
  collective_client_t* c = nullptr;
  if (collective_connect(a.socket.c_str(), "soak status", &c) != COLLECTIVE_OK) {
    std::fprintf(stderr, "status: %s\n", collective_last_error());
    return 1;
  }
  collective_status_t s;
  if (collective_status(c, &s) != COLLECTIVE_OK) {
    std::fprintf(stderr, "status: %s\n", collective_last_error());
    return 1;
  }
  // This client is one of the clients; it holds no registrations.
  std::printf("pid=%d clients=%u registrations=%u registered_bytes=%" PRIu64
              " resident_bytes=%" PRIu64 " open_descriptors=%u\n",
              s.daemon_pid, s.clients, s.registrations, s.registered_bytes, s.resident_bytes,
              s.open_descriptors);
  collective_disconnect(c);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (a.mode == "status") return status(a);
  if (a.mode != "run") usage();
  // The unique ids, made before the ranks are forked (the "launcher").
  std::vector<collective_unique_id_t> ids(a.comms);
  {
    collective_client_t* c = nullptr;
    if (collective_connect(a.socket.c_str(), "soak launcher", &c) != COLLECTIVE_OK) {
      std::fprintf(stderr, "soak: connect: %s\n", collective_last_error());
      return 1;
    }
    for (auto& id : ids) {
      if (collective_get_unique_id(c, &id) != COLLECTIVE_OK) {
        std::fprintf(stderr, "soak: unique id: %s\n", collective_last_error());
        return 1;
      }
    }
    collective_disconnect(c);
  }
  std::vector<pid_t> pids;
  for (int rank = 0; rank < a.ranks; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) _exit(run_rank(a, rank, ids));
    pids.push_back(pid);
  }
  int bad = 0;
  for (pid_t pid : pids) {
    int st = 0;
    ::waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ++bad;
  }
  std::printf("soak: %d ranks, %d communicators: %s\n", a.ranks, a.comms,
              bad == 0 ? "every operation matched the reference" : "FAILED");
  return bad == 0 ? 0 : 1;
}
