// The algorithms between nodes, run by one thread per node over an in-memory
// channel (the fabric is the only stand-in; the algorithms and the reduction
// kernels are the real ones), for many rank layouts, sizes around the chunk
// and direct/ring thresholds, and every operation, checked against a
// reference computed here.
#include "engine/node_algorithms.h"
#include "engine/gpu/executor.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <tuple>

#include "ipc/error.h"

using namespace collectived;
using namespace collectived::engine;

namespace {

/// N mailboxes keyed by (from, tag).
class Fabric {
 public:
  explicit Fabric(int n) : boxes_(n) {}
  void put(int to, int from, std::uint64_t tag, std::vector<std::byte> bytes) {
    std::lock_guard lock(mu_);
    auto [it, fresh] = boxes_[to].emplace(std::make_pair(from, tag), std::move(bytes));
    REQUIRE(fresh);  // a tag is never reused within an operation
    cv_.notify_all();
  }
  std::vector<std::byte> take(int me, int from, std::uint64_t tag) {
    std::unique_lock lock(mu_);
    const auto key = std::make_pair(from, tag);
    if (!cv_.wait_for(lock, std::chrono::seconds(20),
                      [&] { return boxes_[me].count(key) != 0; })) {
      throw Error(Code::timeout, "node " + std::to_string(me) + " waited for tag " +
                                     std::to_string(tag) + " from " + std::to_string(from));
    }
    auto node = boxes_[me].extract(key);
    return std::move(node.mapped());
  }
  bool empty() {
    std::lock_guard lock(mu_);
    for (auto& b : boxes_) {
      if (!b.empty()) return false;
    }
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::map<std::pair<int, std::uint64_t>, std::vector<std::byte>>> boxes_;
};

/// A channel that sends as late as the NodeChannel contract allows: the bytes
/// of a send are read (copied into the fabric) only when this node flushes or
/// would otherwise block in recv. An algorithm that changes bytes it sent
/// before flush() therefore delivers wrong data and fails the checks, and one
/// that returns with sends outstanding fails `flushed()`.
class MemChannel final : public NodeChannel {
 public:
  /// `parallelism` > 1: compute_async runs each pass on a thread of its
  /// own after a random delay, so that passes finish out of order.
  MemChannel(Fabric& f, int me, int n, int parallelism = 1)
      : f_(f), me_(me), n_(n), parallelism_(parallelism), rng_(static_cast<unsigned>(me) * 7919u + 1) {}
  int node() const override { return me_; }
  int parallelism() const override { return parallelism_; }
  Ticket compute_async(std::function<void()> work) override {
    if (parallelism_ <= 1) return NodeChannel::compute_async(std::move(work));
    auto pass = std::make_shared<Pass>();
    const auto delay = std::chrono::microseconds(rng_() % 300);
    pass->thread = std::thread([pass = pass.get(), work = std::move(work), delay] {
      std::this_thread::sleep_for(delay);
      try {
        work();
      } catch (...) {
        pass->error = std::current_exception();
      }
      pass->done.store(true, std::memory_order_release);
    });
    ++async_;
    return pass;
  }
  bool compute_done(const Ticket& ticket) override {
    return !ticket || static_cast<Pass*>(ticket.get())->done.load(std::memory_order_acquire);
  }
  void compute_wait(const Ticket& ticket) override {
    if (!ticket) return;
    auto* pass = static_cast<Pass*>(ticket.get());
    pass->thread.join();
    ++waited_;
    if (pass->error) std::rethrow_exception(pass->error);
  }
  /// Every pass started was waited for.
  bool drained() const { return async_ == waited_; }
  int passes() const { return async_; }
  int nodes() const override { return n_; }
  void send(int to, std::uint64_t tag, std::span<const std::span<const std::byte>> pieces,
            std::shared_ptr<const void> owner) override {
    REQUIRE(to != me_);
    pending_.push_back({to, tag, {pieces.begin(), pieces.end()}, std::move(owner)});
  }
  NodePayload recv(int from, std::uint64_t tag) override {
    deliver();  // as the engine's channel: a receive lets the sends before it go
    auto bytes = f_.take(me_, from, tag);
    NodePayload p;
    p.size = bytes.size();
    // A posted buffer of the message's size takes it, as the TCP transport
    // reads a chunk straight into it.
    auto at = posted_.find({from, tag});
    if (at != posted_.end() && at->second.size() == bytes.size()) {
      std::memcpy(at->second.data(), bytes.data(), bytes.size());
      p.placed = at->second.data();
      posted_.erase(at);
      ++placed_;
      return p;
    }
    p.storage = MessageBytes::copy_of(bytes);
    return p;
  }
  void post(int from, std::uint64_t tag, std::span<std::byte> dest) override {
    posted_[{from, tag}] = dest;
  }
  /// Messages received straight into a posted buffer.
  int placed() const { return placed_; }
  void flush() override { deliver(); }
  void start_sends() override { deliver(); }
  std::byte* scratch(std::size_t bytes) override {
    scratch_.resize(bytes);
    return scratch_.data();
  }
  bool flushed() const { return pending_.empty(); }
  /// What written() was told: where, the bytes there at that moment, and
  /// how many sends had not been let go (start_sends, recv, flush).
  struct Told {
    const std::byte* p;
    std::vector<std::byte> bytes;
    std::size_t held;
  };
  void written(const std::byte* p, std::uint64_t bytes) override {
    told.push_back({p, std::vector<std::byte>(p, p + bytes), pending_.size()});
  }
  std::vector<Told> told;
  /// An input that arrives in pieces, as a staged GPU operation's does: it
  /// starts poisoned and reading() puts back the pieces (of `piece` bytes)
  /// that cover the range, each once. A read that was not announced reads
  /// poison, and the reference check fails.
  struct Lazy {
    std::byte* at;
    std::vector<std::byte> real;
    std::vector<bool> in;
  };
  void lazy_input(std::byte* at, std::uint64_t bytes, std::uint64_t piece) {
    piece_ = piece;
    Lazy l{at, std::vector<std::byte>(at, at + bytes), std::vector<bool>((bytes + piece - 1) / piece)};
    std::memset(at, 0x5A, bytes);
    lazy_.push_back(std::move(l));
  }
  void reading(const std::byte* p, std::uint64_t bytes) override {
    for (auto& l : lazy_) {
      if (p < l.at || p + bytes > l.at + l.real.size()) continue;
      const std::uint64_t a = static_cast<std::uint64_t>(p - l.at);
      if (!first_read) first_read = a;
      for (std::uint64_t k = a / piece_; k * piece_ < a + bytes; ++k) {
        if (l.in[k]) continue;
        l.in[k] = true;
        const std::uint64_t from = k * piece_, len = std::min<std::uint64_t>(piece_, l.real.size() - from);
        std::memcpy(l.at + from, l.real.data() + from, len);
      }
      return;
    }
    stray_reads++;
  }
  int stray_reads = 0;  // reading() of bytes that are no input
  std::optional<std::uint64_t> first_read;  // where in the input reading() was first called

