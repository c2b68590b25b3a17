// libcollective's C API for communicators and collectives.
#include <sys/random.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "client/client_internal.h"
#include "client/direct.h"
#include "client/staging.h"

using namespace collectived;
using namespace collectived::client;

namespace {

constexpr char kIdMagic[4] = {'C', 'D', 'I', 'D'};
constexpr std::size_t kSecretAt = 8, kSecretBytes = 16;
constexpr std::size_t kAddressAt = 24, kAddressBytes = 64;
constexpr std::size_t kNodeAt = 88, kNodeBytes = 40;

struct DTypeInfo {
  const char* name;
  std::size_t size;
};
// nccl-tests spellings, in collective_dtype_t order.
constexpr DTypeInfo kDTypes[] = {{"int8", 1},  {"uint8", 1},  {"int32", 4},   {"uint32", 4},
                                 {"int64", 8}, {"uint64", 8}, {"half", 2},    {"bfloat16", 2},
                                 {"float", 4}, {"double", 8}};
constexpr const char* kRedOps[] = {"sum", "prod", "min", "max", "avg"};

bool valid_dtype(collective_dtype_t d) { return d >= COLLECTIVE_INT8 && d <= COLLECTIVE_FLOAT64; }

}  // namespace

struct collective_comm {
  collective_client_t* client = nullptr;
  std::uint64_t handle = 0;
  int rank = 0;
  int nranks = 0;
  int nodes = 0;  // 0: unknown (an older daemon)
  int node = 0;
  int next_node_first_rank = 0;
  std::string name;
  /// collective_comm_set_timeout: the deadline (ms) later operations carry;
  /// 0: the node's deadlines.operation_ms.
  std::atomic<std::int64_t> timeout_ms{0};
  std::mutex group_mutex;
  bool in_group = false;
  struct Item {
    bool is_send;
    std::uint32_t peer;
    std::uint64_t handle, offset, count;
    std::uint8_t dtype;
    const void* gpu = nullptr;  // GPU memory: located at collective_group_end_stream
    std::uint64_t bytes = 0;
  };
  std::vector<Item> items;
  CommGpu gpu;  // destroyed first: the client's kernels finish before the comm goes

  std::string where() const {
    return "communicator " + name + " (rank " + std::to_string(rank) + " of " +
           std::to_string(nranks) + ")";
  }
};

struct collective_request {
  collective_comm_t* comm = nullptr;
  Connection* conn = nullptr;
  std::uint64_t id = 0;
  std::string what;  // "all_reduce on communicator ab12cd34 (rank 1 of 4)"
  /// The operation's own deadline (collective_comm_set_timeout when it was
  /// submitted); 0: the node's. collective_wait(-1) waits for it.
  std::chrono::milliseconds deadline{0};
  bool done = false;
  collective_result_t result = COLLECTIVE_OK;
  std::string message;
  std::function<void()> on_failure;  // GPU operations: releases the caller's stream
  std::unique_ptr<LocalCompletion> local;  // run by the client itself (client/direct.h)
};

