#include "tests/support/collective_check.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include "tests/support/harness.h"

namespace collectived::test {

const collective_dtype_t kDTypes[10] = {
    COLLECTIVE_INT8,    COLLECTIVE_UINT8,    COLLECTIVE_INT32,   COLLECTIVE_UINT32,
    COLLECTIVE_INT64,   COLLECTIVE_UINT64,   COLLECTIVE_FLOAT16, COLLECTIVE_BFLOAT16,
    COLLECTIVE_FLOAT32, COLLECTIVE_FLOAT64};
const collective_redop_t kRedOps[5] = {COLLECTIVE_SUM, COLLECTIVE_PROD, COLLECTIVE_MIN,
                                          COLLECTIVE_MAX, COLLECTIVE_AVG};
const std::size_t kCounts[5] = {0, 1, 7, 1001, 4099};

// ---- reference semantics (client/collective.h, engine/reduce.h) ----------------

using reference::get;
using reference::input_bits;
using reference::put;

const Op kOps[6] = {Op::all_reduce, Op::all_gather, Op::reduce_scatter,
                       Op::broadcast,  Op::reduce,     Op::all_to_all};
const char* name(Op op) {
  const char* names[] = {"all_reduce", "all_gather", "reduce_scatter",
                         "broadcast",  "reduce",     "all_to_all"};
  return names[static_cast<int>(op)];
}
bool reducing(Op op) { return op == Op::all_reduce || op == Op::reduce || op == Op::reduce_scatter; }

// ---- a rank in a child process -------------------------------------------------------

void RankCtx::report(const std::string& what) {
  if (++failures <= 5) std::fprintf(stderr, "rank %d: %s\n", rank, what.c_str());
}

/// Runs one case on this rank and checks its output. Returns false on error.
void run_case(RankCtx& c, Op op, collective_dtype_t d, collective_redop_t redop, std::size_t count,
              bool in_place, int root, std::uint64_t salt) {
  const std::size_t es = collective_dtype_size(d);
  const int n = c.n, rank = c.rank;
  const std::size_t send_elems = (op == Op::reduce_scatter || op == Op::all_to_all) ? count * n : count;
  // Buffer layout: out-of-place uses both buffers at odd offsets (registrations
  // are used at any offset); in-place uses recv only, in each op's layout.
  char* sbuf = c.send + es * 3;
  char* rbuf = c.recv + es * 5;
  if (in_place) {
    sbuf = rbuf;
    if (op == Op::all_gather) sbuf = rbuf + rank * count * es;
  }
  char* out = rbuf;
  if (in_place && op == Op::reduce_scatter) out = rbuf + rank * count * es;
  std::memset(c.recv, 0xa5, c.bytes);
  for (std::size_t i = 0; i < send_elems; ++i) put(d, sbuf, i, input_bits(d, redop, rank, i, salt));

  collective_request_t* req = nullptr;
  collective_result_t rc = COLLECTIVE_OK;
  switch (op) {
    case Op::all_reduce: rc = collective_all_reduce(c.comm, sbuf, out, count, d, redop, &req); break;
    case Op::all_gather: rc = collective_all_gather(c.comm, sbuf, out, count, d, &req); break;
    case Op::reduce_scatter:
      rc = collective_reduce_scatter(c.comm, sbuf, out, count, d, redop, &req);
      break;
    case Op::broadcast: rc = collective_broadcast(c.comm, sbuf, out, count, d, root, &req); break;
    case Op::reduce: rc = collective_reduce(c.comm, sbuf, out, count, d, redop, root, &req); break;
    case Op::all_to_all: rc = collective_all_to_all(c.comm, sbuf, out, count, d, &req); break;
  }
  const std::string what = std::string(name(op)) + " " + collective_dtype_name(d) + " " +
                           collective_redop_name(redop) + " count " + std::to_string(count) +
                           (in_place ? " in-place" : " out-of-place") + " root " +
                           std::to_string(root);
  if (rc == COLLECTIVE_OK) rc = collective_wait(req, 20000);
  collective_request_free(req);
  if (rc != COLLECTIVE_OK) {
    c.report(what + ": " + collective_last_error());
    return;
  }
  std::vector<std::uint64_t> in(n);
  bool reduced_value = false;  // `in` holds the inputs of the value checked
  auto check = [&](std::size_t at, std::uint64_t want) {
    const std::uint64_t got = get(d, out, at);
    const bool ok = got == want || (c.tolerant && reduced_value &&
                                    reference::close_enough(d, redop, got, want, in));
    if (!ok) {
      c.report(what + ": element " + std::to_string(at) + " is " + std::to_string(got) +
               ", expected " + std::to_string(want));
    }
  };
  auto reduced = [&](std::size_t j) {
    reduced_value = true;
    for (int k = 0; k < n; ++k) in[k] = input_bits(d, redop, k, j, salt);
    return reference::reduce(d, redop, in);
  };
  switch (op) {
    case Op::all_reduce:
      for (std::size_t i = 0; i < count; ++i) check(i, reduced(i));
      break;
    case Op::reduce:
      if (rank == root) {
        for (std::size_t i = 0; i < count; ++i) check(i, reduced(i));
      }
      break;
    case Op::reduce_scatter:
      for (std::size_t i = 0; i < count; ++i) check(i, reduced(rank * count + i));
      break;
    case Op::broadcast:
      for (std::size_t i = 0; i < count; ++i) check(i, input_bits(d, redop, root, i, salt));
      break;
    case Op::all_gather:
      for (int k = 0; k < n; ++k)
        for (std::size_t i = 0; i < count; ++i) check(k * count + i, input_bits(d, redop, k, i, salt));
      break;
    case Op::all_to_all:
      for (int k = 0; k < n; ++k)
        for (std::size_t i = 0; i < count; ++i) {
          check(k * count + i, input_bits(d, redop, k, rank * count + i, salt));
        }
      break;
  }
}

/// Connects, joins `id` as `rank` of `n`, allocates buffers. Exits the child on failure.
RankCtx join(const std::string& socket, const collective_unique_id_t& id, int n, int rank,
             std::size_t bytes) {
  RankCtx c;
  c.rank = rank;
  c.n = n;
  c.bytes = bytes;
  const std::string nm = "rank " + std::to_string(rank);
  if (collective_connect(socket.c_str(), nm.c_str(), &c.client) != COLLECTIVE_OK ||
      collective_comm_init_rank(c.client, &id, n, rank, &c.comm) != COLLECTIVE_OK) {
    std::fprintf(stderr, "rank %d: %s\n", rank, collective_last_error());
    std::_Exit(10);
  }
  void* a = nullptr;
  void* b = nullptr;
  if (bytes > 0 && (collective_host_alloc(c.client, bytes, &a) != COLLECTIVE_OK ||
                    collective_host_alloc(c.client, bytes, &b) != COLLECTIVE_OK)) {
    std::fprintf(stderr, "rank %d: %s\n", rank, collective_last_error());
    std::_Exit(11);
  }
  c.send = static_cast<char*>(a);
  c.recv = static_cast<char*>(b);
  return c;
}

collective_unique_id_t new_id(const std::string& socket) {
  collective_client_t* c = nullptr;
  REQUIRE(collective_connect(socket.c_str(), "id maker", &c) == COLLECTIVE_OK);
  collective_unique_id_t id;
  REQUIRE(collective_get_unique_id(c, &id) == COLLECTIVE_OK);
  collective_disconnect(c);
  return id;
}

std::uint64_t raw_comm_of_one(RawClient& raw, const std::string& socket, std::uint64_t id) {
  const collective_unique_id_t uid = new_id(socket);
  capnp::MallocMessageBuilder init;
  auto m = init.initRoot<wire::Message>();
  m.setId(id);
  auto ci = m.initCommInit();
  std::uint8_t secret[16] = {1, 2, 3};
  ci.setSecret(capnp::Data::Reader(secret, 16));
  ci.setRendezvous(uid.internal + 24);  // the rendezvous address inside the id
  ci.setNranks(1);
  ci.setRank(0);
  raw.send(init);
  auto ready = raw.receive(std::chrono::seconds(5));
  REQUIRE(ready);
  REQUIRE(ready->message().isCommReady());
  return ready->message().getCommReady().getComm();
}

RawCommMemory raw_comm_with_memory(RawClient& raw, const std::string& socket, std::uint64_t id,
                                   std::size_t bytes) {
  RawCommMemory r;
  r.comm = raw_comm_of_one(raw, socket, id);
  UniqueFd mem = sealed_memfd(bytes);
  auto reg = raw.register_host(id + 1, bytes, {mem.get()});
  REQUIRE(reg);
  REQUIRE(reg->message().isRegistered());
  r.handle = reg->message().getRegistered().getHandle();
  return r;
}

/// Runs `body(rank)` in `n` child processes; checks every one exits 0.
void run_ranks(int n, const std::function<int(int)>& body, std::chrono::milliseconds timeout) {
  std::vector<std::unique_ptr<Child>> kids;
  for (int r = 0; r < n; ++r) kids.push_back(std::make_unique<Child>([&body, r] { return body(r); }));
  for (int r = 0; r < n; ++r) {
    auto s = kids[r]->wait(timeout);
    INFO("rank " << r);
    CHECK(s.exited);
    CHECK(s.code == 0);
  }
}

/// Message check helper inside children.
bool contains(const char* text, const std::string& part) {
  return std::string(text).find(part) != std::string::npos;
}


void run_matrix(RankCtx& c) {
  const int n = c.n;
  std::uint64_t salt = 1;
  for (Op op : kOps) {
    for (collective_dtype_t dt : kDTypes) {
      for (collective_redop_t redop : kRedOps) {
        if (!reducing(op) && redop != COLLECTIVE_SUM) continue;
        for (std::size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            const int root = static_cast<int>(salt % n);
            run_case(c, op, dt, redop, count, in_place, root, salt++);
          }
        }
      }
    }
  }
  collective_request_t* r = nullptr;
  if (collective_barrier(c.comm, &r) != COLLECTIVE_OK || collective_wait(r, 20000) != COLLECTIVE_OK) {
    c.report(std::string("barrier: ") + collective_last_error());
  }
  collective_request_free(r);
}

}  // namespace collectived::test
