// The runner: one collective on this node. It combines the local ranks'
// inputs, hands the exchange between nodes to the algorithm its plan names
// (made once by the selector, engine/algorithms/selector.cc; each algorithm
// in its own file under engine/algorithms/), and writes every local rank's
// output. It dispatches on plan.algorithm alone: no size or override is
// looked at again here. The local
// passes are here because they depend on the operation's shape (one rank on
// the node or several, in place or not), not on the algorithm.
#include "engine/node_algorithms.h"

#include <functional>
#include <string>

#include "engine/algorithms/chain.h"
#include "engine/algorithms/context.h"
#include "engine/algorithms/direct.h"
#include "engine/algorithms/exchange.h"
#include "engine/algorithms/pairwise.h"
#include "engine/algorithms/passes.h"
#include "engine/algorithms/recursive_doubling.h"
#include "engine/algorithms/ring.h"
#include "engine/algorithms/selector.h"
#include "engine/algorithms/tree.h"
#include "engine/reduce.h"
#include "ipc/error.h"

namespace collectived::engine {

namespace {

using namespace algorithms;

/// The smallest input whose copy into its own place in the output runs on the
/// worker pool beside a one-rank pairwise all-gather's exchange (where cores
/// are spare), not on the thread that serves the peers.
constexpr std::uint64_t kOwnCopyAsyncBytes = std::uint64_t{256} << 10;

/// One operation on this node: what every kind's run shares, and its passes
/// over the local ranks' buffers. Passes over whole buffers leave the thread
/// that serves the peers when large (offload); per-chunk work stays where
/// the chunk is.
struct Run {
  Run(NodeChannel& channel, const NodeCollective& o, NodeAlgorithm a,
      const NodeAlgorithmOptions& opts, std::uint64_t base)
      : ch(channel),
        op(o),
        options(opts),
        algorithm(a),
        algo(channel, opts, base),
        n(channel.nodes()),
        me(channel.node()),
        es(dtype_size(o.dtype)),
        one(o.count * es),
        L(o.local),
        // avg is a sum until the very end, where it is divided once by nranks.
        combine(o.redop == RedOp::avg ? RedOp::sum : o.redop),
        // Chunks of the output are told final as they land
        // (NodeChannel::written) where nothing passes over the whole output
        // afterwards: one rank on the node (no copies to the others) and not
        // avg (divided at the very end, unless the division is the client's).
        tell(L.size() == 1 && (o.redop != RedOp::avg || o.own_contribution_elsewhere)),
        // The input may still be arriving: every read of it waits for its bytes.
        in_pieces(
            reads_input_in_pieces(o.kind, one, o.nranks, static_cast<int>(L.size()), n, opts)) {
    algo.guard_input(in_pieces);
  }

  template <typename Work>
  void pass(std::uint64_t bytes, const Work& work) {
    offload(ch, bytes, work);
  }
  void finish_avg(std::byte* p, std::uint64_t bytes) {
    if (op.redop != RedOp::avg || bytes == 0) return;
    pass(bytes, [&] {
      const void* src[1] = {p};
      reduce(op.dtype, RedOp::avg, p, src, 1, bytes / es, static_cast<std::size_t>(op.nranks));
    });
  }
  void local_reduce(std::byte* dst, std::uint64_t bytes) {
    if (bytes == 0) return;
    pass(bytes * L.size(), [&] {
      std::vector<const void*> srcs;
      for (const auto& b : L) srcs.push_back(b.send);
      reduce(op.dtype, combine, dst, srcs.data(), srcs.size(), bytes / es, 1);
    });
  }
  /// The same `bytes` from `src` to every local rank's output but the first.
  void copy_to_others(const std::byte* src, std::uint64_t bytes) {
    if (L.size() < 2) return;
    pass(bytes * (L.size() - 1), [&] {
      for (std::size_t k = 1; k < L.size(); ++k) copy_bytes(L[k].recv, src, bytes);
    });
  }

