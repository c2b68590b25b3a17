// Communicators across nodes without daemons: two or three engines in one
// process, their node messages carried in order by an in-memory transport
// (one delivery thread, as a daemon's event loop would hand them over).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/log.h"
#include "engine/registry.h"
#include "ipc/fd.h"

using namespace collectived;
using namespace collectived::engine;
using namespace std::chrono_literals;

namespace {

class Sink : public CompletionSink {
 public:
  void complete(std::uint64_t request, Result result) override {
    std::lock_guard lock(mu_);
    results_.emplace(request, std::move(result));
    cv_.notify_all();
  }
  Result wait(std::uint64_t request, std::chrono::milliseconds wait = 10000ms) {
    std::unique_lock lock(mu_);
    const bool got = cv_.wait_for(lock, wait, [&] { return results_.count(request) != 0; });
    REQUIRE_MESSAGE(got, "no answer to request " << request);
    return results_.find(request)->second;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<std::uint64_t, Result> results_;
};

/// Carries messages between engines in order, on one thread.
class Wire {
 public:
  Wire() : thread_([this] { loop(); }) {}
  ~Wire() { stop(); }
  void attach(const std::string& address, Engine* engine) {
    std::lock_guard lock(mu_);
    engines_[address] = engine;
  }
  /// `address` is unreachable from now on: sends to it fail, and every other
  /// engine hears that it went away.
  void cut(const std::string& address) {
    post([this, address] {
      Engine* gone = nullptr;
      std::vector<Engine*> others;
      {
        std::lock_guard lock(mu_);
        gone = engines_[address];
        engines_.erase(address);
        for (auto& [a, e] : engines_) others.push_back(e);
      }
      (void)gone;
      for (Engine* e : others) e->node_down(address, "", "the test cut it");
    });
  }
  void send(const std::string& from, const std::string& to, OutMessage m,
            NodeTransport::Done done) {
    auto bytes = std::make_shared<std::vector<std::byte>>(m.flatten());
    post([this, from, to, bytes, done = std::move(done)] {
      Engine* e = nullptr;
      {
        std::lock_guard lock(mu_);
        auto it = engines_.find(to);
        if (it != engines_.end()) e = it->second;
      }
      if (e == nullptr) {
        done(Code::unavailable, "no node at " + to);
        return;
      }
      e->node_message(from, MessageBytes::copy_of(*bytes));
      done(Code::ok, "");
    });
  }
  void stop() {
    {
      std::lock_guard lock(mu_);
      if (stop_) return;
      stop_ = true;
      jobs_.clear();
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void post(std::function<void()> job) {
    std::lock_guard lock(mu_);
    if (stop_) return;
    jobs_.push_back(std::move(job));
    cv_.notify_all();
  }
  void loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::map<std::string, Engine*> engines_;
  bool stop_ = false;
  std::thread thread_;
};

class WireTransport : public NodeTransport {
 public:
  WireTransport(Wire& wire, std::string from) : wire_(wire), from_(std::move(from)) {}
  void send(const std::string& address, OutMessage message, Done done) override {
    wire_.send(from_, address, std::move(message), std::move(done));
  }

 private:
  Wire& wire_;
  std::string from_;
};

/// One node: its daemon's engine, registry and logger.
struct Node {
  Node(Wire& wire, const std::string& name, const std::string& address)
      : address(address),
        transport(wire, address),
        log(config::LogLevel::error, devnull.get()),
        registry(RegistryLimits{}),
        engine(options(name, address), registry, log) {
    engine.set_node_transport(&transport);
    wire.attach(address, &engine);
  }
  static EngineOptions options(const std::string& name, const std::string& address) {
    EngineOptions o;
    o.node_name = name;
    o.rendezvous_address = address;
    o.operation_deadline = 5000ms;
    o.rendezvous_deadline = 5000ms;
    o.worker_threads = 2;
    return o;
  }
  std::string address;
  WireTransport transport;
  UniqueFd devnull{::open("/dev/null", O_WRONLY | O_CLOEXEC)};
  Logger log;
  Registry registry;
  Engine engine;
};

/// A rank: a client of one node with a registered buffer.
struct Rank {
  Rank(Node& n, std::uint64_t session, std::size_t bytes = std::size_t{2} << 20)
      : node(n), size(bytes) {
    ref.session = session;
    ref.pid = static_cast<pid_t>(2000 + session);
    ref.sink = sink;
    UniqueFd fd(::memfd_create("across_nodes_test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    REQUIRE(fd);
    REQUIRE(::ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
    REQUIRE(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
    REQUIRE(p != MAP_FAILED);
    view = static_cast<std::byte*>(p);
    handle = n.registry.add(session, HostMapping::map_memfd(std::move(fd), bytes));
  }
  ~Rank() { ::munmap(view, size); }
  float* floats(std::size_t offset = 0) { return reinterpret_cast<float*>(view + offset); }

  Node& node;
  std::shared_ptr<Sink> sink = std::make_shared<Sink>();
  ClientRef ref;
  std::byte* view = nullptr;
  std::size_t size;
  std::uint64_t handle = 0;
  std::uint64_t comm = 0;
  CommInfo info;
};

struct Cluster {
  explicit Cluster(int nodes) {
    for (int i = 0; i < nodes; ++i) {
      const std::string name(1, static_cast<char>('a' + i));
      this->nodes.push_back(std::make_unique<Node>(wire, "node-" + name, "host-" + name + ":1"));
    }
  }
  ~Cluster() {
    ranks.clear();
    wire.stop();  // no delivery into an engine being destroyed
  }
  /// Ranks on nodes `where[r]`, joined to one communicator at node 0's daemon.
  void join(const std::vector<int>& where, char id = 'x') {
    for (std::size_t r = 0; r < where.size(); ++r) {
      ranks.push_back(std::make_unique<Rank>(*nodes[where[r]], r + 1));
    }
    const std::string secret(16, id);
    for (std::size_t r = 0; r < where.size(); ++r) {
      ranks[r]->node.engine.comm_init(ranks[r]->ref, 1, secret, nodes[0]->address,
                                      static_cast<std::uint32_t>(where.size()),
                                      static_cast<std::uint32_t>(r));
    }
    for (auto& rk : ranks) {
      const Result res = rk->sink->wait(1);
      REQUIRE_MESSAGE(res.code == Code::ok, res.message);
      REQUIRE(res.comm);
      rk->comm = res.comm->handle;
      rk->info = *res.comm;
    }
  }
  Wire wire;
  std::vector<std::unique_ptr<Node>> nodes;
  std::vector<std::unique_ptr<Rank>> ranks;
};

constexpr std::uint64_t kRecvAt = std::uint64_t{1} << 20;  // outputs in the second MiB

CollectiveArgs all_reduce(std::uint64_t count, std::uint64_t handle) {
  CollectiveArgs a;
  a.kind = OpKind::all_reduce;
  a.dtype = static_cast<std::uint32_t>(DType::float32);
  a.redop = static_cast<std::uint32_t>(RedOp::sum);
  a.count = count;
  a.send = BufferArg{handle, 0};
  a.recv = BufferArg{handle, kRecvAt};
  return a;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("across nodes: the rendezvous daemon answers every node's ranks") {
  Cluster c(2);
  c.join({0, 1, 1});
  CHECK(c.ranks[0]->info.nodes == 2);
  CHECK(c.ranks[0]->info.node == 0);
  CHECK(c.ranks[1]->info.node == 1);
  CHECK(c.ranks[2]->info.rank == 2);
  CHECK(c.ranks[0]->info.next_node_first_rank == 1);
  const auto shape = c.nodes[1]->engine.comm_shape(c.ranks[1]->ref.session, c.ranks[1]->comm);
  REQUIRE(shape);
  CHECK(shape->nodes == 2);
}

TEST_CASE("across nodes: an all-reduce gives every rank the sum, in every size class") {
  Cluster c(3);
  c.join({0, 1, 2, 1});
  // Small (recursive doubling) and large (pairwise, in chunks) operations.
  for (std::uint64_t count : {std::uint64_t{1}, std::uint64_t{100}, std::uint64_t{200000}}) {
    for (std::size_t r = 0; r < c.ranks.size(); ++r) {
      for (std::uint64_t i = 0; i < count; ++i) c.ranks[r]->floats()[i] = static_cast<float>(r + 1);
    }
    const std::uint64_t request = 10 + count;
    for (auto& rk : c.ranks)
      rk->node.engine.collective(rk->ref, request, rk->comm, all_reduce(count, rk->handle));
    for (auto& rk : c.ranks) {
      const Result res = rk->sink->wait(request);
      REQUIRE_MESSAGE(res.code == Code::ok, res.message);
      for (std::uint64_t i = 0; i < count; ++i)
        REQUIRE(rk->floats(kRecvAt)[i] == 10.0f);  // 1+2+3+4
    }
  }
}

TEST_CASE("across nodes: a mismatch is named on every node") {
  Cluster c(2);
  c.join({0, 1});
  c.ranks[0]->node.engine.collective(c.ranks[0]->ref, 2, c.ranks[0]->comm,
                                     all_reduce(4, c.ranks[0]->handle));
  c.ranks[1]->node.engine.collective(c.ranks[1]->ref, 2, c.ranks[1]->comm,
                                     all_reduce(8, c.ranks[1]->handle));
  for (auto& rk : c.ranks) {
    const Result res = rk->sink->wait(2);
    CHECK(res.code == Code::mismatch);
    CHECK(contains(res.message, "mismatched operations for sequence number 0"));
    CHECK(contains(res.message, "count=4"));
    CHECK(contains(res.message, "count=8"));
  }
}

TEST_CASE("across nodes: split makes children that span the nodes they need") {
  Cluster c(2);
  c.join({0, 0, 1, 1});
  // Color 0: ranks 0 and 2 (both nodes); color 1: ranks 1 and 3 (both nodes).
  for (std::size_t r = 0; r < 4; ++r) {
    auto& rk = c.ranks[r];
    rk->node.engine.comm_split(rk->ref, 2, rk->comm, static_cast<int>(r % 2), 0);
  }
  std::vector<CommInfo> child(4);
  for (std::size_t r = 0; r < 4; ++r) {
    const Result res = c.ranks[r]->sink->wait(2);
    REQUIRE_MESSAGE(res.code == Code::ok, res.message);
    REQUIRE(res.comm);
    child[r] = *res.comm;
    CHECK(child[r].nranks == 2);
    CHECK(child[r].nodes == 2);
  }
  CHECK(child[0].rank == 0);
  CHECK(child[2].rank == 1);
  for (std::size_t r = 0; r < 4; ++r) c.ranks[r]->floats()[0] = static_cast<float>(r + 1);
  for (std::size_t r = 0; r < 4; ++r) {
    auto& rk = c.ranks[r];
    rk->node.engine.collective(rk->ref, 3, child[r].handle, all_reduce(1, rk->handle));
  }
  for (std::size_t r = 0; r < 4; ++r) {
    const Result res = c.ranks[r]->sink->wait(3);
    REQUIRE_MESSAGE(res.code == Code::ok, res.message);
    CHECK(c.ranks[r]->floats(kRecvAt)[0] == (r % 2 == 0 ? 4.0f : 6.0f));  // 1+3, 2+4
  }
}

TEST_CASE("across nodes: send/recv between ranks of two nodes") {
  Cluster c(2);
  c.join({0, 1});
  std::memcpy(c.ranks[0]->view, "over the wire", 14);
  P2PArgs send;
  send.is_send = true;
  send.peer = 1;
  send.buffer = BufferArg{c.ranks[0]->handle, 0};
  send.count = 14;
  send.dtype = static_cast<std::uint32_t>(DType::uint8);
  P2PArgs recv = send;
  recv.is_send = false;
  recv.peer = 0;
  recv.buffer = BufferArg{c.ranks[1]->handle, 64};
  c.ranks[0]->node.engine.p2p_group(c.ranks[0]->ref, 2, c.ranks[0]->comm, {send});
  c.ranks[1]->node.engine.p2p_group(c.ranks[1]->ref, 2, c.ranks[1]->comm, {recv});
  CHECK(c.ranks[0]->sink->wait(2).code == Code::ok);
  CHECK(c.ranks[1]->sink->wait(2).code == Code::ok);
  CHECK(std::memcmp(c.ranks[1]->view + 64, "over the wire", 14) == 0);
}

TEST_CASE("across nodes: a rank that dies breaks the communicator on the other node") {
  Cluster c(2);
  c.join({0, 1});
  c.ranks[0]->node.engine.collective(c.ranks[0]->ref, 2, c.ranks[0]->comm,
                                     all_reduce(4, c.ranks[0]->handle));
  c.nodes[1]->engine.client_gone(c.ranks[1]->ref.session);
  const Result res = c.ranks[0]->sink->wait(2);
  CHECK(res.code == Code::remote);
  CHECK(contains(res.message, "rank 1 (pid 2002 on node node-b)"));
  CHECK(contains(res.message, "disconnected"));
}

TEST_CASE("across nodes: a node that goes away breaks what spans it, naming it") {
  Cluster c(2);
  c.join({0, 1});
  c.ranks[0]->node.engine.collective(c.ranks[0]->ref, 2, c.ranks[0]->comm,
                                     all_reduce(4, c.ranks[0]->handle));
  c.wire.cut(c.nodes[1]->address);
  const Result res = c.ranks[0]->sink->wait(2);
  CHECK(res.code == Code::remote);
  CHECK(contains(res.message, "node node-b (host-b:1), which hosts rank 1, is unreachable"));
}

TEST_CASE("across nodes: profiles that disagree on the algorithm fail the operation at once") {
  Cluster c(2);
  NodeAlgorithmOptions direct, pairwise;
  direct.algorithm = AlgorithmOverride::direct;
  pairwise.algorithm = AlgorithmOverride::pairwise;
  c.nodes[0]->engine.set_node_algorithms(direct);
  c.nodes[1]->engine.set_node_algorithms(pairwise);
  c.join({0, 1});
  for (auto& rk : c.ranks)
    rk->node.engine.collective(rk->ref, 2, rk->comm, all_reduce(100, rk->handle));
  for (auto& rk : c.ranks) {
    const Result res = rk->sink->wait(2, 3000ms);  // well before the 5 s deadline
    CHECK(res.code == Code::mismatch);
    CHECK(contains(res.message, "mismatched plans for sequence number 0"));
    CHECK(contains(res.message, "as direct"));
    CHECK(contains(res.message, "pairwise in chunks of 1048576 bytes"));
  }
}

TEST_CASE("across nodes: an operation waiting for another node's ranks times out naming them") {
  Cluster c(2);
  c.join({0, 1});
  CollectiveArgs a = all_reduce(4, c.ranks[0]->handle);
  a.deadline = 100ms;
  c.ranks[0]->node.engine.collective(c.ranks[0]->ref, 2, c.ranks[0]->comm, a);
  const Result res = c.ranks[0]->sink->wait(2, 3000ms);
  CHECK(res.code == Code::timeout);
  CHECK(contains(res.message, "timed out after 100 ms (the operation's timeout, set by rank 0"));
  CHECK(contains(res.message, "waiting for node node-b (host-b:1), which hosts rank 1"));
}