 private:
  struct Pending {
    int to;
    std::uint64_t tag;
    std::vector<std::span<const std::byte>> pieces;
    std::shared_ptr<const void> owner;
  };
  void deliver() {
    for (auto& p : pending_) {
      std::vector<std::byte> bytes;
      for (auto piece : p.pieces) bytes.insert(bytes.end(), piece.begin(), piece.end());
      f_.put(p.to, me_, p.tag, std::move(bytes));
    }
    pending_.clear();
  }

  struct Pass {
    std::thread thread;
    std::exception_ptr error;
    std::atomic<bool> done{false};
  };

  Fabric& f_;
  int me_, n_;
  int parallelism_;
  std::minstd_rand rng_;
  int async_ = 0, waited_ = 0;
  std::vector<Pending> pending_;
  std::map<std::pair<int, std::uint64_t>, std::span<std::byte>> posted_;
  int placed_ = 0;
  std::vector<std::byte> scratch_;
  std::vector<Lazy> lazy_;
  std::uint64_t piece_ = 1;
};

std::int32_t input(int rank, std::uint64_t i) {
  return static_cast<std::int32_t>((rank * 7919 + i * 104729 + 13) % 2001) - 1000;
}

struct Case {
  OpKind kind;
  RedOp redop;
  std::uint64_t count;
  bool in_place;
  int root;
  /// Reduce-scatter: each rank's own contribution left out
  /// (NodeCollective::own_contribution_elsewhere); its own segment of the
  /// input holds garbage, and its output is the others' reduction, undivided.
  bool own_elsewhere = false;
};

/// Runs `c` on the layout `node_of_rank` with int32 elements; checks every
/// output. Returns how many passes ran through compute_async on all nodes.
int run(const std::vector<int>& node_of_rank, const Case& c, const NodeAlgorithmOptions& o,
         int parallelism = 1, int* placed = nullptr) {
  const int nranks = static_cast<int>(node_of_rank.size());
  const int nodes = *std::max_element(node_of_rank.begin(), node_of_rank.end()) + 1;
  const std::uint64_t one = c.count * 4;
  const bool wide_send = c.kind == OpKind::reduce_scatter || c.kind == OpKind::all_to_all;
  const bool wide_recv = c.kind == OpKind::all_gather || c.kind == OpKind::all_to_all;
  std::vector<std::vector<std::int32_t>> send(nranks), recv(nranks);
  for (int r = 0; r < nranks; ++r) {
    send[r].resize((wide_send ? nranks : 1) * c.count);
    recv[r].assign((wide_recv ? nranks : 1) * c.count + 1, -7);
    for (std::uint64_t i = 0; i < send[r].size(); ++i) send[r][i] = input(r, i);
    if (c.own_elsewhere) {
      for (std::uint64_t i = r * c.count; i < (r + 1) * c.count; ++i) send[r][i] = 0x5a5a5a5a;
    }
    if (c.in_place) {
      // The in-place layout: the send data sits where the output goes.
      const std::uint64_t at = c.kind == OpKind::all_gather ? r * c.count : 0;
      if (c.kind == OpKind::reduce_scatter) recv[r] = send[r];
      else if (!send[r].empty()) std::memcpy(recv[r].data() + at, send[r].data(), send[r].size() * 4);
    }
  }
  Fabric fabric(nodes);
  std::vector<std::string> errors(nodes);
  std::vector<std::vector<MemChannel::Told>> told(nodes);
  std::vector<std::vector<LocalBuffers>> locals(nodes);
  std::atomic<int> passes{0}, placed_all{0};
  std::vector<std::thread> threads;
  for (int j = 0; j < nodes; ++j) {
    threads.emplace_back([&, j] {
      try {
        MemChannel ch(fabric, j, nodes, parallelism);
        NodeCollective op;
        op.kind = c.kind;
        op.dtype = DType::int32;
        op.redop = c.redop;
        op.count = c.count;
        op.root = c.root;
        op.nranks = nranks;
        op.node_of_rank = node_of_rank;
        op.own_contribution_elsewhere = c.own_elsewhere;
        for (int r = 0; r < nranks; ++r) {
          if (node_of_rank[r] != j) continue;
          LocalBuffers b;
          b.rank = r;
          auto* rb = reinterpret_cast<std::byte*>(recv[r].data());
          b.recv = rb;
          b.recv_bytes = (wide_recv ? nranks : 1) * one;
          b.send = reinterpret_cast<std::byte*>(send[r].data());
          b.send_bytes = send[r].size() * 4;
          if (c.in_place) {
            b.send = c.kind == OpKind::all_gather ? rb + r * one : rb;
            if (c.kind == OpKind::reduce_scatter) b.recv = rb + r * one;
          }
          if (c.kind == OpKind::reduce && r != c.root) b.recv = nullptr;
          op.local.push_back(b);
        }
        locals[j] = op.local;
        if (reads_input_in_pieces(op.kind, one, nranks, static_cast<int>(op.local.size()), nodes, o)) {
          // 52 bytes: pieces that straddle chunks and elements alike.
          const auto& b = op.local[0];
          ch.lazy_input(b.send, wide_send ? nranks * one : one, 52);
        }
        run_node_collective(ch, op, o, 1000);
        if (ch.stray_reads != 0) errors[j] = "reading() of bytes that are no input";
        if (ch.first_read &&
            *ch.first_read != first_input_read(op.kind, c.count, op.dtype, node_of_rank, j, nodes, o)) {
          errors[j] = "read its input first at byte " + std::to_string(*ch.first_read) +
                      ", not where first_input_read says";
        }
        told[j] = std::move(ch.told);
        if (!ch.flushed()) errors[j] = "returned with sends outstanding";
        if (!ch.drained()) errors[j] = "returned with passes running";
        passes += ch.passes();
        placed_all += ch.placed();
      } catch (const std::exception& e) {
        errors[j] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (placed != nullptr) *placed = placed_all;
  for (int j = 0; j < nodes; ++j) CHECK_MESSAGE(errors[j].empty(), errors[j]);
  CHECK(fabric.empty());
  // `except`: a rank left out (own_elsewhere), and then no division.
  auto reduced = [&](std::uint64_t i, int except = -1) {
    const int first = except == 0 ? 1 : 0;
    std::int64_t acc = input(first, i);
    for (int r = first + 1; r < nranks; ++r) {
      if (r == except) continue;
      const std::int32_t v = input(r, i);
      switch (c.redop) {
        case RedOp::sum: case RedOp::avg: acc = static_cast<std::int32_t>(acc + v); break;
        case RedOp::prod: acc = static_cast<std::int32_t>(static_cast<std::uint32_t>(acc) * static_cast<std::uint32_t>(v)); break;
        case RedOp::min: acc = std::min<std::int64_t>(acc, v); break;
        case RedOp::max: acc = std::max<std::int64_t>(acc, v); break;
      }
    }
    if (c.redop == RedOp::avg && except < 0) acc = static_cast<std::int32_t>(acc) / nranks;
    return static_cast<std::int32_t>(acc);
  };
  // What was told final (NodeChannel::written) lies in the node's one
  // rank's output, once, and already held the final bytes; with one rank per
  // node and no final division, the whole output is told except where the
  // node only sends (broadcast root, reduce off the root) or the exchange is
  // direct (all-reduce; told as a whole or not at all elsewhere).
  for (int j = 0; j < nodes; ++j) {
    CAPTURE(j);
    if (locals[j].size() != 1 || (c.redop == RedOp::avg && !c.own_elsewhere)) {
      CHECK(told[j].empty());
      continue;
    }
    const LocalBuffers& b = locals[j][0];
    std::vector<std::pair<const std::byte*, std::uint64_t>> ranges;
    std::uint64_t sum = 0;
    for (const auto& t : told[j]) {
      REQUIRE(b.recv != nullptr);
      REQUIRE(t.p >= b.recv);
      REQUIRE(t.p + t.bytes.size() <= b.recv + b.recv_bytes);
      CHECK(std::memcmp(t.p, t.bytes.data(), t.bytes.size()) == 0);
      ranges.emplace_back(t.p, t.bytes.size());
      sum += t.bytes.size();
    }
    std::sort(ranges.begin(), ranges.end());
    for (std::size_t k = 1; k < ranges.size(); ++k) {
      CHECK(ranges[k - 1].first + ranges[k - 1].second <= ranges[k].first);
    }
    // One rank, pairwise all-gather: the copy of its own input into its
    // output (told final right after) runs once its sends are on their way.
    if (c.kind == OpKind::all_gather &&
        node_algorithm(c.kind, one * nranks, nodes, o) == "pairwise") {
      for (const auto& t : told[j]) {
        if (t.p == b.recv + b.rank * one) CHECK_MESSAGE(t.held == 0, "its own copy ran while its sends waited");
      }
    }
    const int root_node = node_of_rank[c.root];
    const std::string algorithm = node_algorithm(c.kind, one, nodes, o);
    // Told as a whole or not at all: not told.
    const bool direct_reduce = c.kind == OpKind::all_reduce &&
                               (algorithm == "direct" || algorithm == "recursive_doubling");
    const bool sends_only = (c.kind == OpKind::broadcast && root_node == j) ||
                            (c.kind == OpKind::reduce && root_node != j);
    if (nodes == 1) {
      // No exchange: outputs are final at the end (an all-gather's own copy
      // is told as it lands).
      CHECK((sum == 0 || sum == b.recv_bytes));
    } else if (c.kind == OpKind::all_to_all || c.kind == OpKind::barrier || direct_reduce ||
               sends_only || one == 0) {
      CHECK(sum == 0);
    } else {
      CHECK(sum == b.recv_bytes);
    }
  }
  if (c.kind == OpKind::barrier) return passes;
  int bad = 0;
  for (int r = 0; r < nranks; ++r) {
    for (std::uint64_t i = 0; i < c.count * (wide_recv ? nranks : 1) && bad < 3; ++i) {
      std::int32_t want = 0;
      switch (c.kind) {
        case OpKind::all_reduce: want = reduced(i); break;
        case OpKind::reduce: if (r != c.root) continue; want = reduced(i); break;
        case OpKind::reduce_scatter:
          want = reduced(r * c.count + i, c.own_elsewhere ? r : -1);
          break;
        case OpKind::broadcast: want = input(c.root, i); break;
        case OpKind::all_gather: want = input(static_cast<int>(i / c.count), i % c.count); break;
        case OpKind::all_to_all:
          want = input(static_cast<int>(i / c.count), r * c.count + i % c.count);
          break;
        default: break;
      }
      const std::uint64_t at =
          c.in_place && c.kind == OpKind::reduce_scatter ? r * c.count + i : i;
      if (recv[r][at] != want) {
        ++bad;
        FAIL_CHECK(to_string(c.kind) << " " << to_string(c.redop) << " rank " << r << " element " << i << ": " << recv[r][at]
                                     << " != " << want);
      }
    }
  }
  return passes;
}

}  // namespace

TEST_CASE("node algorithms match the reference for every layout, size and operation") {
  // Up to 8 nodes: the recursive doubling's hand-over (5, 6, 7 nodes) and
  // deeper trees.
  const std::vector<std::vector<int>> layouts = {{0, 1},
                                                 {0, 1, 2},
                                                 {2, 0, 1},
                                                 {0, 1, 0, 1},
                                                 {0, 0, 1, 2, 2, 2},
                                                 {2, 0, 1, 0},
                                                 {1, 0, 1, 2, 3, 3},
                                                 {0, 1, 2, 3, 4},
                                                 {4, 3, 2, 1, 0, 5},
                                                 {0, 1, 2, 3, 4, 5, 6, 0},
                                                 {0, 1, 2, 3, 4, 5, 6, 7}};
  // pairwise_max_nodes 1: small operations take the trees (larger: ring);
  // 4: recursive doubling, direct, pairwise up to 4 nodes, trees and ring
  // above; "tree" and "direct" at every size.
  for (const auto& [algorithm, pairwise_max] : std::vector<std::pair<std::string, int>>{
           {"auto", 1}, {"auto", 4}, {"tree", 4}, {"direct", 4}}) {
    NodeAlgorithmOptions o;
    o.chunk_bytes = 256;       // many chunks per segment
    o.direct_max_bytes = 512;  // the direct path and a larger one
    o.pairwise_max_nodes = pairwise_max;
    o.algorithm = *parse_algorithm_override(algorithm);
    CAPTURE(algorithm);
    CAPTURE(pairwise_max);
    const OpKind kinds[] = {OpKind::all_reduce, OpKind::all_gather, OpKind::reduce_scatter,
                            OpKind::broadcast,  OpKind::reduce,     OpKind::all_to_all,
                            OpKind::barrier};
    for (const auto& layout : layouts) {
      const int nranks = static_cast<int>(layout.size());
      for (OpKind k : kinds) {
        for (std::uint64_t count : {0ull, 1ull, 7ull, 100ull, 1001ull}) {
          for (bool in_place : {false, true}) {
            for (RedOp op : {RedOp::sum, RedOp::prod, RedOp::min, RedOp::max, RedOp::avg}) {
              const bool reducing =
                  k == OpKind::all_reduce || k == OpKind::reduce || k == OpKind::reduce_scatter;
              if (!reducing && op != RedOp::sum) continue;
              const int root = static_cast<int>((count + (in_place ? 1 : 0)) % nranks);
              CAPTURE(nranks);
              CAPTURE(count);
              CAPTURE(in_place);
              CAPTURE(root);
              run(layout, Case{k, op, count, in_place, root}, o);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("one node: the plan is none, and the local passes alone give the reference under every "
          "override") {
  for (const char* algorithm : {"auto", "ring", "pairwise", "direct", "tree"}) {
    NodeAlgorithmOptions o;
    o.chunk_bytes = 256;
    o.direct_max_bytes = 512;
    o.algorithm = *parse_algorithm_override(algorithm);
    CAPTURE(algorithm);
    for (const std::vector<int>& layout : std::vector<std::vector<int>>{{0}, {0, 0, 0}}) {
      for (OpKind k : {OpKind::all_reduce, OpKind::all_gather, OpKind::reduce_scatter,
                       OpKind::broadcast, OpKind::reduce, OpKind::all_to_all, OpKind::barrier}) {
        REQUIRE(node_plan(k, 1001, DType::int32, static_cast<int>(layout.size()), 1, o).algorithm ==
                NodeAlgorithm::none);
        for (std::uint64_t count : {0ull, 7ull, 1001ull}) {
          for (bool in_place : {false, true}) {
            for (RedOp op : {RedOp::sum, RedOp::avg}) {
              CAPTURE(layout.size());
              CAPTURE(k);
              CAPTURE(count);
              CAPTURE(in_place);
              run(layout, Case{k, op, count, in_place, static_cast<int>(count % layout.size())}, o);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("the runner follows the plan: one naming no algorithm of the kind fails at once") {
  Fabric fabric(2);
  MemChannel ch(fabric, 0, 2);
  std::vector<std::int32_t> buf(4, 1), out(4);
  NodeCollective op;
  op.dtype = DType::int32;
  op.count = 4;
  op.nranks = 2;
  op.node_of_rank = {0, 1};
  op.local.push_back(LocalBuffers{0, reinterpret_cast<std::byte*>(buf.data()), 16,
                                  reinterpret_cast<std::byte*>(out.data()), 16});
  for (auto [kind, algorithm] : std::vector<std::pair<OpKind, NodeAlgorithm>>{
           {OpKind::all_reduce, NodeAlgorithm::chain},
           {OpKind::all_gather, NodeAlgorithm::tree},
           {OpKind::reduce_scatter, NodeAlgorithm::direct},
           {OpKind::broadcast, NodeAlgorithm::ring},
           {OpKind::reduce, NodeAlgorithm::pairwise},
           {OpKind::all_to_all, NodeAlgorithm::ring},
           {OpKind::all_reduce, NodeAlgorithm::unknown}}) {
    CAPTURE(kind);
    op.kind = kind;
    NodePlan plan;
    plan.algorithm = algorithm;
    CHECK_THROWS_WITH_AS(run_node_collective(ch, op, plan, NodeAlgorithmOptions{}, 1000),
                         doctest::Contains("between nodes"), Error);
    CHECK(fabric.empty());
  }
}

TEST_CASE("an all-reduce or reduce-scatter of 8 MiB per rank on 4 nodes: the ring, its input reduced "
          "where it is") {
  // The default options: the size, not a lowered threshold, picks the ring.
  NodeAlgorithmOptions o;
  REQUIRE(node_algorithm(OpKind::all_reduce, 8 << 20, 4, o) == "ring");
  REQUIRE(node_algorithm(OpKind::reduce_scatter, 8 << 20, 4, o) == "ring");
  const std::uint64_t count = (8 << 20) / 4;
  for (OpKind kind : {OpKind::all_reduce, OpKind::reduce_scatter}) {
    for (const auto& layout : std::vector<std::vector<int>>{{0, 1, 2, 3}, {3, 2, 1, 0, 0}}) {
      for (bool in_place : {false, true}) {
        for (RedOp op : {RedOp::sum, RedOp::avg}) {
          CAPTURE(kind);
          CAPTURE(layout.size());
          CAPTURE(in_place);
          run(layout, Case{kind, op, count, in_place, 0}, o);
        }
      }
    }
  }
}

TEST_CASE("a transfer of two to four chunks is cut into four, the same on both ends") {
  constexpr std::uint64_t chunk = 1044480;  // 1 MiB less 4 KiB: any chunk will do
  CHECK(transfer_chunk(0, chunk) == chunk);
  CHECK(transfer_chunk(1 << 20, chunk) == chunk);              // one chunk and a bit: as it was
  CHECK(transfer_chunk(2 * chunk - 1, chunk) == chunk);
  CHECK(transfer_chunk(2 << 20, chunk) == 512 * 1024);         // 4 MiB all-reduce, 2 nodes
  CHECK(transfer_chunk(3 << 20, chunk) == 786432);
  CHECK(transfer_chunk(4 * chunk - 1, chunk) == chunk);        // whole pages, never above the chunk
  CHECK(transfer_chunk(4 * chunk, chunk) == chunk);
  CHECK(transfer_chunk(16 << 20, chunk) == chunk);
  CHECK(transfer_chunk(5000, 256) == 256);                     // many chunks: as it was
  CHECK(transfer_chunk(40000, 16384) == 12288);

  // Every operation with transfers in that range (16 KiB chunks; int32
  // elements: 28-49 KB per rank, segments of 7-49 KB), pairwise and ring.
  const std::vector<std::vector<int>> layouts = {{0, 1}, {0, 1, 2}, {0, 0, 1, 2, 2, 2}, {1, 0, 1, 2, 3, 3}};
  for (const int pairwise_max : {1, 4}) {
    NodeAlgorithmOptions o;
    o.chunk_bytes = 16384;
    o.direct_max_bytes = 512;
    o.pairwise_max_nodes = pairwise_max;
    for (const auto& layout : layouts) {
      for (OpKind k : {OpKind::all_reduce, OpKind::all_gather, OpKind::reduce_scatter, OpKind::broadcast,
                       OpKind::reduce}) {
        for (std::uint64_t count : {7001ull, 12345ull}) {
          for (bool in_place : {false, true}) {
            CAPTURE(pairwise_max);
            CAPTURE(layout.size());
            CAPTURE(count);
            CAPTURE(in_place);
            run(layout, Case{k, RedOp::sum, count, in_place, static_cast<int>(count % layout.size())}, o);
          }
        }
      }
    }
  }
}

TEST_CASE("a pairwise reduce-scatter segment of one chunk is reduced in parts at once") {
  // Default options: 1 MiB chunks (a segment below 2 MiB goes whole). Each
  // node with one rank has a segment of one chunk of 1 MiB or more, which
  // reduce_split cuts in parts of kSplitReduceBytes (512 KiB) or more where
  // parallelism > 1; a node with two ranks has chunks reduced on the pool.
  NodeAlgorithmOptions o;
  const std::vector<std::vector<int>> layouts = {{0, 1}, {0, 1, 2}, {1, 0, 1}};
  for (const auto& layout : layouts) {
    for (OpKind k : {OpKind::all_reduce, OpKind::reduce_scatter}) {
      // all-reduce: segments of count x 4 / nodes bytes; reduce-scatter: of
      // count x 4 per rank of the node.
      const std::uint64_t count = k == OpKind::all_reduce ? 800003 : 270001;
      for (bool in_place : {false, true}) {
        for (RedOp op : {RedOp::sum, RedOp::max, RedOp::avg}) {
          for (int parallelism : {1, 2, 5}) {
            CAPTURE(layout.size());
            CAPTURE(k);
            CAPTURE(in_place);
            CAPTURE(parallelism);
            const int passes = run(layout, Case{k, op, count, in_place, 0}, o, parallelism);
            CHECK((passes > 0) == (parallelism > 1));
          }
        }
      }
    }
  }
}

TEST_CASE("pairwise reduce-scatter and all-reduce with chunk reductions running at once, "
          "finishing out of order") {
  NodeAlgorithmOptions o;
  o.chunk_bytes = 256;
  o.direct_max_bytes = 512;
  const std::vector<std::vector<int>> layouts = {{0, 1}, {0, 1, 2}, {0, 0, 1, 2, 2, 2}, {1, 0, 1, 2, 3, 3}};
  for (const auto& layout : layouts) {
    for (OpKind k : {OpKind::all_reduce, OpKind::reduce_scatter}) {
      for (std::uint64_t count : {1001ull, 4099ull}) {
        for (bool in_place : {false, true}) {
          for (RedOp op : {RedOp::sum, RedOp::max, RedOp::avg}) {
            for (int parallelism : {2, 5}) {
              CAPTURE(layout.size());
              CAPTURE(count);
              CAPTURE(in_place);
              CAPTURE(parallelism);
              CHECK(run(layout, Case{k, op, count, in_place, 0}, o, parallelism) > 0);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("two nodes, one rank each: a reduce-scatter leaving its own contribution out (combined on "
          "the client's GPU) writes the other node's, never reads its own segment") {
  for (std::uint64_t chunk : {256ull, 1ull << 20}) {
    NodeAlgorithmOptions o;
    o.chunk_bytes = chunk;
    for (std::uint64_t count : {1ull, 1001ull, 300001ull}) {
      if (chunk == 256 && count > 1001) continue;  // thousands of chunks: long under the sanitizers
      for (bool in_place : {false, true}) {
        for (RedOp op : {RedOp::sum, RedOp::prod, RedOp::min, RedOp::max, RedOp::avg}) {
          for (int parallelism : {1, 3}) {
            CAPTURE(chunk);
            CAPTURE(count);
            CAPTURE(in_place);
            CAPTURE(op);
            CAPTURE(parallelism);
            int placed = 0;
            run({0, 1}, Case{OpKind::reduce_scatter, op, count, in_place, 0, true}, o, parallelism,
                &placed);
            // Chunks of 64 KiB or more are received straight into the output.
            CHECK((placed > 0) == (count * 4 >= (64u << 10) && chunk >= (64u << 10)));
            run({1, 0}, Case{OpKind::reduce_scatter, op, count, in_place, 0, true}, o, parallelism);
          }
        }
      }
    }
  }
  SUBCASE("refused where it does not hold: three nodes, two ranks on a node, the ring, another kind") {
    NodeAlgorithmOptions o;
    CHECK(reduce_scatter_own_elsewhere(2, o));
    CHECK_FALSE(reduce_scatter_own_elsewhere(3, o));
    o.algorithm = AlgorithmOverride::ring;
    CHECK_FALSE(reduce_scatter_own_elsewhere(2, o));
    // A request that says so anyway fails before anything is sent.
    for (const auto& [layout, kind, algorithm] :
         std::vector<std::tuple<std::vector<int>, OpKind, std::string>>{
             {{0, 1, 2}, OpKind::reduce_scatter, "auto"},
             {{0, 1}, OpKind::reduce_scatter, "ring"},
             {{0, 0, 1}, OpKind::reduce_scatter, "auto"},
             {{0, 1}, OpKind::all_reduce, "auto"}}) {
      CAPTURE(layout.size());
      CAPTURE(kind);
      const int nodes = *std::max_element(layout.begin(), layout.end()) + 1;
      NodeAlgorithmOptions bad;
      bad.algorithm = *parse_algorithm_override(algorithm);
      Fabric fabric(nodes);
      MemChannel ch(fabric, 0, nodes, 1);
      std::vector<std::int32_t> send(layout.size() * 64), recv(layout.size() * 64);
      NodeCollective op;
      op.kind = kind;
      op.dtype = DType::int32;
      op.count = 64;
      op.nranks = static_cast<int>(layout.size());
      op.node_of_rank = layout;
      op.own_contribution_elsewhere = true;
      for (int r = 0; r < op.nranks; ++r) {
        if (layout[r] != 0) continue;
        op.local.push_back(LocalBuffers{r, reinterpret_cast<std::byte*>(send.data()), send.size() * 4,
                                        reinterpret_cast<std::byte*>(recv.data()) + r * 256, 256});
      }
      try {
        run_node_collective(ch, op, bad, 1000);
        FAIL("accepted");
      } catch (const Error& e) {
        CHECK(e.code() == Code::invalid_argument);
        CHECK(std::string(e.what()).find("own contribution") != std::string::npos);
      }
      CHECK(fabric.empty());
    }
  }
}

TEST_CASE("one rank per node, pairwise all-gather: the own copy runs on the pool beside the exchange") {
  // Inputs of 256 KiB and more (kOwnCopyAsyncBytes) with cores to spare: the
  // copy is a pass (run() counts them), finished between received chunks or
  // at the end, and told final once done. In place there is nothing to copy.
  NodeAlgorithmOptions o;
  o.chunk_bytes = 64 << 10;
  for (const std::vector<int>& layout : std::vector<std::vector<int>>{{0, 1}, {0, 1, 2}, {2, 0, 1}}) {
    for (bool in_place : {false, true}) {
      for (int parallelism : {1, 2}) {
        CAPTURE(layout.size());
        CAPTURE(in_place);
        CAPTURE(parallelism);
        const int passes = run(layout, Case{OpKind::all_gather, RedOp::sum, 65536 + 77, in_place, 0}, o, parallelism);
        CHECK(passes == (parallelism > 1 && !in_place ? static_cast<int>(layout.size()) : 0));
      }
    }
  }
}

TEST_CASE("an error from the channel reaches the caller") {
  Fabric fabric(2);
  MemChannel ch(fabric, 0, 2);
  NodeCollective op;
  op.kind = OpKind::all_reduce;
  op.dtype = DType::int32;
  op.count = 4;
  op.nranks = 2;
  op.node_of_rank = {0, 1};
  std::vector<std::int32_t> buf(4, 1);
  std::vector<std::int32_t> out(4);
  op.local.push_back(LocalBuffers{0, reinterpret_cast<std::byte*>(buf.data()), 16,
                                  reinterpret_cast<std::byte*>(out.data()), 16});
  // Node 1 answers with a message of the wrong size.
  fabric.put(0, 1, 1000 + (std::uint64_t{1} << 40), std::vector<std::byte>(8));
  CHECK_THROWS_WITH_AS(run_node_collective(ch, op, NodeAlgorithmOptions{}, 1000),
                       doctest::Contains("node 1 sent 8 bytes where 16 were expected"), Error);
}

TEST_CASE("input pieces: which pieces a range needs, in the order they are copied") {
  // 4 pieces of 100 bytes (the last one short: 350 bytes), copied 2, 3, 0, 1.
  gpu::InPieces in;
  in.piece = 100;
  in.count = 4;
  in.first = 2;
  CHECK(in.reached.load() == 0);  // none is in yet: every range waits
  CHECK(in.needed(200, 201) == 1);
  CHECK(in.needed(200, 300) == 1);  // piece 2: copied first
  CHECK(in.needed(300, 350) == 2);  // piece 3 (short)
  CHECK(in.needed(0, 1) == 3);      // piece 0
  CHECK(in.needed(150, 250) == 4);  // pieces 1 and 2: the later of the two
  CHECK(in.needed(0, 350) == 4);
  CHECK(in.needed(299, 301) == 2);  // straddles 2 and 3
  // Unrotated: the prefix.
  in.first = 0;
  CHECK(in.needed(0, 100) == 1);
  CHECK(in.needed(100, 101) == 2);
  CHECK(in.needed(250, 350) == 4);
  // reached moves forward only; a failure is kept with its reason.
  in.arrived(2, Code::ok, "");
  CHECK(in.reached.load() == 3);
  in.arrived(1, Code::ok, "");
  CHECK(in.reached.load() == 3);
  int woken = 0;
  in.on_change([&] { ++woken; });
  in.arrived(3, Code::timeout, "late");
  CHECK(in.failed.load());
  CHECK(in.error().first == Code::timeout);
  CHECK(in.error().second == "late");
  CHECK(woken == 1);
}
