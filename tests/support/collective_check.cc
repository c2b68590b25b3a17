#include "tests/support/collective_check.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include "ipc/half.h"
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

/// Deterministic input element `i` of `rank` for a test case, as raw bits.
std::uint64_t input_bits(collective_dtype_t d, collective_redop_t op, int rank, std::size_t i,
                         std::uint64_t salt) {
  // splitmix64 of (salt, rank, i): cheap, and different for every element.
  std::uint64_t r = salt * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(rank) * 0xbf58476d1ce4e5b9ull +
                    i * 0x94d049bb133111ebull;
  r = (r ^ (r >> 30)) * 0xbf58476d1ce4e5b9ull;
  r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
  r ^= r >> 31;
  auto fp = [&](double lo, double hi) {
    return lo + (hi - lo) * static_cast<double>(r >> 11) / static_cast<double>(1ull << 53);
  };
  // Products of floats stay in [0.5, 2) so that they neither overflow nor vanish.
  const double f = op == COLLECTIVE_PROD ? fp(0.5, 2.0) : fp(-100.0, 100.0);
  switch (d) {
    case COLLECTIVE_FLOAT16: return f32_to_f16(static_cast<float>(f));
    case COLLECTIVE_BFLOAT16: return f32_to_bf16(static_cast<float>(f));
    case COLLECTIVE_FLOAT32: return std::bit_cast<std::uint32_t>(static_cast<float>(f));
    case COLLECTIVE_FLOAT64: return std::bit_cast<std::uint64_t>(f);
    default: {
      // Integers: the full range of the type, so sums and products wrap.
      const std::size_t bits = 8 * collective_dtype_size(d);
      return bits == 64 ? r : r & ((std::uint64_t{1} << bits) - 1);
    }
  }
}

void put(collective_dtype_t d, void* base, std::size_t i, std::uint64_t bits) {
  switch (collective_dtype_size(d)) {
    case 1: static_cast<std::uint8_t*>(base)[i] = static_cast<std::uint8_t>(bits); break;
    case 2: static_cast<std::uint16_t*>(base)[i] = static_cast<std::uint16_t>(bits); break;
    case 4: static_cast<std::uint32_t*>(base)[i] = static_cast<std::uint32_t>(bits); break;
    default: static_cast<std::uint64_t*>(base)[i] = bits; break;
  }
}

std::uint64_t get(collective_dtype_t d, const void* base, std::size_t i) {
  switch (collective_dtype_size(d)) {
    case 1: return static_cast<const std::uint8_t*>(base)[i];
    case 2: return static_cast<const std::uint16_t*>(base)[i];
    case 4: return static_cast<const std::uint32_t*>(base)[i];
    default: return static_cast<const std::uint64_t*>(base)[i];
  }
}

