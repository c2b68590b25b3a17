// The engine without a daemon: an Engine wired as daemon/server.cc wires it
// (EngineOptions, a Registry, a Logger), clients played by sinks and memfd
// registrations, as the daemon's sessions would.
#include "engine/engine.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "engine/engine_lock.h"
#include "engine/gpu/executor.h"
#include "engine/log.h"
#include "engine/node_run.h"
#include "engine/registry.h"
#include "ipc/fd.h"

using namespace collectived;
using namespace collectived::engine;
using namespace std::chrono_literals;

namespace {

/// A client's answers, by request id.
class Sink : public CompletionSink {
 public:
  void complete(std::uint64_t request, Result result) override {
    std::lock_guard lock(mu_);
    results_[request].push_back(std::move(result));
    cv_.notify_all();
  }
  /// The answer to `request`, waiting up to `wait` for it; fails the test if none comes.
  Result wait(std::uint64_t request, std::chrono::milliseconds wait = 5000ms) {
    std::unique_lock lock(mu_);
    const bool got = cv_.wait_for(lock, wait, [&] { return results_.count(request) != 0; });
    REQUIRE_MESSAGE(got, "no answer to request " << request);
    return results_[request].front();
  }
  bool answered(std::uint64_t request) {
    std::lock_guard lock(mu_);
    return results_.count(request) != 0;
  }
  std::size_t answers(std::uint64_t request) {
    std::lock_guard lock(mu_);
    return results_.count(request) ? results_[request].size() : 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::vector<Result>> results_;
};

/// A client process: a session, a sink, and a registered memfd buffer it
/// also maps itself (the client's view of the bytes).
struct Client {
  Client(Registry& registry, std::uint64_t session, std::size_t bytes) : size(bytes) {
    ref.session = session;
    ref.pid = static_cast<pid_t>(1000 + session);
    ref.sink = sink;
    UniqueFd fd(::memfd_create("engine_test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    REQUIRE(fd);
    REQUIRE(::ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
    REQUIRE(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    REQUIRE(p != MAP_FAILED);
    view = static_cast<std::byte*>(p);
    handle = registry.add(session, HostMapping::map_memfd(std::move(fd), bytes));
  }
  ~Client() { ::munmap(view, size); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  float* floats(std::size_t offset = 0) { return reinterpret_cast<float*>(view + offset); }
  BufferArg at(std::uint64_t offset) const { return BufferArg{handle, offset}; }

  std::shared_ptr<Sink> sink = std::make_shared<Sink>();
  ClientRef ref;
  std::byte* view = nullptr;
  std::size_t size = 0;
  std::uint64_t handle = 0;
  std::uint64_t comm = 0;  // its communicator handle once joined
};

std::string secret_of(char c) { return std::string(16, c); }

/// An engine as the daemon makes it (daemon/server.cc: engine_options), on
/// one node without a peer listener.
struct Node {
  explicit Node(std::chrono::milliseconds operation = 5000ms,
                std::chrono::milliseconds rendezvous = 5000ms)
      : log(config::LogLevel::error, devnull.get()),
        registry(RegistryLimits{}),
        engine(options(operation, rendezvous), registry, log) {}

  static EngineOptions options(std::chrono::milliseconds operation,
                               std::chrono::milliseconds rendezvous) {
    EngineOptions o;
    o.node_name = "node-a";
    o.rendezvous_address = "local:1@node-a";
    o.operation_deadline = operation;
    o.rendezvous_deadline = rendezvous;
    o.worker_threads = 2;
    return o;
  }

  /// `n` clients joined to one communicator; their handles in Client::comm.
  std::vector<std::unique_ptr<Client>> join(int n, std::size_t bytes = 4096, char id = 'a') {
    std::vector<std::unique_ptr<Client>> clients;
    for (int r = 0; r < n; ++r) {
      clients.push_back(std::make_unique<Client>(registry, next_session++, bytes));
    }
    for (int r = 0; r < n; ++r) {
      engine.comm_init(clients[r]->ref, 1, secret_of(id), "local:1@node-a",
                       static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(r));
    }
    for (int r = 0; r < n; ++r) {
      Result res = clients[r]->sink->wait(1);
      REQUIRE(res.code == Code::ok);
      REQUIRE(res.comm);
      CHECK(res.comm->rank == static_cast<std::uint32_t>(r));
      CHECK(res.comm->nranks == static_cast<std::uint32_t>(n));
      clients[r]->comm = res.comm->handle;
    }
    return clients;
  }

  UniqueFd devnull{::open("/dev/null", O_WRONLY | O_CLOEXEC)};
  Logger log;
  Registry registry;
  Engine engine;
  std::uint64_t next_session = 1;
};

CollectiveArgs all_reduce(std::uint64_t count, std::uint64_t send_off, std::uint64_t recv_off,
                          std::uint64_t handle) {
  CollectiveArgs a;
  a.kind = OpKind::all_reduce;
  a.dtype = static_cast<std::uint32_t>(DType::float32);
  a.redop = static_cast<std::uint32_t>(RedOp::sum);
  a.count = count;
  a.send = BufferArg{handle, send_off};
  a.recv = BufferArg{handle, recv_off};
  return a;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("rendezvous answers every rank once all have joined") {
  Node node;
  Client a(node.registry, 1, 64), b(node.registry, 2, 64);
  node.engine.comm_init(a.ref, 7, secret_of('r'), "local:1@node-a", 2, 0);
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(a.sink->answered(7));  // rank 1 not there yet
  node.engine.comm_init(b.ref, 9, secret_of('r'), "local:1@node-a", 2, 1);
  const Result ra = a.sink->wait(7), rb = b.sink->wait(9);
  REQUIRE(ra.code == Code::ok);
  REQUIRE(rb.code == Code::ok);
  CHECK(ra.comm->rank == 0);
  CHECK(rb.comm->rank == 1);
  CHECK(ra.comm->handle != rb.comm->handle);
  CHECK(node.engine.stats().communicators == 1);
}

TEST_CASE("rendezvous refuses a rank taken twice and disagreeing nranks") {
  Node node;
  Client a(node.registry, 1, 64), b(node.registry, 2, 64), c(node.registry, 3, 64);
  node.engine.comm_init(a.ref, 1, secret_of('t'), "local:1@node-a", 3, 0);
  node.engine.comm_init(b.ref, 1, secret_of('t'), "local:1@node-a", 3, 0);
  const Result twice = b.sink->wait(1);
  CHECK(twice.code == Code::invalid_usage);
  CHECK(contains(twice.message, "rank 0 already joined"));
  node.engine.comm_init(c.ref, 1, secret_of('t'), "local:1@node-a", 4, 1);
  const Result nranks = c.sink->wait(1);
  CHECK(nranks.code == Code::mismatch);
  CHECK(contains(nranks.message, "this rank says 4 ranks, but earlier ranks said 3"));
}

TEST_CASE("an all-reduce sums every rank's buffer into every rank's output") {
  Node node;
  auto cl = node.join(3);
  const std::uint64_t count = 256;
  for (int r = 0; r < 3; ++r) {
    for (std::uint64_t i = 0; i < count; ++i) cl[r]->floats()[i] = static_cast<float>(r + i);
  }
  for (int r = 0; r < 3; ++r) {
    node.engine.collective(cl[r]->ref, 2, cl[r]->comm, all_reduce(count, 0, 2048, cl[r]->handle));
  }
  for (int r = 0; r < 3; ++r) {
    const Result res = cl[r]->sink->wait(2);
    REQUIRE(res.code == Code::ok);
    CHECK(res.seq == 0);
    for (std::uint64_t i = 0; i < count; ++i) {
      REQUIRE(cl[r]->floats(2048)[i] == static_cast<float>(3 + 3 * i));  // 0+1+2 + 3i
    }
  }
  CHECK(node.engine.stats().completed == 1);
}

TEST_CASE("operations match by sequence number, whatever order the ranks submit in") {
  Node node;
  auto cl = node.join(2);
  for (int r = 0; r < 2; ++r) cl[r]->floats()[0] = static_cast<float>(10 * (r + 1));
  // Rank 0 submits two all-reduces before rank 1 submits any.
  node.engine.collective(cl[0]->ref, 2, cl[0]->comm, all_reduce(1, 0, 64, cl[0]->handle));
  node.engine.collective(cl[0]->ref, 3, cl[0]->comm, all_reduce(1, 64, 128, cl[0]->handle));
  std::this_thread::sleep_for(20ms);
  CHECK_FALSE(cl[0]->sink->answered(2));
  node.engine.collective(cl[1]->ref, 2, cl[1]->comm, all_reduce(1, 0, 64, cl[1]->handle));
  node.engine.collective(cl[1]->ref, 3, cl[1]->comm, all_reduce(1, 64, 128, cl[1]->handle));
  for (int r = 0; r < 2; ++r) {
    const Result first = cl[r]->sink->wait(2), second = cl[r]->sink->wait(3);
    REQUIRE(first.code == Code::ok);
    REQUIRE(second.code == Code::ok);
    CHECK(first.seq == 0);
    CHECK(second.seq == 1);
    CHECK(cl[r]->floats(64)[0] == 30.0f);   // 10 + 20
    CHECK(cl[r]->floats(128)[0] == 60.0f);  // the first's outputs, summed again
  }
}

TEST_CASE("a mismatch fails the operation on every rank, naming both descriptions") {
  Node node;
  auto cl = node.join(2);
  node.engine.collective(cl[0]->ref, 2, cl[0]->comm, all_reduce(4, 0, 64, cl[0]->handle));
  node.engine.collective(cl[1]->ref, 2, cl[1]->comm, all_reduce(8, 0, 64, cl[1]->handle));
  for (int r = 0; r < 2; ++r) {
    const Result res = cl[r]->sink->wait(2);
    CHECK(res.code == Code::mismatch);
    CHECK(contains(res.message, "mismatched operations for sequence number 0"));
    CHECK(contains(res.message, "all_reduce(count=4, dtype=float, op=sum)"));
    CHECK(contains(res.message, "all_reduce(count=8, dtype=float, op=sum)"));
    CHECK(contains(res.message, "rank 0 (pid 1001)"));
  }
  // The communicator goes on: the next sequence number runs.
  for (int r = 0; r < 2; ++r) {
    node.engine.collective(cl[r]->ref, 3, cl[r]->comm, all_reduce(4, 0, 64, cl[r]->handle));
  }
  for (int r = 0; r < 2; ++r) {
    const Result res = cl[r]->sink->wait(3);
    CHECK(res.code == Code::ok);
    CHECK(res.seq == 1);
  }
}

TEST_CASE("an invalid submission fails the operation for every rank") {
  Node node;
  auto cl = node.join(2);
  CollectiveArgs bad = all_reduce(4, 0, 64, cl[0]->handle);
  bad.kind = OpKind::broadcast;
  bad.root = 5;
  CollectiveArgs good = bad;
  good.root = 0;
  good.send = good.recv = BufferArg{cl[1]->handle, 0};
  node.engine.collective(cl[0]->ref, 2, cl[0]->comm, bad);
  node.engine.collective(cl[1]->ref, 2, cl[1]->comm, good);
  const Result r0 = cl[0]->sink->wait(2), r1 = cl[1]->sink->wait(2);
  CHECK(r0.code == Code::invalid_argument);
  CHECK(contains(r0.message, "submitted an invalid broadcast: root 5 is not a rank"));
  CHECK(r1.code == Code::invalid_argument);  // it would wait for rank 0 otherwise
}

TEST_CASE("validation: buffers, counts, dtypes and overlap") {
  Node node;
  auto cl = node.join(1, 4096);
  auto submit = [&](std::uint64_t request, CollectiveArgs a) {
    node.engine.collective(cl[0]->ref, request, cl[0]->comm, a);
    return cl[0]->sink->wait(request);
  };
  CollectiveArgs past_end = all_reduce(1024, 0, 4, cl[0]->handle);  // recv runs past 4096
  Result res = submit(2, past_end);
  CHECK(res.code != Code::ok);
  CHECK(contains(res.message, "recv buffer:"));
  CollectiveArgs foreign = all_reduce(1, 0, 64, 999);
  res = submit(3, foreign);
  CHECK(res.code == Code::not_found);
  CHECK(contains(res.message, "send buffer:"));
  CollectiveArgs huge = all_reduce(std::uint64_t{1} << 50, 0, 64, cl[0]->handle);
  res = submit(4, huge);
  CHECK(res.code == Code::invalid_argument);
  CHECK(contains(res.message, "count 1125899906842624 is too large"));
  CollectiveArgs dtype = all_reduce(1, 0, 64, cl[0]->handle);
  dtype.dtype = 99;
  res = submit(5, dtype);
  CHECK(contains(res.message, "unknown dtype 99"));
  CollectiveArgs overlap = all_reduce(64, 0, 4, cl[0]->handle);
  res = submit(6, overlap);
  CHECK(res.code == Code::invalid_argument);
  CHECK(contains(res.message, "overlap but are not the in-place layout of all_reduce"));
  CollectiveArgs in_place = all_reduce(64, 0, 0, cl[0]->handle);
  CHECK(submit(7, in_place).code == Code::ok);
  // A GPU operation on host buffers, and on a daemon without a GPU executor.
  CollectiveArgs gpu = all_reduce(1, 0, 64, cl[0]->handle);
  gpu.gpu = std::make_shared<gpu::RankSync>();
  res = submit(8, gpu);
  CHECK(contains(res.message, "buffer is host memory, but the operation is on GPU buffers"));
}

TEST_CASE("an operation not started by its deadline fails, naming the missing ranks") {
  Node node(50ms);
  auto cl = node.join(2);
  node.engine.collective(cl[0]->ref, 2, cl[0]->comm, all_reduce(1, 0, 64, cl[0]->handle));
  node.engine.check_deadlines();
  CHECK_FALSE(cl[0]->sink->answered(2));  // not yet
  std::this_thread::sleep_for(70ms);
  node.engine.check_deadlines();
  const Result res = cl[0]->sink->wait(2);
  CHECK(res.code == Code::timeout);
  CHECK(contains(res.message, "timed out after 50 ms (deadlines.operation_ms) on node node-a"));
  CHECK(contains(res.message, "ranks that did not submit it: rank 1 (pid 1002)"));
  // The late rank learns the same when it comes.
  node.engine.collective(cl[1]->ref, 2, cl[1]->comm, all_reduce(1, 0, 64, cl[1]->handle));
  CHECK(cl[1]->sink->wait(2).code == Code::timeout);
}

TEST_CASE("a rank's own timeout gives the operation its deadline, and errors say whose") {
  Node node(60000ms);
  auto cl = node.join(2);
  CollectiveArgs a = all_reduce(1, 0, 64, cl[1]->handle);
  a.deadline = 30ms;
  node.engine.collective(cl[1]->ref, 2, cl[1]->comm, a);
  std::this_thread::sleep_for(50ms);
  node.engine.check_deadlines();
  const Result res = cl[1]->sink->wait(2);
  CHECK(res.code == Code::timeout);
  CHECK(contains(res.message,
                 "30 ms (the operation's timeout, set by rank 1; "
                 "deadlines.operation_ms is 60000)"));
}

TEST_CASE("a rendezvous not complete by its deadline fails its ranks") {
  Node node(5000ms, 40ms);
  Client a(node.registry, 1, 64);
  node.engine.comm_init(a.ref, 1, secret_of('d'), "local:1@node-a", 3, 0);
  std::this_thread::sleep_for(60ms);
  node.engine.check_deadlines();
  const Result res = a.sink->wait(1);
  CHECK(res.code == Code::timeout);
  CHECK(contains(res.message, "1 of 3 ranks joined; missing ranks: 1, 2"));
}

TEST_CASE("split makes the children by color, ranked by key, and they run") {
  Node node;
  auto cl = node.join(4);
  // Colors by parity; keys reverse the order inside each child.
  for (int r = 0; r < 4; ++r) node.engine.comm_split(cl[r]->ref, 2, cl[r]->comm, r % 2, -r);
  std::vector<CommInfo> child(4);
  for (int r = 0; r < 4; ++r) {
    const Result res = cl[r]->sink->wait(2);
    REQUIRE(res.code == Code::ok);
    REQUIRE(res.comm);
    child[r] = *res.comm;
    CHECK(child[r].nranks == 2);
    CHECK(child[r].name == child[r % 2].name);
  }
  CHECK(child[0].rank == 1);  // key 0 after rank 2's key -2
  CHECK(child[2].rank == 0);
  CHECK(child[1].rank == 1);
  CHECK(child[3].rank == 0);
  CHECK(child[0].name != child[1].name);
  // An all-reduce on the even child only sums ranks 0 and 2.
  for (int r = 0; r < 4; ++r) cl[r]->floats()[0] = static_cast<float>(r + 1);
  for (int r : {0, 2}) {
    node.engine.collective(cl[r]->ref, 3, child[r].handle, all_reduce(1, 0, 64, cl[r]->handle));
  }
  for (int r : {0, 2}) {
    const Result res = cl[r]->sink->wait(3);
    REQUIRE(res.code == Code::ok);
    CHECK(cl[r]->floats(64)[0] == 4.0f);  // 1 + 3
  }
  // A negative color gets no communicator.
  auto more = node.join(2, 64, 'n');
  node.engine.comm_split(more[0]->ref, 2, more[0]->comm, -1, 0);
  node.engine.comm_split(more[1]->ref, 2, more[1]->comm, 0, 0);
  CHECK(more[0]->sink->wait(2).comm->handle == 0);
  CHECK(more[1]->sink->wait(2).comm->nranks == 1);
}

TEST_CASE("send/recv pairs copy between ranks; mismatched sizes fail both") {
  Node node;
  auto cl = node.join(2);
  std::memcpy(cl[0]->view, "payload!", 8);
  P2PArgs send;
  send.is_send = true;
  send.peer = 1;
  send.buffer = BufferArg{cl[0]->handle, 0};
  send.count = 8;
  send.dtype = static_cast<std::uint32_t>(DType::uint8);
  P2PArgs recv = send;
  recv.is_send = false;
  recv.peer = 0;
  recv.buffer = BufferArg{cl[1]->handle, 100};
  // The receive first: pairs meet whichever comes first.
  node.engine.p2p_group(cl[1]->ref, 2, cl[1]->comm, {recv});
  node.engine.p2p_group(cl[0]->ref, 2, cl[0]->comm, {send});
  CHECK(cl[0]->sink->wait(2).code == Code::ok);
  CHECK(cl[1]->sink->wait(2).code == Code::ok);
  CHECK(std::memcmp(cl[1]->view + 100, "payload!", 8) == 0);

  recv.count = 4;
  node.engine.p2p_group(cl[0]->ref, 3, cl[0]->comm, {send});
  node.engine.p2p_group(cl[1]->ref, 3, cl[1]->comm, {recv});
  for (int r = 0; r < 2; ++r) {
    const Result res = cl[r]->sink->wait(3);
    CHECK(res.code == Code::mismatch);
    CHECK(contains(res.message,
                   "mismatched send/recv: rank 0 sends 8 uint8 to rank 1 but rank 1 receives 4"));
  }
  P2PArgs nobody = send;
  nobody.peer = 7;
  node.engine.p2p_group(cl[0]->ref, 4, cl[0]->comm, {nobody});
  CHECK(contains(cl[0]->sink->wait(4).message, "item 0: peer 7 is not a rank"));
}

TEST_CASE("a rank whose client disconnects breaks the communicator for the others") {
  Node node;
  auto cl = node.join(2);
  node.engine.collective(cl[0]->ref, 2, cl[0]->comm, all_reduce(1, 0, 64, cl[0]->handle));
  node.engine.client_gone(cl[1]->ref.session);
  const Result res = cl[0]->sink->wait(2);
  CHECK(res.code == Code::remote);
  CHECK(contains(res.message, "rank 1 (pid 1002) on node node-a disconnected"));
  // Later submissions fail at once.
  node.engine.collective(cl[0]->ref, 3, cl[0]->comm, all_reduce(1, 0, 64, cl[0]->handle));
  CHECK(cl[0]->sink->wait(3).code == Code::remote);
}

TEST_CASE("abort and destroy: the others' operations name the rank") {
  Node node;
  auto cl = node.join(3);
  node.engine.collective(cl[0]->ref, 2, cl[0]->comm, all_reduce(1, 0, 64, cl[0]->handle));
  node.engine.comm_abort(cl[2]->ref, 2, cl[2]->comm);
  CHECK(cl[2]->sink->wait(2).code == Code::ok);
  const Result res = cl[0]->sink->wait(2);
  CHECK(res.code == Code::aborted);
  CHECK(contains(res.message, "the communicator was aborted by rank 2"));
  // The aborted handle is gone.
  node.engine.collective(cl[2]->ref, 3, cl[2]->comm, all_reduce(1, 0, 64, cl[2]->handle));
  CHECK(cl[2]->sink->wait(3).code == Code::not_found);
  // Another client's handle is refused.
  node.engine.comm_destroy(cl[0]->ref, 4, cl[1]->comm);
  CHECK(cl[0]->sink->wait(4).code == Code::permission_denied);
  node.engine.comm_destroy(cl[1]->ref, 4, cl[1]->comm);
  CHECK(cl[1]->sink->wait(4).code == Code::ok);
}

TEST_CASE("status: what is in flight and who is missing") {
  Node node;
  auto cl = node.join(2);
  node.engine.collective(cl[0]->ref, 2, cl[0]->comm, all_reduce(4, 0, 64, cl[0]->handle));
  CHECK(node.engine.stats().in_flight == 1);
  const auto snap = node.engine.snapshot();
  REQUIRE(snap.size() == 1);
  REQUIRE(snap[0].ops.size() == 1);
  CHECK(snap[0].ops[0].op == "all_reduce(count=4, dtype=float, op=sum)");
  CHECK(snap[0].ops[0].missing == std::vector<std::uint32_t>{1});
  const auto shape = node.engine.comm_shape(cl[0]->ref.session, cl[0]->comm);
  REQUIRE(shape);
  CHECK(shape->next_seq == 1);
  CHECK(shape->nranks == 2);
  CHECK_FALSE(node.engine.comm_shape(cl[1]->ref.session, cl[0]->comm));
  node.engine.shutdown("the test is over");
  const Result res = cl[0]->sink->wait(2);
  CHECK(res.code == Code::aborted);
  CHECK(contains(res.message, "the test is over"));
}

TEST_CASE("collectives.algorithm parses once into its enum, and back") {
  for (const char* name : {"auto", "ring", "pairwise", "direct", "tree"}) {
    const auto forced = parse_algorithm_override(name);
    REQUIRE(forced);
    CHECK(to_string(*forced) == name);
  }
  CHECK(parse_algorithm_override("auto") == AlgorithmOverride::automatic);
  CHECK_FALSE(parse_algorithm_override("rings"));
  CHECK_FALSE(parse_algorithm_override(""));
}

// The lock discipline is the compiler's: a Locked comes only from an
// EngineLock that holds the mutex (engine/engine_lock.h).
static_assert(!std::is_default_constructible_v<Locked>);
static_assert(!std::is_constructible_v<Locked, std::mutex&>);
static_assert(!std::is_copy_assignable_v<Locked>);
static_assert(std::is_empty_v<Locked>);

TEST_CASE("an EngineLock holds the mutex while it hands out its token") {
  std::mutex mu;
  // Asked from another thread (try_lock by the owner is undefined).
  auto held = [&] {
    bool got = false;
    std::thread t([&] {
      got = mu.try_lock();
      if (got) mu.unlock();
    });
    t.join();
    return !got;
  };
  {
    EngineLock lock(mu);
    [[maybe_unused]] const Locked token = lock.token();
    CHECK(held());
    lock.unlock();
    CHECK_FALSE(held());
    lock.lock();
    CHECK(held());
  }
  CHECK_FALSE(held());
}