namespace {

// Above this a time point would overflow the clock; it is ~35 years.
constexpr std::int64_t kMaxTimeoutMs = std::int64_t{1} << 40;

/// `deadline`: the timeout the operation was submitted with (0: the node's).
collective_request_t* new_request(collective_comm_t* comm, std::uint64_t id, std::string what,
                                  std::int64_t deadline) {
  auto* r = new collective_request;
  r->comm = comm;
  r->conn = comm->client->conn.get();
  r->id = id;
  r->what = std::move(what);
  r->deadline = std::chrono::milliseconds(deadline);
  return r;
}

// Records a reply (or a broken connection) in the request.
void settle(collective_request_t* r, ipc::IncomingFrame* reply, const Error* broken) {
  r->done = true;
  if (broken != nullptr) {
    r->result = static_cast<collective_result_t>(broken->code());
    r->message = r->what + ": " + broken->what();
  } else {
    try {
      Connection::check(*reply);
      r->result = COLLECTIVE_OK;
    } catch (const Error& e) {
      r->result = static_cast<collective_result_t>(e.code());
      r->message = e.what();
    }
  }
  if (r->result != COLLECTIVE_OK && r->on_failure) r->on_failure();
}

collective_result_t finish(collective_request_t* r) {
  if (r->result == COLLECTIVE_OK) return COLLECTIVE_OK;
  return fail(static_cast<Code>(r->result), r->message);
}

collective_result_t still_pending(const collective_request_t* r, std::chrono::milliseconds limit) {
  return fail(Code::timeout, "collective_wait: " + r->what + " not complete after " +
                                 std::to_string(limit.count()) + " ms (the request is still pending)");
}

// A request the client runs itself: polls its GPU work.
collective_result_t wait_local(collective_request_t* r, std::chrono::milliseconds limit) {
  Code code = Code::ok;
  std::string message;
  if (!r->local->poll(limit, code, message)) {
    if (limit.count() == 0) return COLLECTIVE_OK;  // collective_test: not yet
    return still_pending(r, limit);
  }
  r->done = true;
  r->result = static_cast<collective_result_t>(code);
  r->message = std::move(message);
  return finish(r);
}

/// A new communicator's identity and layout, as the daemon's CommReady says.
void adopt(collective_comm& c, wire::CommReady::Reader ready) {
  c.handle = ready.getComm();
  c.rank = static_cast<int>(ready.getRank());
  c.nranks = static_cast<int>(ready.getNranks());
  c.nodes = static_cast<int>(ready.getNodes());
  c.node = static_cast<int>(ready.getNode());
  c.next_node_first_rank = static_cast<int>(ready.getNextNodeFirstRank());
  c.name = ready.getName().cStr();
}

/// Runs `fn`, naming the communicator (and this rank) in an error it throws.
template <typename Fn>
void on_comm(const collective_comm& c, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    throw Error(e.code(), "on " + c.where() + ": " + e.what());
  }
}

collective_result_t submit(collective_comm_t* comm, wire::OpKind kind, const void* send,
                           std::uint64_t send_bytes, void* recv, std::uint64_t recv_bytes,
                           std::size_t count, collective_dtype_t dtype, collective_redop_t redop,
                           int root, const char* name, collective_request_t** request,
                           GpuSubmit* gpu = nullptr) {
  if (comm == nullptr || (request == nullptr && gpu == nullptr)) {
    return fail(Code::invalid_argument, std::string(name) + ": comm and request must be set");
  }
  if (request != nullptr) *request = nullptr;
  if (kind != wire::OpKind::BARRIER && !valid_dtype(dtype)) {
    return fail(Code::invalid_argument,
                std::string(name) + " on " + comm->where() + ": unknown dtype " +
                    std::to_string(static_cast<int>(dtype)));
  }
  return guarded(name, [&] {
    capnp::MallocMessageBuilder b(ipc::kSmallMessageWords);
    auto c = b.initRoot<wire::Message>().initCollective();
    c.setComm(comm->handle);
    c.setKind(kind);
    c.setDtype(static_cast<std::uint8_t>(dtype));
    c.setRedop(static_cast<std::uint8_t>(redop));
    c.setCount(count);
    c.setRoot(root);
    const std::int64_t deadline = comm->timeout_ms.load(std::memory_order_relaxed);
    c.setDeadlineMs(static_cast<std::uint64_t>(deadline));
    on_comm(*comm, [&] {
      if (gpu != nullptr) {
        gpu->fill(c, send, send_bytes, recv, recv_bytes);
      } else if (send_bytes > 0) {
        auto [h, o] = comm->client->locate(send, send_bytes, "send");
        c.getSend().setHandle(h);
        c.getSend().setOffset(o);
      }
      if (gpu == nullptr && recv_bytes > 0) {
        auto [h, o] = comm->client->locate(recv, recv_bytes, "recv");
        c.getRecv().setHandle(h);
        c.getRecv().setOffset(o);
      }
    });
    Connection& conn = *comm->client->conn;
    const std::uint64_t id = conn.send_request(b, {}, Clock::now() + kControlTimeout);
    if (gpu != nullptr) on_comm(*comm, [&] { gpu->sent(); });
    if (request == nullptr) {
      conn.abandon(id);  // fire and forget (stream-ordered): the reply is dropped
      return;
    }
    *request = new_request(comm, id, std::string(name) + " on " + comm->where(), deadline);
    if (gpu != nullptr) (*request)->on_failure = gpu->on_failure();
  });
}

}  // namespace

