#include "engine/algorithms/pairwise.h"

#include <deque>
#include <memory>

#include "engine/algorithms/passes.h"

namespace collectived::engine::algorithms {

namespace {

/// The smallest part of a one-chunk reduction that goes to the worker pool
/// (OwnSegment::reduce_split): below it the hand-off costs more than the
/// part's pass, since waking a sleeping worker costs tens of microseconds on
/// a virtual machine (docs/architecture.md, "Communicators across nodes").
constexpr std::uint64_t kSplitReduceBytes = std::uint64_t{512} << 10;

/// Its own contribution left out over two nodes: the other node's chunks are
/// the output as they come, received straight into it where the transport
/// places them (posted before this node's sends go out).
void post_into_output(Context& c, std::byte* own_out, std::uint64_t total, std::uint64_t phase) {
  const int j = c.mod(c.i() + 1);
  for (std::uint64_t k = 0; k < c.chunks(total); ++k) {
    const Context::ChunkSpan span = c.chunk_span(total, k);
    c.ch().post(j, c.tag(phase, static_cast<std::uint64_t>(j), k),
                {own_out + span.from, span.to - span.from});
  }
}

/// Reduces bytes [from, to) of this node's segment, of the chunk that starts
/// at `first` (in[j] holds node j's bytes of the whole chunk), over all nodes
/// in node order, into `own_out` or in place. A value: each pass on the
/// worker pool holds its own copy.
struct PartReducer {
  int n, i;
  std::byte* buf;
  const Segment* mine;
  DType dtype;
  RedOp op;
  std::byte* own_out;
  bool skip_own;

  void operator()(const std::vector<NodePayload>& in, std::uint64_t first, std::uint64_t from,
                  std::uint64_t to) const {
    std::vector<const void*> srcs;
    for_pieces(buf, *mine, from, to, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
      srcs.clear();
      for (int j = 0; j < n; ++j) {
        if (j == i && skip_own) continue;
        srcs.push_back(j == i ? static_cast<const void*>(p) : in[j].data() + (from - first) + off);
      }
      std::byte* dst = own_out != nullptr ? own_out + from + off : p;
      if (srcs.size() == 1 && srcs[0] == dst) return;  // received in place (post_into_output)
      reduce(dtype, op, dst, srcs.data(), srcs.size(), len / dtype_size(dtype), 1);
    });
  }
};

/// This node's segment of a pairwise reduce-scatter: each chunk's
/// reduction (reduce_split, or whole on the pool) and what follows it
/// (gather).
class OwnSegment {
 public:
  OwnSegment(Context& c, const PartReducer& part, std::uint64_t gather_phase)
      : c_(c), part_(part), gather_phase_(gather_phase) {}

  const PartReducer& part() const { return part_; }

  /// A segment of one chunk has nothing to overlap its reduction with:
  /// handed to the pool whole, the hand-off and back only add their latency.
  /// Cut in parts reduced at once, on this thread and on the pool, it takes
  /// what one core's memory bandwidth allows over a part. Parts are at least
  /// kSplitReduceBytes: smaller ones wait longer for a worker than they take.
  void reduce_split(const std::shared_ptr<std::vector<NodePayload>>& in, std::uint64_t from,
                    std::uint64_t to) const {
    const std::uint64_t parts = std::min<std::uint64_t>(
        static_cast<std::uint64_t>(c_.ch().parallelism()), (to - from) / kSplitReduceBytes);
    if (parts <= 1) {
      part_(*in, from, from, to);
      return;
    }
    // Whole cache lines (64 bytes: whole elements of every type).
    const std::uint64_t step = ((to - from) / parts + 63) / 64 * 64;
    std::deque<PendingPass> others;
    for (std::uint64_t a = from + step; a < to; a += step) {
      const std::uint64_t b = std::min(to, a + step);
      others.emplace_back(c_.ch(), c_.ch().compute_async(
                                       [part = part_, in, from, a, b] { part(*in, from, a, b); }));
    }
    part_(*in, from, from, std::min(to, from + step));
    for (auto& o : others) o.wait();
  }

  /// Chunk k, bytes [from, to), is reduced: told final, and with a
  /// gather phase sent to every other node at once.
  void gather(std::uint64_t k, std::uint64_t from, std::uint64_t to) {
    if (part_.own_out != nullptr) {
      c_.final(part_.own_out + from, to - from);
    } else {
      for_pieces(part_.buf, *part_.mine, from, to,
                 [&](std::byte* p, std::uint64_t, std::uint64_t len) { c_.final(p, len); });
    }
    if (gather_phase_ == 0) return;
    std::vector<std::span<const std::byte>> pieces;
    if (part_.own_out != nullptr) {
      pieces.emplace_back(part_.own_out + from, to - from);
    } else {
      pieces = pieces_of(part_.buf, *part_.mine, from, to);
    }
    for (int j = 1; j < c_.n(); ++j) {
      c_.ch().send(c_.mod(c_.i() + j), c_.tag(gather_phase_, 0, k), pieces, nullptr);
    }
  }

 private:
  Context& c_;
  PartReducer part_;
  std::uint64_t gather_phase_;
};

/// The reductions running on the worker pool, oldest first, so that gathers
/// go out in chunk order. Should the operation fail, the passes still
/// running are waited for as this goes (no reduction may write into the
/// ranks' buffers after the operation).
class RunningChunks {
 public:
  explicit RunningChunks(OwnSegment& own) : own_(own) {}
  std::size_t size() const { return running_.size(); }
  void start(NodeChannel& ch, const std::shared_ptr<std::vector<NodePayload>>& in, std::uint64_t k,
             std::uint64_t from, std::uint64_t to) {
    running_.emplace_back(
        ch, ch.compute_async([part = own_.part(), in, from, to] { part(*in, from, from, to); }), k,
        from, to);
  }
  void finish_oldest() {
    Running& r = running_.front();
    r.pass.wait();
    own_.gather(r.k, r.from, r.to);
    running_.pop_front();
  }