namespace {

template <typename T>
std::uint64_t int_reduce(collective_redop_t op, const std::vector<std::uint64_t>& in) {
  using U = std::make_unsigned_t<T>;
  U acc = static_cast<U>(in[0]);
  for (std::size_t k = 1; k < in.size(); ++k) {
    const U v = static_cast<U>(in[k]);
    switch (op) {
      case COLLECTIVE_SUM:
      case COLLECTIVE_AVG: acc = static_cast<U>(acc + v); break;
      case COLLECTIVE_PROD: acc = static_cast<U>(acc * v); break;
      case COLLECTIVE_MIN: acc = static_cast<T>(v) < static_cast<T>(acc) ? v : acc; break;
      case COLLECTIVE_MAX: acc = static_cast<T>(v) > static_cast<T>(acc) ? v : acc; break;
    }
  }
  if (op == COLLECTIVE_AVG) {
    acc = static_cast<U>(static_cast<T>(acc) / static_cast<T>(in.size()));
  }
  return static_cast<std::uint64_t>(acc);
}

template <typename A>
A float_reduce(collective_redop_t op, const std::vector<A>& in) {
  A acc = in[0];
  for (std::size_t k = 1; k < in.size(); ++k) {
    const A v = in[k];
    switch (op) {
      case COLLECTIVE_SUM:
      case COLLECTIVE_AVG: acc = acc + v; break;
      case COLLECTIVE_PROD: acc = acc * v; break;
      case COLLECTIVE_MIN: acc = v < acc ? v : acc; break;
      case COLLECTIVE_MAX: acc = v > acc ? v : acc; break;
    }
  }
  if (op == COLLECTIVE_AVG) acc = acc / static_cast<A>(in.size());
  return acc;
}

double as_double(collective_dtype_t d, std::uint64_t b) {
  switch (d) {
    case COLLECTIVE_FLOAT16: return f16_to_f32(static_cast<std::uint16_t>(b));
    case COLLECTIVE_BFLOAT16: return bf16_to_f32(static_cast<std::uint16_t>(b));
    case COLLECTIVE_FLOAT32: return std::bit_cast<float>(static_cast<std::uint32_t>(b));
    default: return std::bit_cast<double>(b);
  }
}

/// Whether `got` is within the rounding a different reduction order can
/// cause: a few units of the type's precision times the inputs' magnitude.
bool close_enough(collective_dtype_t d, collective_redop_t op, std::uint64_t got,
                  std::uint64_t want, const std::vector<std::uint64_t>& in) {
  if (got == want) return true;
  if (op == COLLECTIVE_MIN || op == COLLECTIVE_MAX) return false;
  double eps = 0;
  switch (d) {
    case COLLECTIVE_FLOAT16: eps = 1.0 / 1024; break;
    case COLLECTIVE_BFLOAT16: eps = 1.0 / 128; break;
    case COLLECTIVE_FLOAT32: eps = 1.0 / (1 << 23); break;
    case COLLECTIVE_FLOAT64: eps = 1.0 / (1ull << 52); break;
    default: return false;  // integers are exact in any order
  }
  const double g = as_double(d, got), w = as_double(d, want);
  double scale = 0;
  if (op == COLLECTIVE_PROD) {
    scale = std::fabs(w);
  } else {
    for (auto b : in) scale += std::fabs(as_double(d, b));
    if (op == COLLECTIVE_AVG) scale /= static_cast<double>(in.size());
  }
  return std::fabs(g - w) <= 4.0 * eps * scale * static_cast<double>(in.size()) + 1e-30;
}

}  // namespace

/// Reduction of raw inputs in rank order, as raw result bits.
std::uint64_t reference(collective_dtype_t d, collective_redop_t op,
                        const std::vector<std::uint64_t>& in) {
  switch (d) {
    case COLLECTIVE_INT8: return int_reduce<std::int8_t>(op, in);
    case COLLECTIVE_UINT8: return int_reduce<std::uint8_t>(op, in);
    case COLLECTIVE_INT32: return int_reduce<std::int32_t>(op, in);
    case COLLECTIVE_UINT32: return int_reduce<std::uint32_t>(op, in);
    case COLLECTIVE_INT64: return int_reduce<std::int64_t>(op, in);
    case COLLECTIVE_UINT64: return int_reduce<std::uint64_t>(op, in);
    case COLLECTIVE_FLOAT16:
    case COLLECTIVE_BFLOAT16: {
      std::vector<float> f;
      for (auto b : in) {
        f.push_back(d == COLLECTIVE_FLOAT16 ? f16_to_f32(static_cast<std::uint16_t>(b))
                                            : bf16_to_f32(static_cast<std::uint16_t>(b)));
      }
      const float r = float_reduce(op, f);
      return d == COLLECTIVE_FLOAT16 ? f32_to_f16(r) : f32_to_bf16(r);
    }
    case COLLECTIVE_FLOAT32: {
      std::vector<float> f;
      for (auto b : in) f.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(b)));
      return std::bit_cast<std::uint32_t>(float_reduce(op, f));
    }
    case COLLECTIVE_FLOAT64: {
      std::vector<double> f;
      for (auto b : in) f.push_back(std::bit_cast<double>(b));
      return std::bit_cast<std::uint64_t>(float_reduce(op, f));
    }
  }
  return 0;
}

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
                                    close_enough(d, redop, got, want, in));
    if (!ok) {
      c.report(what + ": element " + std::to_string(at) + " is " + std::to_string(got) +
               ", expected " + std::to_string(want));
    }
  };
  auto reduced = [&](std::size_t j) {
    reduced_value = true;
    for (int k = 0; k < n; ++k) in[k] = input_bits(d, redop, k, j, salt);
    return reference(d, redop, in);
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