  NodeChannel& ch;
  const NodeCollective& op;
  const NodeAlgorithmOptions& options;
  const NodeAlgorithm algorithm;  ///< the plan's (serves() op.kind)
  Context algo;
  const int n, me;
  const std::size_t es;
  const std::uint64_t one;  ///< bytes per rank
  const std::vector<LocalBuffers>& L;
  const RedOp combine;
  const bool tell;
  const bool in_pieces;
};

/// Pairwise all-reduce: each reduced chunk goes out at once (phase 2); then
/// the others' chunks come in. With one rank (`one_rank`), its input is read
/// in place and reduced into its output; out of place, nothing the sends
/// read is written next, so the receives need not wait for them.
/// The others' reduced segments may be received straight into `w`, in place
/// too, where the reduce-scatter sends read those very segments: node j
/// sends its chunk c of segment j only after it has reduced it, that is
/// after it received ours, so our send has been read by then (by any
/// transport: the bytes reached j). The causal order stands in for the flush
/// the NodeChannel contract asks for.
void pairwise_all_reduce(Run& r, std::byte* w, const std::vector<Segment>& segs, bool one_rank) {
  post_all_gather(r.algo, w, segs, 2);
  if (one_rank) {
    pairwise_reduce_scatter(r.algo, r.L[0].send, segs, r.op.dtype, r.combine, 1,
                            w + (segs[r.me].empty() ? 0 : segs[r.me][0].offset), 2,
                            /*flush=*/r.L[0].send == w);
  } else {
    pairwise_reduce_scatter(r.algo, w, segs, r.op.dtype, r.combine, 1, nullptr, 2);
  }
  pairwise_all_gather_recv(r.algo, w, segs, 2);
}

void run_all_reduce(Run& r) {
  using A = NodeAlgorithm;
  std::byte* w = r.L[0].recv;
  const auto segs = even_segments(r.op.count, r.es, r.n);
  // One rank on the node, pairwise: no local pass (pairwise_all_reduce).
  const bool one_rank = r.L.size() == 1 && r.algorithm == A::pairwise && segs[r.me].size() <= 1;
  // One rank, ring: its input is reduced where it is (ring_reduce_scatter).
  const bool ring_one = r.L.size() == 1 && r.algorithm == A::ring;
  if (!one_rank && !ring_one) {
    // The direct one reads the whole input here, in whatever pieces it
    // arrives (reads_input_in_pieces).
    if (r.in_pieces) r.ch.reading(r.L[0].send, r.one);
    r.local_reduce(w, r.one);
  }
  r.algo.tell_final(r.tell);
  switch (r.algorithm) {
    case A::none: break;
    case A::recursive_doubling:
      recursive_doubling_all_reduce(r.algo, w, r.one, r.op.dtype, r.combine, 1);
      break;
    case A::direct: direct_all_reduce(r.algo, w, r.one, r.op.dtype, r.combine, 1); break;
    case A::pairwise: pairwise_all_reduce(r, w, segs, one_rank); break;
    case A::ring:
      ring_reduce_scatter(r.algo, w, segs, r.op.dtype, r.combine, 1,
                          ring_one ? r.L[0].send : nullptr);
      ring_all_gather(r.algo, w, segs, 2);
      break;
    default: break;  // not an all-reduce's (serves)
  }
  if (r.op.redop == RedOp::avg) r.ch.flush();  // `w` went out in place; divided next
  r.finish_avg(w, r.one);
  r.copy_to_others(w, r.one);
}

/// An all-gather's own input into its place in the output, and told final.
void copy_own(Run& r, std::byte* w) {
  if (r.in_pieces) r.ch.reading(r.L[0].send, r.one);
  r.pass(r.one * r.L.size(), [&] {
    for (const auto& b : r.L) copy_bytes(w + b.rank * r.one, b.send, r.one);
  });
  if (r.tell) r.ch.written(w + r.L[0].rank * r.one, r.one);
}

/// One rank, pairwise: its input goes out from where it is, and its copy
/// into the output overlaps the exchange.
void pairwise_all_gather_one_rank(Run& r, std::byte* w, const std::vector<Segment>& segs) {
  pairwise_all_gather_send(r.algo, w, segs, 1, r.L[0].send);
  const std::uint64_t one = r.one;
  if (r.ch.parallelism() <= 1 || one < kOwnCopyAsyncBytes || r.L[0].send == w + r.L[0].rank * one) {
    r.ch.start_sends();
    copy_own(r, w);
    pairwise_all_gather_recv(r.algo, w, segs, 1);
    return;
  }
  // On the pool: the thread that runs this serves the peers too (reads their
  // frames, places their chunks), and a copy here holds it while the other
  // node's chunks wait. Handed to the pool before the sends leave, so that a
  // worker wakes and copies while the event loop writes the sends to the
  // sockets; handed over after them, the copy ended on the operation's path
  // (docs/architecture.md).
  if (r.in_pieces) r.ch.reading(r.L[0].send, one);  // in already: the sends read it
  std::byte* own_dst = w + r.L[0].rank * one;
  const std::byte* own_src = r.L[0].send;
  PendingPass own{
      r.ch, r.ch.compute_async([own_dst, own_src, one] { copy_bytes(own_dst, own_src, one); })};
  r.ch.start_sends();
  auto finish_own = [&] {
    own.wait();
    if (r.tell) r.ch.written(own_dst, one);
  };
  pairwise_all_gather_recv(r.algo, w, segs, 1, [&] {
    if (own.ticket && r.ch.compute_done(own.ticket)) finish_own();
  });
  if (own.ticket) finish_own();
}

void run_all_gather(Run& r) {
  using A = NodeAlgorithm;
  std::byte* w = r.L[0].recv;
  const auto segs = rank_segments(r.op.node_of_rank, r.one, r.n);
  r.algo.tell_final(r.tell);
  if (r.L.size() == 1 && r.algorithm == A::ring) {
    // One rank: its input goes to the right from where it is, and its
    // copy into the output follows that send (not before it).
    ring_all_gather_send(r.algo, w, segs, 1, r.L[0].send);
    r.ch.start_sends();
    copy_own(r, w);
    ring_all_gather_recv(r.algo, w, segs, 1);
    return;
  }
  if (r.L.size() == 1 && r.algorithm == A::pairwise) {
    pairwise_all_gather_one_rank(r, w, segs);
    return;
  }
  copy_own(r, w);
  switch (r.algorithm) {
    case A::direct: direct_all_gather(r.algo, w, segs, 1); break;
    case A::pairwise: pairwise_all_gather(r.algo, w, segs, 1); break;
    case A::ring: ring_all_gather(r.algo, w, segs, 1); break;
    default: break;  // none: this node's ranks are all
  }
  r.copy_to_others(w, r.one * r.op.nranks);
}

void run_reduce_scatter(Run& r) {
  const std::uint64_t one = r.one;
  const std::uint64_t total = one * r.op.nranks;
  if (r.op.own_contribution_elsewhere &&
      (r.L.size() != 1 || !reduce_scatter_own_elsewhere(r.n, r.options))) {
    throw Error(Code::invalid_argument,
                "a reduce-scatter leaving its own contribution to the client takes one rank "
                "per node, two nodes and the pairwise algorithm; here node " +
                    std::to_string(r.me) + " of " + std::to_string(r.n) + " has " +
                    std::to_string(r.L.size()) + " ranks, collectives.algorithm " +
                    std::string(to_string(r.options.algorithm)));
  }
  using A = NodeAlgorithm;
  const auto segs = [&] { return rank_segments(r.op.node_of_rank, one, r.n); };
  const bool pairwise = r.algorithm == A::pairwise;
  if (r.L.size() == 1 && pairwise) {
    // One rank: its input is read in place and its segment reduced
    // straight into its output (no scratch, no copies). Its own
    // contribution left out: the other node's, as it came (the client
    // combines them on the GPU, and divides avg).
    r.algo.tell_final(r.tell);
    pairwise_reduce_scatter(r.algo, r.L[0].send, segs(), r.op.dtype, r.combine, 1, r.L[0].recv, 0,
                            true, r.op.own_contribution_elsewhere);
    if (!r.op.own_contribution_elsewhere) r.finish_avg(r.L[0].recv, one);
    return;
  }
  std::byte* t = r.ch.scratch(total);
  if (pairwise) {
    r.local_reduce(t, total);
    pairwise_reduce_scatter(r.algo, t, segs(), r.op.dtype, r.combine, 1);
  } else if (r.L.size() == 1 && r.algorithm == A::ring) {
    // One rank: its input is reduced where it is (no copy into `t`
    // first), and its segment straight into its output (no copy after).
    r.algo.tell_final(r.tell);
    ring_reduce_scatter(r.algo, t, segs(), r.op.dtype, r.combine, 1, r.L[0].send, r.L[0].recv);
    r.finish_avg(r.L[0].recv, one);
    return;
  } else {
    r.local_reduce(t, total);
    if (r.algorithm == A::ring) ring_reduce_scatter(r.algo, t, segs(), r.op.dtype, r.combine, 1);
  }
  r.pass(one * r.L.size(), [&] {
    for (const auto& b : r.L) copy_bytes(b.recv, t + b.rank * one, one);
  });
  for (const auto& b : r.L) r.finish_avg(b.recv, one);
}

void run_broadcast(Run& r) {
  const int root_node = r.op.node_of_rank[r.op.root];
  std::byte* src = nullptr;
  if (root_node == r.me) {
    for (const auto& b : r.L) {
      if (b.rank == r.op.root) src = b.send;
    }
  } else {
    src = r.L[0].recv;
  }
  r.algo.tell_final(r.tell && root_node != r.me);  // the root node only sends
  switch (r.algorithm) {
    case NodeAlgorithm::none: break;
    case NodeAlgorithm::tree: tree_broadcast(r.algo, src, r.one, root_node, 1); break;
    case NodeAlgorithm::direct: direct_broadcast(r.algo, src, r.one, root_node, 1); break;
    case NodeAlgorithm::chain: chain_broadcast(r.algo, src, r.one, root_node, 1); break;
    default: break;  // not a broadcast's (serves)
  }
  r.pass(r.one * r.L.size(), [&] {
    for (const auto& b : r.L) copy_bytes(b.recv, src, r.one);
  });
}

void run_reduce(Run& r) {
  const int root_node = r.op.node_of_rank[r.op.root];
  std::byte* t = nullptr;
  if (root_node == r.me) {
    for (const auto& b : r.L) {
      if (b.rank == r.op.root) t = b.recv;
    }
  } else {
    t = r.ch.scratch(r.one);
  }
  r.local_reduce(t, r.one);
  r.algo.tell_final(r.tell && root_node == r.me);  // elsewhere `t` is scratch
  if (r.algorithm == NodeAlgorithm::tree) {
    tree_reduce(r.algo, t, r.one, root_node, r.op.dtype, r.combine, 1);
  } else if (r.algorithm == NodeAlgorithm::chain) {
    chain_reduce(r.algo, t, r.one, root_node, r.op.dtype, r.combine, 1);
  }
  if (root_node == r.me) r.finish_avg(t, r.one);
}

void run_node_collective_unflushed(NodeChannel& ch, const NodeCollective& op, NodeAlgorithm a,
                                   const NodeAlgorithmOptions& options, std::uint64_t base) {
  if (op.local.empty()) throw Error(Code::internal, "a node collective without local ranks");
  if (op.own_contribution_elsewhere && op.kind != OpKind::reduce_scatter) {
    throw Error(Code::invalid_argument,
                "only a reduce-scatter leaves its own contribution to the client");
  }
  // A plan that names no algorithm of this kind: a bug, failed at once.
  if (!serves(a, op.kind)) {
    throw Error(Code::internal, "no " + std::string(to_string(a)) + " algorithm for " +
                                    std::string(to_string(op.kind)) + " between nodes");
  }
  Run r(ch, op, a, options, base);
  // An operation of zero bytes still meets every other node once, so that a
  // node whose ranks disagree (a non-zero count, another operation) is told.
  if (r.one == 0 && op.kind != OpKind::barrier) {
    node_exchange(ch, {}, tag_of(base, 15, 0, 0));
    return;
  }
  switch (op.kind) {
    case OpKind::barrier: node_exchange(ch, {}, tag_of(base, 15, 0, 0)); return;
    case OpKind::all_reduce: run_all_reduce(r); return;
    case OpKind::all_gather: run_all_gather(r); return;
    case OpKind::reduce_scatter: run_reduce_scatter(r); return;
    case OpKind::broadcast: run_broadcast(r); return;
    case OpKind::reduce: run_reduce(r); return;
    case OpKind::all_to_all: exchange_all_to_all(r.algo, op, r.one); return;
    default:
      throw Error(Code::internal, "no node algorithm for " + std::string(to_string(op.kind)));
  }
}

}  // namespace

void run_node_collective(NodeChannel& ch, const NodeCollective& op, const NodePlan& plan,
                         const NodeAlgorithmOptions& options, std::uint64_t base) {
  run_node_collective_unflushed(ch, op, plan.algorithm, options, base);
  // Sends read the ranks' buffers in place: the operation is complete (and
  // the buffers are the clients' again) only once every send has left.
  ch.flush();
}

void run_node_collective(NodeChannel& ch, const NodeCollective& op,
                         const NodeAlgorithmOptions& options, std::uint64_t base) {
  const NodePlan plan = node_plan(op.kind, op.count, op.dtype, op.nranks, ch.nodes(), options);
  run_node_collective(ch, op, plan, options, base);
}

}  // namespace collectived::engine