 private:
  struct Running {
    Running(NodeChannel& ch, NodeChannel::Ticket t, std::uint64_t chunk, std::uint64_t a,
            std::uint64_t b)
        : pass(ch, std::move(t)), k(chunk), from(a), to(b) {}
    PendingPass pass;
    std::uint64_t k, from, to;
  };
  OwnSegment& own_;
  std::deque<Running> running_;
};

}  // namespace

void pairwise_reduce_scatter(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                             DType dtype, RedOp op, std::uint64_t phase, std::byte* own_out,
                             std::uint64_t gather_phase, bool flush, bool skip_own) {
  const int n = c.n(), i = c.i();
  if (n == 1) return;
  NodeChannel& ch = c.ch();
  const Segment& mine = segs[i];
  const std::uint64_t total = segment_bytes(mine);
  if (skip_own && own_out != nullptr && n == 2 && c.posted(total))
    post_into_output(c, own_out, total, phase);
  // Start with the next node, so that the nodes do not all send to node 0 first.
  for (int k = 1; k < n; ++k) {
    const int j = c.mod(i + k);
    c.send_segment(j, buf, segs[j], phase, static_cast<std::uint64_t>(i));
  }
  // Each chunk's reduction, over all nodes in node order, into `own_out`
  // or in place. Where the machine has cores to spare (parallelism() > 1),
  // up to that many run at once on the worker pool while the next chunks
  // come in: one thread reducing every byte, at a few GB/s, keeps the
  // transfers waiting. A segment of one chunk is cut in parts instead
  // (OwnSegment::reduce_split).
  OwnSegment own(c, PartReducer{n, i, buf, &mine, dtype, op, own_out, skip_own}, gather_phase);
  const int window = c.chunks(total) > 1 ? ch.parallelism() : 1;
  RunningChunks running(own);
  for (std::uint64_t k = 0; k < c.chunks(total); ++k) {
    // Plain copies: the pass captures them (clang does not capture
    // structured bindings).
    const Context::ChunkSpan span = c.chunk_span(total, k);
    const std::uint64_t from = span.from, to = span.to;
    auto in = std::make_shared<std::vector<NodePayload>>(n);
    for (int j = 0; j < n; ++j) {
      if (j == i) continue;
      (*in)[j] = ch.recv(j, c.tag(phase, static_cast<std::uint64_t>(j), k));
      expect_size((*in)[j], to - from, j);
    }
    if (!skip_own) c.need(buf, mine, from, to);  // this node's own contribution to the chunk
    if (window <= 1) {
      own.reduce_split(in, from, to);
      own.gather(k, from, to);
      continue;
    }
    running.start(ch, in, k, from, to);
    while (static_cast<int>(running.size()) >= window) running.finish_oldest();
  }
  while (running.size() != 0) running.finish_oldest();
  // The other segments went out in place; the caller overwrites them next.
  if (flush) ch.flush();
}

void pairwise_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                         std::uint64_t phase) {
  pairwise_all_gather_send(c, buf, segs, phase);
  pairwise_all_gather_recv(c, buf, segs, phase);
}

void post_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                     std::uint64_t phase) {
  for (int k = 1; k < c.n(); ++k) {
    const int j = c.mod(c.i() - k);
    c.post_segment(j, buf, segs[j], phase, 0);
  }
}

void pairwise_all_gather_send(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                              std::uint64_t phase, std::byte* own_src) {
  const int n = c.n(), i = c.i();
  if (n == 1) return;
  post_all_gather(c, buf, segs, phase);
  for (int k = 1; k < n; ++k) {
    const int j = c.mod(i - k);
    if (c.all_gather_waits(segment_bytes(segs[j]))) c.tell_ready(j, phase);
  }
  const bool wait = c.all_gather_waits(segment_bytes(segs[i]));
  Segment from_src{Range{0, segment_bytes(segs[i])}};
  for (int k = 1; k < n; ++k) {
    if (wait) c.await_ready(c.mod(i + k), phase);
    if (own_src != nullptr) {
      c.send_segment(c.mod(i + k), own_src, from_src, phase, 0);
    } else {
      c.send_segment(c.mod(i + k), buf, segs[i], phase, 0);
    }
  }
}

void pairwise_all_gather_recv(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                              std::uint64_t phase, const std::function<void()>& between) {
  const int n = c.n(), i = c.i();
  if (n == 1) return;
  for (int k = 1; k < n; ++k) {
    const int j = c.mod(i - k);  // the node that sent to us first
    const std::uint64_t total = segment_bytes(segs[j]);
    for (std::uint64_t ck = 0; ck < c.chunks(total); ++ck) {
      const auto [from, to] = c.chunk_span(total, ck);
      NodePayload m = c.ch().recv(j, c.tag(phase, 0, ck));
      expect_size(m, to - from, j);
      // Nothing to copy where the transport placed it (post_all_gather).
      for_pieces(buf, segs[j], from, to, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
        copy_bytes(p, m.data() + off, len);
        c.final(p, len);
      });
      if (between) between();
    }
  }
}

}  // namespace collectived::engine::algorithms