namespace collectived::client {

collective_result_t submit_gpu_collective(collective_comm_t* comm, wire::OpKind kind,
                                          const void* send, std::uint64_t send_bytes, void* recv,
                                          std::uint64_t recv_bytes, std::size_t count,
                                          collective_dtype_t dtype, collective_redop_t redop,
                                          int root, const char* name,
                                          collective_request_t** request, GpuSubmit& gpu) {
  if (comm != nullptr && kind != wire::OpKind::BARRIER && !valid_dtype(dtype)) {
    return fail(Code::invalid_argument, std::string(name) + " on " + comm->where() +
                                            ": unknown dtype " +
                                            std::to_string(static_cast<int>(dtype)));
  }
  return submit(comm, kind, send, send_bytes, recv, recv_bytes, count, dtype, redop, root, name,
                request, &gpu);
}

collective_result_t submit_gpu_group(collective_comm_t* comm, collective_request_t** request,
                                     GpuSubmit* gpu) {
  const char* name = "collective_group_end_stream";
  if (comm == nullptr) return fail(Code::invalid_argument, std::string(name) + ": comm must be set");
  if (request != nullptr) *request = nullptr;
  std::vector<collective_comm::Item> items;
  {
    std::lock_guard lock(comm->group_mutex);
    if (!comm->in_group) {
      return fail(Code::invalid_usage, std::string(name) + " on " + comm->where() + ": no group is open");
    }
    comm->in_group = false;
    items.swap(comm->items);
  }
  if (gpu == nullptr) return COLLECTIVE_OK;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].gpu == nullptr && items[i].bytes > 0) {
      return fail(Code::invalid_argument,
                  std::string(name) + " on " + comm->where() + ": item " + std::to_string(i) +
                      " is host memory; a stream-ordered group takes GPU buffers only");
    }
  }
  return guarded(name, [&] {
    capnp::MallocMessageBuilder b;
    auto g = b.initRoot<wire::Message>().initP2pGroup();
    g.setComm(comm->handle);
    const std::int64_t deadline = comm->timeout_ms.load(std::memory_order_relaxed);
    g.setDeadlineMs(static_cast<std::uint64_t>(deadline));
    auto list = g.initItems(static_cast<unsigned>(items.size()));
    std::vector<std::pair<const void*, std::uint64_t>> bufs;
    for (unsigned i = 0; i < items.size(); ++i) {
      list[i].setIsSend(items[i].is_send);
      list[i].setPeer(items[i].peer);
      list[i].setCount(items[i].count);
      list[i].setDtype(items[i].dtype);
      bufs.emplace_back(items[i].gpu, items[i].gpu ? items[i].bytes : 0);
    }
    on_comm(*comm, [&] { gpu->fill_group(g, bufs); });
    Connection& conn = *comm->client->conn;
    const std::uint64_t id = conn.send_request(b, {}, Clock::now() + kControlTimeout);
    on_comm(*comm, [&] { gpu->sent(); });
    if (request == nullptr) {
      conn.abandon(id);
      return;
    }
    *request = new_request(comm, id, "send/recv group on " + comm->where(), deadline);
    (*request)->on_failure = gpu->on_failure();
  });
}

collective_client_t* comm_client(collective_comm_t* comm) { return comm->client; }
CommGpu& comm_gpu(collective_comm_t* comm) { return comm->gpu; }
std::uint64_t comm_handle(const collective_comm_t* comm) { return comm->handle; }
int comm_nodes(const collective_comm_t* comm) { return comm->nodes; }
int comm_node(const collective_comm_t* comm) { return comm->node; }
int comm_next_node_first_rank(const collective_comm_t* comm) { return comm->next_node_first_rank; }
CommGpu::CommGpu() = default;
CommGpu::~CommGpu() = default;

collective_request_t* new_local_request(collective_comm_t* comm, std::string what,
                                        std::unique_ptr<LocalCompletion> done) {
  auto* r =
      new_request(comm, 0, std::move(what), comm->timeout_ms.load(std::memory_order_relaxed));
  r->local = std::move(done);
  r->done = r->local == nullptr;  // nothing to run (count 0): complete now
  return r;
}
std::string comm_where(const collective_comm_t* comm) { return comm->where(); }

}  // namespace collectived::client

namespace {

bool is_root(collective_comm_t* comm, int root) { return comm != nullptr && comm->rank == root; }

}  // namespace

extern "C" {

size_t collective_dtype_size(collective_dtype_t dtype) {
  return valid_dtype(dtype) ? kDTypes[dtype].size : 0;
}

const char* collective_dtype_name(collective_dtype_t dtype) {
  return valid_dtype(dtype) ? kDTypes[dtype].name : "unknown";
}

const char* collective_redop_name(collective_redop_t redop) {
  return redop >= COLLECTIVE_SUM && redop <= COLLECTIVE_AVG ? kRedOps[redop] : "unknown";
}

collective_result_t collective_unique_id_to_string(const collective_unique_id_t* id, char* out,
                                                   size_t size) {
  if (id == nullptr || out == nullptr || size < 2 * COLLECTIVE_UNIQUE_ID_BYTES + 1) {
    return fail(Code::invalid_argument,
                "collective_unique_id_to_string: needs an id and 257 bytes of output");
  }
  static const char* digits = "0123456789abcdef";
  for (std::size_t i = 0; i < COLLECTIVE_UNIQUE_ID_BYTES; ++i) {
    const auto b = static_cast<unsigned char>(id->internal[i]);
    out[2 * i] = digits[b >> 4];
    out[2 * i + 1] = digits[b & 15];
  }
  out[2 * COLLECTIVE_UNIQUE_ID_BYTES] = '\0';
  return COLLECTIVE_OK;
}

collective_result_t collective_unique_id_from_string(const char* text, collective_unique_id_t* id) {
  if (text == nullptr || id == nullptr || std::strlen(text) != 2 * COLLECTIVE_UNIQUE_ID_BYTES) {
    return fail(Code::invalid_argument,
                "collective_unique_id_from_string: expected 256 hex characters");
  }
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (std::size_t i = 0; i < COLLECTIVE_UNIQUE_ID_BYTES; ++i) {
    const int hi = nibble(text[2 * i]), lo = nibble(text[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return fail(Code::invalid_argument, "collective_unique_id_from_string: not hexadecimal");
    }
    id->internal[i] = static_cast<char>(hi << 4 | lo);
  }
  if (std::memcmp(id->internal, kIdMagic, 4) != 0) {
    return fail(Code::invalid_argument,
                "collective_unique_id_from_string: not a collectived unique id");
  }
  return COLLECTIVE_OK;
}

collective_result_t collective_get_unique_id(collective_client_t* client,
                                             collective_unique_id_t* id) {
  if (client == nullptr || id == nullptr) {
    return fail(Code::invalid_argument, "collective_get_unique_id: client and id must be set");
  }
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, kIdMagic, 4);
  id->internal[4] = 1;  // layout version
  // 128 random bits: the id is the only thing that keeps two jobs apart.
  std::size_t got = 0;
  while (got < kSecretBytes) {
    const ssize_t n = ::getrandom(id->internal + kSecretAt + got, kSecretBytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return fail(Code::system,
                  std::string("collective_get_unique_id: getrandom: ") + std::strerror(errno));
    }
    got += static_cast<std::size_t>(n);
  }
  copy_text(id->internal + kAddressAt, kAddressBytes, client->conn->rendezvous_address().c_str());
  copy_text(id->internal + kNodeAt, kNodeBytes, client->conn->node_name().c_str());
  return COLLECTIVE_OK;
}

collective_result_t collective_comm_init_rank(collective_client_t* client,
                                              const collective_unique_id_t* id, int nranks,
                                              int rank, collective_comm_t** comm) {
  if (client == nullptr || id == nullptr || comm == nullptr) {
    return fail(Code::invalid_argument, "collective_comm_init_rank: client, id and comm must be set");
  }
  *comm = nullptr;
  if (std::memcmp(id->internal, kIdMagic, 4) != 0) {
    return fail(Code::invalid_argument,
                "collective_comm_init_rank: the id was not made by collective_get_unique_id");
  }
  if (nranks <= 0 || rank < 0 || rank >= nranks) {
    return fail(Code::invalid_argument, "collective_comm_init_rank: rank " +
                                            std::to_string(rank) + " of " +
                                            std::to_string(nranks) + " is out of range");
  }
  return guarded("collective_comm_init_rank", [&] {
    capnp::MallocMessageBuilder b;
    auto r = b.initRoot<wire::Message>().initCommInit();
    r.setSecret(capnp::Data::Reader(
        reinterpret_cast<const capnp::byte*>(id->internal + kSecretAt), kSecretBytes));
    std::string address(id->internal + kAddressAt,
                        strnlen(id->internal + kAddressAt, kAddressBytes));
    r.setRendezvous(address.c_str());
    r.setNranks(static_cast<std::uint32_t>(nranks));
    r.setRank(static_cast<std::uint32_t>(rank));
    Connection& conn = *client->conn;
    auto reply = conn.call(b, {}, Clock::now() + conn.rendezvous_deadline() + kDeadlineMargin);
    auto ready = reply->message().getCommReady();
    auto c = std::make_unique<collective_comm>();
    c->client = client;
    adopt(*c, ready);
    *comm = c.release();
    gpu_comm_created(*comm);
  });
}

collective_result_t collective_comm_split(collective_comm_t* comm, int color, int key,
                                          collective_comm_t** newcomm) {
  if (comm == nullptr || newcomm == nullptr) {
    return fail(Code::invalid_argument, "collective_comm_split: comm and newcomm must be set");
  }
  *newcomm = nullptr;
  return guarded("collective_comm_split", [&] {
    capnp::MallocMessageBuilder b;
    auto r = b.initRoot<wire::Message>().initCommSplit();
    r.setComm(comm->handle);
    r.setColor(color < 0 ? -1 : color);
    r.setKey(key);
    Connection& conn = *comm->client->conn;
    auto reply = conn.call(b, {}, Clock::now() + conn.operation_deadline() + kDeadlineMargin);
    auto ready = reply->message().getCommReady();
    if (ready.getComm() == 0) return;  // COLLECTIVE_SPLIT_NOCOLOR
    auto c = std::make_unique<collective_comm>();
    c->client = comm->client;
    adopt(*c, ready);
    *newcomm = c.release();
    gpu_comm_created(*newcomm);
  });
}

collective_result_t collective_comm_destroy(collective_comm_t* comm) {
  if (comm == nullptr) return COLLECTIVE_OK;
  std::unique_ptr<collective_comm> owned(comm);
  return guarded("collective_comm_destroy", [&] {
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::Message>().initCommDestroy().setComm(comm->handle);
    Connection& conn = *comm->client->conn;
    conn.call(b, {}, Clock::now() + conn.operation_deadline() + kDeadlineMargin);
  });
}

collective_result_t collective_comm_abort(collective_comm_t* comm) {
  if (comm == nullptr) return COLLECTIVE_OK;
  std::unique_ptr<collective_comm> owned(comm);
  return guarded("collective_comm_abort", [&] {
    capnp::MallocMessageBuilder b;
    b.initRoot<wire::Message>().initCommAbort().setComm(comm->handle);
    comm->client->conn->call(b, {}, Clock::now() + kControlTimeout);
  });
}

collective_result_t collective_comm_set_timeout(collective_comm_t* comm, int64_t timeout_ms) {
  if (comm == nullptr) {
    return fail(Code::invalid_argument, "collective_comm_set_timeout: comm is NULL");
  }
  if (timeout_ms < 0) {
    return fail(Code::invalid_argument, "collective_comm_set_timeout on " + comm->where() +
                                            ": timeout " + std::to_string(timeout_ms) +
                                            " ms is negative (0 restores the node's)");
  }
  comm->timeout_ms.store(std::min(timeout_ms, kMaxTimeoutMs), std::memory_order_relaxed);
  return COLLECTIVE_OK;
}

int64_t collective_comm_timeout(const collective_comm_t* comm) {
  return comm ? comm->timeout_ms.load(std::memory_order_relaxed) : 0;
}

int collective_comm_rank(const collective_comm_t* comm) { return comm ? comm->rank : -1; }
int collective_comm_size(const collective_comm_t* comm) { return comm ? comm->nranks : -1; }

collective_result_t collective_all_reduce(collective_comm_t* comm, const void* send, void* recv,
                                          size_t count, collective_dtype_t dtype,
                                          collective_redop_t redop,
                                          collective_request_t** request) {
  const std::uint64_t bytes = count * collective_dtype_size(dtype);
  return submit(comm, wire::OpKind::ALL_REDUCE, send, bytes, recv, bytes, count, dtype, redop, 0,
                "all_reduce", request);
}

collective_result_t collective_all_gather(collective_comm_t* comm, const void* send, void* recv,
                                          size_t count, collective_dtype_t dtype,
                                          collective_request_t** request) {
  const std::uint64_t bytes = count * collective_dtype_size(dtype);
  const std::uint64_t n = comm ? static_cast<std::uint64_t>(comm->nranks) : 0;
  return submit(comm, wire::OpKind::ALL_GATHER, send, bytes, recv, bytes * n, count, dtype,
                COLLECTIVE_SUM, 0, "all_gather", request);
}

collective_result_t collective_reduce_scatter(collective_comm_t* comm, const void* send,
                                              void* recv, size_t count, collective_dtype_t dtype,
                                              collective_redop_t redop,
                                              collective_request_t** request) {
  const std::uint64_t bytes = count * collective_dtype_size(dtype);
  const std::uint64_t n = comm ? static_cast<std::uint64_t>(comm->nranks) : 0;
  return submit(comm, wire::OpKind::REDUCE_SCATTER, send, bytes * n, recv, bytes, count, dtype,
                redop, 0, "reduce_scatter", request);
}

collective_result_t collective_broadcast(collective_comm_t* comm, const void* send, void* recv,
                                         size_t count, collective_dtype_t dtype, int root,
                                         collective_request_t** request) {
  const std::uint64_t bytes = count * collective_dtype_size(dtype);
  return submit(comm, wire::OpKind::BROADCAST, send, is_root(comm, root) ? bytes : 0, recv, bytes,
                count, dtype, COLLECTIVE_SUM, root, "broadcast", request);
}

collective_result_t collective_reduce(collective_comm_t* comm, const void* send, void* recv,
                                      size_t count, collective_dtype_t dtype,
                                      collective_redop_t redop, int root,
                                      collective_request_t** request) {
  const std::uint64_t bytes = count * collective_dtype_size(dtype);
  return submit(comm, wire::OpKind::REDUCE, send, bytes, recv, is_root(comm, root) ? bytes : 0,
                count, dtype, redop, root, "reduce", request);
}

collective_result_t collective_all_to_all(collective_comm_t* comm, const void* send, void* recv,
                                          size_t count, collective_dtype_t dtype,
                                          collective_request_t** request) {
  const std::uint64_t n = comm ? static_cast<std::uint64_t>(comm->nranks) : 0;
  const std::uint64_t bytes = count * collective_dtype_size(dtype) * n;
  return submit(comm, wire::OpKind::ALL_TO_ALL, send, bytes, recv, bytes, count, dtype,
                COLLECTIVE_SUM, 0, "all_to_all", request);
}

collective_result_t collective_barrier(collective_comm_t* comm, collective_request_t** request) {
  return submit(comm, wire::OpKind::BARRIER, nullptr, 0, nullptr, 0, 0, COLLECTIVE_UINT8,
                COLLECTIVE_SUM, 0, "barrier", request);
}

collective_result_t collective_group_start(collective_comm_t* comm) {
  if (comm == nullptr) return fail(Code::invalid_argument, "collective_group_start: comm is NULL");
  std::lock_guard lock(comm->group_mutex);
  if (comm->in_group) {
    return fail(Code::invalid_usage, "collective_group_start on " + comm->where() +
                                         ": a group is already open");
  }
  comm->in_group = true;
  comm->items.clear();
  return COLLECTIVE_OK;
}

static collective_result_t add_p2p(collective_comm_t* comm, bool is_send, const void* buf,
                                   size_t count, collective_dtype_t dtype, int peer) {
  const char* name = is_send ? "collective_send" : "collective_recv";
  if (comm == nullptr) return fail(Code::invalid_argument, std::string(name) + ": comm is NULL");
  if (!valid_dtype(dtype)) {
    return fail(Code::invalid_argument, std::string(name) + ": unknown dtype");
  }
  if (peer < 0 || peer >= comm->nranks) {
    return fail(Code::invalid_argument, std::string(name) + " on " + comm->where() + ": peer " +
                                            std::to_string(peer) + " is not a rank");
  }
  std::lock_guard lock(comm->group_mutex);
  if (!comm->in_group) {
    return fail(Code::invalid_usage, std::string(name) + " on " + comm->where() +
                                         ": call it between collective_group_start and "
                                         "collective_group_end");
  }
  return guarded(name, [&] {
    const std::uint64_t bytes = count * collective_dtype_size(dtype);
    std::uint64_t handle = 0, offset = 0;
    const void* gpu = nullptr;
    if (bytes > 0) {
      try {
        std::tie(handle, offset) = comm->client->locate(buf, bytes, is_send ? "send" : "recv");
      } catch (const Error&) {
        // GPU memory: registered when the group ends on a stream.
        if (!is_gpu_pointer(comm->client, buf)) throw;
        gpu = buf;
      }
    }
    comm->items.push_back({is_send, static_cast<std::uint32_t>(peer), handle, offset, count,
                           static_cast<std::uint8_t>(dtype), gpu, bytes});
  });
}

collective_result_t collective_send(collective_comm_t* comm, const void* send, size_t count,
                                    collective_dtype_t dtype, int peer) {
  return add_p2p(comm, true, send, count, dtype, peer);
}

collective_result_t collective_recv(collective_comm_t* comm, void* recv, size_t count,
                                    collective_dtype_t dtype, int peer) {
  return add_p2p(comm, false, recv, count, dtype, peer);
}

collective_result_t collective_group_end(collective_comm_t* comm, collective_request_t** request) {
  if (comm == nullptr || request == nullptr) {
    return fail(Code::invalid_argument, "collective_group_end: comm and request must be set");
  }
  *request = nullptr;
  std::vector<collective_comm::Item> items;
  {
    std::lock_guard lock(comm->group_mutex);
    if (!comm->in_group) {
      return fail(Code::invalid_usage,
                  "collective_group_end on " + comm->where() + ": no group is open");
    }
    comm->in_group = false;
    items.swap(comm->items);
  }
  for (const auto& item : items) {
    if (item.gpu != nullptr) {
      return fail(Code::invalid_usage, "collective_group_end on " + comm->where() +
                                           ": the group has GPU buffers: end it with "
                                           "collective_group_end_stream");
    }
  }
  return guarded("collective_group_end", [&] {
    capnp::MallocMessageBuilder b;
    auto g = b.initRoot<wire::Message>().initP2pGroup();
    g.setComm(comm->handle);
    const std::int64_t deadline = comm->timeout_ms.load(std::memory_order_relaxed);
    g.setDeadlineMs(static_cast<std::uint64_t>(deadline));
    auto list = g.initItems(static_cast<unsigned>(items.size()));
    for (unsigned i = 0; i < items.size(); ++i) {
      list[i].setIsSend(items[i].is_send);
      list[i].setPeer(items[i].peer);
      list[i].getBuffer().setHandle(items[i].handle);
      list[i].getBuffer().setOffset(items[i].offset);
      list[i].setCount(items[i].count);
      list[i].setDtype(items[i].dtype);
    }
    Connection& conn = *comm->client->conn;
    const std::uint64_t id = conn.send_request(b, {}, Clock::now() + kControlTimeout);
    *request = new_request(comm, id, "send/recv group on " + comm->where(), deadline);
  });
}

collective_result_t collective_wait(collective_request_t* r, int timeout_ms) {
  if (r == nullptr) return fail(Code::invalid_argument, "collective_wait: request is NULL");
  if (!r->done) {
    // -1: the deadline the operation was submitted with, which the daemon
    // answers by (collective_comm_set_timeout's, else the node's).
    const auto own = r->deadline.count() > 0 ? r->deadline : r->conn->operation_deadline();
    const auto limit = timeout_ms < 0 ? own + std::chrono::milliseconds(kDeadlineMargin)
                                      : std::chrono::milliseconds(timeout_ms);
    if (r->local) return wait_local(r, limit);
    try {
      auto reply = r->conn->wait_reply(r->id, Clock::now() + limit);
      if (!reply) return still_pending(r, limit);
      settle(r, reply.get(), nullptr);
    } catch (const Error& e) {
      settle(r, nullptr, &e);
    }
  }
  return finish(r);
}

collective_result_t collective_test(collective_request_t* r, int* done) {
  if (r == nullptr || done == nullptr) {
    return fail(Code::invalid_argument, "collective_test: request and done must be set");
  }
  if (!r->done && r->local) {
    const collective_result_t rc = wait_local(r, std::chrono::milliseconds(0));
    *done = r->done ? 1 : 0;
    return rc;
  }
  if (!r->done) {
    try {
      auto reply = r->conn->try_reply(r->id);
      if (reply) settle(r, reply.get(), nullptr);
    } catch (const Error& e) {
      settle(r, nullptr, &e);
    }
  }
  *done = r->done ? 1 : 0;
  return r->done ? finish(r) : COLLECTIVE_OK;
}

void collective_request_free(collective_request_t* r) {
  if (r == nullptr) return;
  if (!r->done && !r->local) r->conn->abandon(r->id);
  delete r;
}

}  // extern "C"
