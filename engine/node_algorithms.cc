#include "engine/node_algorithms.h"

#include <algorithm>
#include <cstring>
#include <deque>

#include "engine/reduce.h"
#include "ipc/error.h"

namespace collectived::engine {

namespace {

/// A byte range of a buffer.
struct Range {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};
/// What one node owns of a buffer: ranges in order, read as one concatenation.
using Segment = std::vector<Range>;

std::uint64_t segment_bytes(const Segment& s) {
  std::uint64_t n = 0;
  for (const auto& r : s) n += r.bytes;
  return n;
}

/// Calls fn(pointer into buf, offset within [from, to), length) for the bytes
/// [from, to) of the concatenation of `seg`.
template <typename Fn>
void for_pieces(std::byte* buf, const Segment& seg, std::uint64_t from, std::uint64_t to, Fn&& fn) {
  std::uint64_t pos = 0;
  for (const auto& r : seg) {
    const std::uint64_t a = std::max(from, pos);
    const std::uint64_t b = std::min(to, pos + r.bytes);
    if (a < b) fn(buf + r.offset + (a - pos), a - from, b - a);
    pos += r.bytes;
    if (pos >= to) break;
  }
}

std::vector<std::span<const std::byte>> pieces_of(std::byte* buf, const Segment& seg,
                                                  std::uint64_t from, std::uint64_t to) {
  std::vector<std::span<const std::byte>> out;
  for_pieces(buf, seg, from, to, [&](std::byte* p, std::uint64_t, std::uint64_t len) {
    out.emplace_back(p, len);
  });
  return out;
}

// Tags: [phase:8][step:16][chunk:24] above the operation's base. Step
// kReadyStep of a phase is its ready-to-receive messages (Algorithms::tell_ready).
constexpr std::uint64_t kReadyStep = 0xFFFF;
std::uint64_t tag_of(std::uint64_t base, std::uint64_t phase, std::uint64_t step,
                     std::uint64_t chunk) {
  return base + (phase << 40) + (step << 24) + chunk;
}

void expect_size(const NodePayload& m, std::uint64_t want, int from) {
  if (m.size != want) {
    throw Error(Code::mismatch, "node " + std::to_string(from) + " sent " +
                                    std::to_string(m.size) + " bytes where " +
                                    std::to_string(want) + " were expected");
  }
}

void reduce2(DType dtype, RedOp op, std::byte* dst, const std::byte* incoming, std::uint64_t bytes) {
  const void* srcs[2] = {incoming, dst};
  reduce(dtype, op, dst, srcs, 2, bytes / dtype_size(dtype), 1);
}

void copy_bytes(std::byte* dst, const std::byte* src, std::uint64_t bytes) {
  if (bytes != 0 && dst != src) std::memmove(dst, src, bytes);
}

/// A pass started with NodeChannel::compute_async: waited for at the latest
/// when this goes (an operation that fails meanwhile), since the pass writes
/// into the ranks' buffers; wait() rethrows what it threw, the destructor
/// swallows it (the operation's own error is the one to report).
struct PendingPass {
  PendingPass(NodeChannel& c, NodeChannel::Ticket t) : ch(c), ticket(std::move(t)) {}
  PendingPass(const PendingPass&) = delete;
  PendingPass& operator=(const PendingPass&) = delete;
  void wait() {
    auto t = std::move(ticket);
    ticket = nullptr;
    ch.compute_wait(t);
  }
  ~PendingPass() {
    if (!ticket) return;
    try {
      ch.compute_wait(ticket);
    } catch (...) {
    }
  }
  NodeChannel& ch;
  NodeChannel::Ticket ticket;
};

/// Passes over whole buffers from this size on run through NodeChannel::compute.
/// Below it the hand-off each way costs more than the pass (a 1 MiB all-reduce
/// on 4 daemons took 40 % longer), and 8 MiB take a few ms on the event loop, well
/// within heartbeats.
constexpr std::uint64_t kOffloadBytes = std::uint64_t{8} << 20;
/// The smallest input whose copy into its own place in the output runs on the
/// worker pool beside a one-rank pairwise all-gather's exchange (where cores
/// are spare), not on the thread that serves the peers.
constexpr std::uint64_t kOwnCopyAsyncBytes = std::uint64_t{256} << 10;
/// The smallest part of a one-chunk reduction that goes to the worker pool
/// (Algorithms::pairwise_reduce_scatter): below it the hand-off costs more
/// than the part's pass, since waking a sleeping worker costs tens of
/// microseconds on a virtual machine; smaller parts made 512 KiB and 1 MiB
/// reduce-scatters slower (docs/architecture.md, "Communicators across nodes").
constexpr std::uint64_t kSplitReduceBytes = std::uint64_t{512} << 10;
/// The smallest segment whose pairwise all-gather waits for ready to receive
/// (Algorithms::all_gather_waits), and the smallest broadcast whose chain does
/// (Algorithms::broadcast_waits).
constexpr std::uint64_t kAllGatherReadyBytes = std::uint64_t{512} << 10;
/// The ring all-gather moves chunks this many times tcp.chunk_bytes (8 MiB by
/// default; transfer_chunk: a segment below two of them goes whole). Each
/// chunk is received, then forwarded by the fiber: fewer, larger ones cost
/// fewer wake-ups, and an all-gather's ring gains nothing from finer ones
/// (each node forwards what it has; the bytes per link are the same): at
/// 8-64 MiB, 1 MiB chunks were 0.91-1.08x of Gloo's ring, 8 MiB 1.00-1.40x.
constexpr std::size_t kRingAllGatherChunks = 8;
/// From this many bytes of output per node, an all-gather over three or more
/// nodes takes the ring instead of the pairwise exchange (all_gather_kind).
/// Pairwise keeps every link of a node busy at once, which small transfers
/// need; for large ones the N-1 streams per node at once cost more than they
/// give (a real network adds the incast of N-1 senders on each receiver).
/// With one TCP stream per peer the ring is ahead from 2 MiB per node
/// (docs/architecture.md, "Communicators across nodes").
constexpr std::uint64_t kRingAllGatherMinBytes = std::uint64_t{2} << 20;

class Algorithms {
 public:
  Algorithms(NodeChannel& ch, const NodeAlgorithmOptions& o, std::uint64_t base)
      : ch_(ch), n_(ch.nodes()), i_(ch.node()), chunk_(std::max<std::size_t>(o.chunk_bytes, 64) & ~std::size_t{63}),
        base_(base) {}

  int mod(long x) const { return static_cast<int>(((x % n_) + n_) % n_); }
  /// Whether the buffers the next calls write are the node's one rank's
  /// output with nothing written after them (NodeChannel::written): each
  /// chunk is told as it becomes final.
  void tell_final(bool on) { tell_ = on; }
  void final(const std::byte* p, std::uint64_t len) {
    if (tell_ && len != 0) ch_.written(p, len);
  }
  /// Whether the input is read in pieces (reads_input_in_pieces): every read
  /// of it waits for its bytes first (NodeChannel::reading).
  void guard_input(bool on) { guard_ = on; }
  void need(const std::byte* p, std::uint64_t len) {
    if (guard_ && len != 0) ch_.reading(p, len);
  }
  void need(std::byte* buf, const Segment& seg, std::uint64_t from, std::uint64_t to) {
    if (!guard_) return;
    for_pieces(buf, seg, from, to, [&](std::byte* p, std::uint64_t, std::uint64_t len) { need(p, len); });
  }
  /// The chunk of a transfer of `total` bytes (transfer_chunk): both ends
  /// compute it from the same segment or buffer.
  std::uint64_t chunk_of(std::uint64_t total) const { return transfer_chunk(total, chunk_); }
  std::uint64_t chunks(std::uint64_t bytes) const {
    const std::uint64_t ck = chunk_of(bytes);
    return (bytes + ck - 1) / ck;
  }
  /// Bytes [from, to) of chunk c of a transfer of `total` bytes.
  struct ChunkSpan {
    std::uint64_t from, to;
  };
  ChunkSpan chunk_span(std::uint64_t total, std::uint64_t c) const {
    const std::uint64_t ck = chunk_of(total);
    const std::uint64_t from = std::min(total, c * ck);
    return {from, std::min(total, from + ck)};
  }

  /// Whether the receiver of the messages of a segment (or chain) of `bytes`
  /// posts buffers for them: their first chunk is large enough to be placed
  /// (kPlaceMinBytes). Sender and receiver compute the same answer.
  bool posted(std::uint64_t bytes) const {
    return std::min<std::uint64_t>(bytes, chunk_of(bytes)) >= kPlaceMinBytes;
  }
  /// Ready to receive: where a receiver posts buffers for a sender's
  /// messages (NodeChannel::post), it says so with an empty message once
  /// they are posted, and the sender waits for that before it sends them.
  /// Without it, a node that runs ahead (a broadcast's root, the first node
  /// into a pairwise all-gather) sends before the receiver's operation has
  /// started: the bytes land in a fresh buffer (new pages, each faulted in)
  /// and are copied into place later (a 4 MiB broadcast on 4 daemons took
  /// 2-3x as long). The wait costs a one-way latency where the receiver is late,
  /// and nothing where it posted first (the usual case after the root). The
  /// message carries the operation's description like any other, so a
  /// mismatched operation is still named at once.
  void tell_ready(int to, std::uint64_t phase) {
    ch_.send(to, tag_of(base_, phase, kReadyStep, 0), nullptr, 0);
  }
  void await_ready(int from, std::uint64_t phase) {
    expect_size(ch_.recv(from, tag_of(base_, phase, kReadyStep, 0)), 0, from);
  }
  /// Whether a pairwise all-gather's sender waits for the receiver's ready
  /// message before it sends a segment of `bytes`: only from
  /// kAllGatherReadyBytes. Below, the bytes of every node are in flight at
  /// once, and a late receiver copies a message that landed early (from
  /// malloc's heap, which the daemon keeps: mostly warm pages) in less time
  /// than the round trip the wait costs; from 512 KiB segments the wait pays
  /// (docs/architecture.md, "Ready to receive"). Broadcast: broadcast_waits.
  bool all_gather_waits(std::uint64_t bytes) const {
    return posted(bytes) && bytes >= kAllGatherReadyBytes;
  }
  /// Whether a chain broadcast's sender waits for its next node's ready
  /// message: from kAllGatherReadyBytes too. The root runs ahead of the
  /// others, whose previous operation ends after its; below that size the
  /// wait's one-way trip costs more than the copy of an early message
  /// saves, and above it less (docs/architecture.md, "Ready to receive").
  bool broadcast_waits(std::uint64_t bytes) const {
    return posted(bytes) && bytes >= kAllGatherReadyBytes;
  }

  /// Ring reduce-scatter: afterwards node j's segment of `buf` holds the
  /// reduction over all nodes. Step s: node i sends segment i-s-1 to the right
  /// and reduces segment i-s-2 from the left into its own copy, then forwards
  /// that chunk at step s+1.
  /// With `in` (the input, laid out as `buf`), the first step sends from it
  /// and every step reduces it with what came into `buf`: out of place with
  /// one rank on the node, no pass copies the input into `buf` first (that
  /// copy was a whole extra read and write of the buffer).
  /// With `own_out`, the last step reduces this node's own segment there
  /// (its bytes in segment order) instead of into `buf`.
  void ring_reduce_scatter(std::byte* buf, const std::vector<Segment>& segs, DType dtype,
                           RedOp op, std::uint64_t phase, const std::byte* in = nullptr,
                           std::byte* own_out = nullptr) {
    if (n_ == 1) return;
    const int right = mod(i_ + 1), left = mod(i_ - 1);
    send_segment(right, in != nullptr ? const_cast<std::byte*>(in) : buf, segs[mod(i_ - 1)], phase, 0);
    for (int s = 0; s + 1 < n_; ++s) {
      const Segment& seg = segs[mod(i_ - s - 2)];
      const std::uint64_t total = segment_bytes(seg);
      for (std::uint64_t c = 0; c < chunks(total); ++c) {
        const auto [from, to] = chunk_span(total, c);
        NodePayload m = ch_.recv(left, tag_of(base_, phase, s, c));
        expect_size(m, to - from, left);
        const bool last = s + 2 == n_;  // the last step reduces this node's own segment
        const std::uint64_t at = from;  // a copy: clang before 16 does not capture structured bindings
        for_pieces(buf, seg, from, to, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
          std::byte* dst = last && own_out != nullptr ? own_out + at + off : p;
          if (len != 0) {
            // reduce2's order: what came in, then this node's value.
            const void* srcs[2] = {m.data() + off, in != nullptr ? in + (p - buf) : p};
            reduce(dtype, op, dst, srcs, 2, len / dtype_size(dtype), 1);
          }
          if (last) final(dst, len);
        });
        if (s + 2 < n_) {
          const auto pieces = pieces_of(buf, seg, from, to);
          ch_.send(right, tag_of(base_, phase, s + 1, c), pieces, nullptr);
        }
      }
    }
    // What was sent is read in place; the caller may overwrite it next (the
    // all-gather receives into the segments sent here).
    ch_.flush();
  }

  /// Ring all-gather: node i's own segment is in `buf`; afterwards every
  /// segment is. Each chunk is forwarded as soon as it arrives. The receives
  /// are posted where each chunk goes (post_ring_all_gather), so the
  /// transport reads them straight into place, and forwarded from there:
  /// with each chunk received into a buffer of its own, copied into place and
  /// forwarded from the copy, the copy and the fresh buffers made the ring
  /// 1.3-1.8x slower than pairwise.
  void ring_all_gather(std::byte* buf, const std::vector<Segment>& segs, std::uint64_t phase) {
    ring_all_gather_send(buf, segs, phase);
    ring_all_gather_recv(buf, segs, phase);
  }
  /// Its start: posts the receives and sends this node's segment. `own_src`
  /// (optional): the segment is read from there (one contiguous range)
  /// instead of from `buf`, which the caller may fill meanwhile.
  void ring_all_gather_send(std::byte* buf, const std::vector<Segment>& segs, std::uint64_t phase,
                            std::byte* own_src = nullptr) {
    if (n_ == 1) return;
    const int right = mod(i_ + 1), left = mod(i_ - 1);
    const ScaledChunk larger(*this, kRingAllGatherChunks);
    post_ring_all_gather(buf, segs, phase, left);
    // Ready to receive as in the pairwise all-gather: the left node's first
    // send is its own segment, at once; forwarded chunks follow receipts, by
    // which time the right node has posted.
    if (all_gather_waits(segment_bytes(segs[left]))) tell_ready(left, phase);
    if (all_gather_waits(segment_bytes(segs[i_]))) await_ready(right, phase);
    if (own_src != nullptr) {
      send_segment(right, own_src, Segment{Range{0, segment_bytes(segs[i_])}}, phase, 0);
    } else {
      send_segment(right, buf, segs[i_], phase, 0);
    }
  }
  /// The rest: every other node's segment, received into `buf` and forwarded.
  void ring_all_gather_recv(std::byte* buf, const std::vector<Segment>& segs, std::uint64_t phase) {
    if (n_ == 1) return;
    const int right = mod(i_ + 1), left = mod(i_ - 1);
    const ScaledChunk larger(*this, kRingAllGatherChunks);
    for (int s = 0; s + 1 < n_; ++s) {
      const Segment& seg = segs[mod(i_ - s - 1)];
      const std::uint64_t total = segment_bytes(seg);
      for (std::uint64_t c = 0; c < chunks(total); ++c) {
        const auto [from, to] = chunk_span(total, c);
        NodePayload m = ch_.recv(left, tag_of(base_, phase, s, c));
        expect_size(m, to - from, left);
        // Nothing to copy where the transport placed it.
        for_pieces(buf, seg, from, to, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
          copy_bytes(p, m.data() + off, len);
          final(p, len);
        });
        // Forwarded from its place in `buf`, final now and not written again.
        if (s + 2 < n_) {
          const auto pieces = pieces_of(buf, seg, from, to);
          ch_.send(right, tag_of(base_, phase, s + 1, c), pieces, nullptr);
        }
      }
    }
  }
  /// Offers `buf`'s segments of the other nodes to the channel for the ring
  /// all-gather's messages from `left` (step s carries node i-s-1's
  /// segment), chunk by chunk where a chunk is one contiguous range.
  void post_ring_all_gather(std::byte* buf, const std::vector<Segment>& segs, std::uint64_t phase,
                            int left) {
    for (int s = 0; s + 1 < n_; ++s) {
      const Segment& seg = segs[mod(i_ - s - 1)];
      if (posted(segment_bytes(seg))) post_segment(left, buf, seg, phase, s);
    }
  }

  /// Pairwise reduce-scatter: every node sends each other node that node's
  /// segment at once (in chunks), then reduces what it receives for its own
  /// segment, chunk by chunk, over all nodes in node order (deterministic).
  /// Each node sends (N-1)/N of the data, as in the ring, but in one step
  /// instead of N-1 store-and-forward steps.
  ///
  /// `own_out` (optional): where this node's reduced segment goes, as one
  /// contiguous range, instead of in place in `buf`; `buf` is then only read.
  /// With one rank on the node, `buf` is that rank's send buffer and
  /// `own_out` its output: no copy of the whole input before the exchange.
  ///
  /// `gather_phase` (optional, all-reduce): each reduced chunk of this node's
  /// segment goes out at once to every other node as chunk c of a pairwise
  /// all-gather in that phase (pairwise_all_gather_recv takes them), so the
  /// all-gather overlaps the reduce-scatter instead of following it.
  /// `flush`: wait for the sends before returning (the caller overwrites
  /// what they read); false where nothing they read is written next.
  /// `skip_own` (with `own_out`): this node's own contribution is left out
  /// (combined elsewhere, NodeCollective::own_contribution_elsewhere); its
  /// segment of `buf` is never read.
  void pairwise_reduce_scatter(std::byte* buf, const std::vector<Segment>& segs, DType dtype,
                               RedOp op, std::uint64_t phase, std::byte* own_out = nullptr,
                               std::uint64_t gather_phase = 0, bool flush = true,
                               bool skip_own = false) {
    if (n_ == 1) return;
    const Segment& mine = segs[i_];
    const std::uint64_t total = segment_bytes(mine);
    // Its own contribution left out over two nodes: the other node's chunks
    // are the output as they come, received straight into it where the
    // transport places them (posted before this node's sends go out).
    const bool place = skip_own && own_out != nullptr && n_ == 2 && posted(total);
    if (place) {
      const int j = mod(i_ + 1);
      for (std::uint64_t c = 0; c < chunks(total); ++c) {
        const ChunkSpan span = chunk_span(total, c);
        ch_.post(j, tag_of(base_, phase, static_cast<std::uint64_t>(j), c),
                 {own_out + span.from, span.to - span.from});
      }
    }
    // Start with the next node, so that the nodes do not all send to node 0 first.
    for (int k = 1; k < n_; ++k) {
      const int j = mod(i_ + k);
      send_segment(j, buf, segs[j], phase, static_cast<std::uint64_t>(i_));
    }
    // Each chunk's reduction, over all nodes in node order, into `own_out`
    // or in place. Where the machine has cores to spare (parallelism() > 1),
    // up to that many run at once on the worker pool while the next chunks
    // come in: one thread reducing every byte, at a few GB/s, keeps the
    // transfers waiting.
    // Bytes [from, to) of the chunk that starts at `first` (in[j] holds
    // node j's bytes of the whole chunk).
    auto reduce_part = [this, buf, &mine, dtype, op, own_out, skip_own](
                           const std::vector<NodePayload>& in, std::uint64_t first,
                           std::uint64_t from, std::uint64_t to) {
      std::vector<const void*> srcs;
      for_pieces(buf, mine, from, to, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
        srcs.clear();
        for (int j = 0; j < n_; ++j) {
          if (j == i_ && skip_own) continue;
          srcs.push_back(j == i_ ? static_cast<const void*>(p) : in[j].data() + (from - first) + off);
        }
        std::byte* dst = own_out != nullptr ? own_out + from + off : p;
        if (srcs.size() == 1 && srcs[0] == dst) return;  // received in place (`place` above)
        reduce(dtype, op, dst, srcs.data(), srcs.size(), len / dtype_size(dtype), 1);
      });
    };
    auto reduce_chunk = [reduce_part](std::vector<NodePayload>& in, std::uint64_t from, std::uint64_t to) {
      reduce_part(in, from, from, to);
    };
    // A segment of one chunk: its reduction cut in parts over the worker
    // pool, one part on this thread (where cores are spare; see below).
    auto reduce_split = [&](const std::shared_ptr<std::vector<NodePayload>>& in, std::uint64_t from,
                            std::uint64_t to) {
      const std::uint64_t parts =
          std::min<std::uint64_t>(static_cast<std::uint64_t>(ch_.parallelism()), (to - from) / kSplitReduceBytes);
      if (parts <= 1) {
        reduce_part(*in, from, from, to);
        return;
      }
      // Whole cache lines (64 bytes: whole elements of every type).
      const std::uint64_t step = ((to - from) / parts + 63) / 64 * 64;
      std::deque<PendingPass> others;
      for (std::uint64_t a = from + step; a < to; a += step) {
        const std::uint64_t b = std::min(to, a + step);
        others.emplace_back(ch_, ch_.compute_async([reduce_part, in, from, a, b] {
          reduce_part(*in, from, a, b);
        }));
      }
      reduce_part(*in, from, from, std::min(to, from + step));
      for (auto& o : others) o.wait();
    };
    auto gather = [&](std::uint64_t c, std::uint64_t from, std::uint64_t to) {
      if (own_out != nullptr) {
        final(own_out + from, to - from);
      } else {
        for_pieces(buf, mine, from, to, [&](std::byte* p, std::uint64_t, std::uint64_t len) { final(p, len); });
      }
      if (gather_phase == 0) return;
      std::vector<std::span<const std::byte>> pieces;
      if (own_out != nullptr) {
        pieces.emplace_back(own_out + from, to - from);
      } else {
        pieces = pieces_of(buf, mine, from, to);
      }
      for (int k = 1; k < n_; ++k) ch_.send(mod(i_ + k), tag_of(base_, gather_phase, 0, c), pieces, nullptr);
    };
    // A segment of one chunk has nothing to overlap its reduction with:
    // handed to the pool whole, the hand-off and back only add their latency.
    // Cut in parts reduced at once, on this thread and on the pool
    // (reduce_split), it takes what one core's memory bandwidth allows over a
    // part, where one thread takes ~100 us over a 512 KiB segment of staged
    // host memory while the exchange waits. Parts are at least
    // kSplitReduceBytes: smaller ones wait longer for a worker than they
    // take.
    const int window = chunks(total) > 1 ? ch_.parallelism() : 1;
    struct Running {
      Running(NodeChannel& ch, NodeChannel::Ticket t, std::uint64_t chunk, std::uint64_t a,
              std::uint64_t b)
          : pass(ch, std::move(t)), c(chunk), from(a), to(b) {}
      PendingPass pass;
      std::uint64_t c, from, to;
    };
    // Oldest first: gathers go out in chunk order. Should the operation
    // fail, the passes still running are waited for as `running` goes (no
    // reduction may write into the ranks' buffers after the operation).
    std::deque<Running> running;
    auto finish_oldest = [&] {
      Running& r = running.front();
      r.pass.wait();
      gather(r.c, r.from, r.to);
      running.pop_front();
    };
    for (std::uint64_t c = 0; c < chunks(total); ++c) {
      // Plain copies: the pass below captures them (clang does not capture
      // structured bindings).
      const ChunkSpan span = chunk_span(total, c);
      const std::uint64_t from = span.from, to = span.to;
      auto in = std::make_shared<std::vector<NodePayload>>(n_);
      for (int j = 0; j < n_; ++j) {
        if (j == i_) continue;
        (*in)[j] = ch_.recv(j, tag_of(base_, phase, static_cast<std::uint64_t>(j), c));
        expect_size((*in)[j], to - from, j);
      }
      if (!skip_own) need(buf, mine, from, to);  // this node's own contribution to the chunk
      if (window <= 1) {
        reduce_split(in, from, to);
        gather(c, from, to);
        continue;
      }
      running.emplace_back(ch_, ch_.compute_async([reduce_chunk, in, from, to]() mutable {
        reduce_chunk(*in, from, to);
      }),
                           c, from, to);
      while (static_cast<int>(running.size()) >= window) finish_oldest();
    }
    while (!running.empty()) finish_oldest();
    // The other segments went out in place; the caller overwrites them next.
    if (flush) ch_.flush();
  }

  /// Pairwise all-gather: every node sends its segment to every other one, in
  /// chunks, and copies in what it receives as it arrives.
  void pairwise_all_gather(std::byte* buf, const std::vector<Segment>& segs, std::uint64_t phase) {
    pairwise_all_gather_send(buf, segs, phase);
    pairwise_all_gather_recv(buf, segs, phase);
  }
  /// Offers `buf`'s segments of the other nodes to the channel, chunk by
  /// chunk (where a chunk is one contiguous range), for the all-gather
  /// messages of `phase`: the transport may read them straight into place.
  /// Nothing may read or write those segments until they are received.
  void post_all_gather(std::byte* buf, const std::vector<Segment>& segs, std::uint64_t phase) {
    for (int k = 1; k < n_; ++k) {
      const int j = mod(i_ - k);
      post_segment(j, buf, segs[j], phase, 0);
    }
  }
  /// Its sends (after posting its receives). `own_src` (optional): this
  /// node's segment is read from there (one contiguous range) instead of
  /// from `buf`, which it may fill meanwhile.
  void pairwise_all_gather_send(std::byte* buf, const std::vector<Segment>& segs,
                                std::uint64_t phase, std::byte* own_src = nullptr) {
    if (n_ == 1) return;
    post_all_gather(buf, segs, phase);
    for (int k = 1; k < n_; ++k) {
      const int j = mod(i_ - k);
      if (all_gather_waits(segment_bytes(segs[j]))) tell_ready(j, phase);
    }
    const bool wait = all_gather_waits(segment_bytes(segs[i_]));
    Segment from_src{Range{0, segment_bytes(segs[i_])}};
    for (int k = 1; k < n_; ++k) {
      if (wait) await_ready(mod(i_ + k), phase);
      if (own_src != nullptr) {
        send_segment(mod(i_ + k), own_src, from_src, phase, 0);
      } else {
        send_segment(mod(i_ + k), buf, segs[i_], phase, 0);
      }
    }
  }
  /// Its receives: every other node's segment into `buf`. `between`
  /// (optional) runs after each chunk.
  void pairwise_all_gather_recv(std::byte* buf, const std::vector<Segment>& segs, std::uint64_t phase,
                                const std::function<void()>& between = {}) {
    if (n_ == 1) return;
    for (int k = 1; k < n_; ++k) {
      const int j = mod(i_ - k);  // the node that sent to us first
      const std::uint64_t total = segment_bytes(segs[j]);
      for (std::uint64_t c = 0; c < chunks(total); ++c) {
        const auto [from, to] = chunk_span(total, c);
        NodePayload m = ch_.recv(j, tag_of(base_, phase, 0, c));
        expect_size(m, to - from, j);
        // Nothing to copy where the transport placed it (post_all_gather).
        for_pieces(buf, segs[j], from, to, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
          copy_bytes(p, m.data() + off, len);
          final(p, len);
        });
        if (between) between();
      }
    }
  }

  /// Direct all-gather: every node sends its segment to every other one.
  void direct_all_gather(std::byte* buf, const std::vector<Segment>& segs, std::uint64_t phase) {
    const std::uint64_t mine = segment_bytes(segs[i_]);
    const auto pieces = pieces_of(buf, segs[i_], 0, mine);
    for (int j = 0; j < n_; ++j) {
      if (j != i_) ch_.send(j, tag_of(base_, phase, 0, 0), pieces, nullptr);
    }
    for (int j = 0; j < n_; ++j) {
      if (j == i_) continue;
      NodePayload m = ch_.recv(j, tag_of(base_, phase, 0, 0));
      const std::uint64_t total = segment_bytes(segs[j]);
      expect_size(m, total, j);
      for_pieces(buf, segs[j], 0, total, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
        std::memcpy(p, m.data() + off, len);
        final(p, len);
      });
    }
  }

  /// Direct all-reduce of `bytes` at `buf`: one round, then every node reduces
  /// the N contributions in node order (so all get the same bits).
  void direct_all_reduce(std::byte* buf, std::uint64_t bytes, DType dtype, RedOp op,
                         std::uint64_t phase) {
    for (int j = 0; j < n_; ++j) {
      if (j != i_) ch_.send(j, tag_of(base_, phase, 0, 0), buf, bytes);
    }
    std::vector<NodePayload> in(n_);
    std::vector<const void*> srcs(n_);
    for (int j = 0; j < n_; ++j) {
      if (j == i_) {
        srcs[j] = buf;
        continue;
      }
      in[j] = ch_.recv(j, tag_of(base_, phase, 0, 0));
      expect_size(in[j], bytes, j);
      srcs[j] = in[j].data();
    }
    ch_.flush();  // `buf` went out in place and is overwritten now
    reduce(dtype, op, buf, srcs.data(), srcs.size(), bytes / dtype_size(dtype), 1);
  }

  /// Broadcast of `bytes` at `buf` from node `root`: direct or a pipelined chain.
  void broadcast(std::byte* buf, std::uint64_t bytes, int root, bool direct, std::uint64_t phase) {
    if (direct) {
      if (i_ == root) {
        need(buf, bytes);
        for (int j = 0; j < n_; ++j) {
          if (j != i_) ch_.send(j, tag_of(base_, phase, 0, 0), buf, bytes);
        }
      } else {
        NodePayload m = ch_.recv(root, tag_of(base_, phase, 0, 0));
        expect_size(m, bytes, root);
        copy_bytes(buf, m.data(), bytes);
        final(buf, bytes);
      }
      return;
    }
    const int pos = mod(i_ - root);
    const int prev = mod(i_ - 1), next = mod(i_ + 1);
    const bool has_next = pos + 1 < n_;
    const std::uint64_t nc = std::max<std::uint64_t>(chunks(bytes), 1);
    for (std::uint64_t c = 0; pos != 0 && c < nc; ++c) {
      // Each chunk may be read straight into place, and is forwarded from there.
      const auto [from, to] = chunk_span(bytes, c);
      ch_.post(prev, tag_of(base_, phase, 0, c), {buf + from, to - from});
    }
    if (broadcast_waits(bytes)) {
      if (pos != 0) tell_ready(prev, phase);
      if (has_next) await_ready(next, phase);
    }
    for (std::uint64_t c = 0; c < nc; ++c) {
      const auto [from, to] = chunk_span(bytes, c);
      const std::uint64_t len = to - from;
      if (pos == 0) {
        need(buf + from, len);
        ch_.send(next, tag_of(base_, phase, 0, c), buf + from, len);
        continue;
      }
      auto m = std::make_shared<NodePayload>(ch_.recv(prev, tag_of(base_, phase, 0, c)));
      expect_size(*m, len, prev);
      if (has_next) ch_.send(next, tag_of(base_, phase, 0, c), m->data(), m->size, m);
      copy_bytes(buf + from, m->data(), len);
      final(buf + from, len);
    }
  }

  /// Pipelined chain reduce toward node `root`: the chain starts at root+1 and
  /// ends at root, whose `buf` then holds the reduction over all nodes.
  void chain_reduce(std::byte* buf, std::uint64_t bytes, int root, DType dtype, RedOp op,
                    std::uint64_t phase) {
    const int pos = mod(i_ - root - 1);
    const int prev = mod(i_ - 1), next = mod(i_ + 1);
    const std::uint64_t nc = std::max<std::uint64_t>(chunks(bytes), 1);
    for (std::uint64_t c = 0; c < nc; ++c) {
      const auto [from, to] = chunk_span(bytes, c);
      const std::uint64_t len = to - from;
      if (pos > 0) {
        NodePayload m = ch_.recv(prev, tag_of(base_, phase, 0, c));
        expect_size(m, len, prev);
        if (len != 0) reduce2(dtype, op, buf + from, m.data(), len);
        if (pos + 1 == n_) final(buf + from, len);  // the root: reduced over every node
      }
      if (pos + 1 < n_) ch_.send(next, tag_of(base_, phase, 0, c), buf + from, len);
    }
  }

  /// Recursive doubling all-reduce of `bytes` at `buf`: log2 N rounds of
  /// the whole buffer with one partner each, where the direct exchange sends
  /// it N-1 times per node in one round (small operations on many nodes,
  /// use_tree). With N = p + r (p the largest power of two up to N), node
  /// 2k < 2r first hands its contribution to node 2k+1 and gets the result
  /// back from it at the end; the p others take part as virtual nodes 0..p-1
  /// in node order. Each combination puts the lower nodes' value first on
  /// both ends, so every node reduces the same expression: the same bits.
  void recursive_doubling_all_reduce(std::byte* buf, std::uint64_t bytes, DType dtype, RedOp op,
                                     std::uint64_t phase) {
    int p = 1;
    while (p * 2 <= n_) p *= 2;
    const int r = n_ - p;
    const std::uint64_t count = bytes / dtype_size(dtype);
    auto node_of = [r](int v) { return v < r ? 2 * v + 1 : v + r; };
    // Steps: 0..log2(p)-1 the rounds (on 2 nodes: the direct exchange's
    // message), then the hand-over and the hand-back.
    int rounds = 0;
    for (int m = 1; m < p; m <<= 1) ++rounds;
    const std::uint64_t over = static_cast<std::uint64_t>(rounds), back = over + 1;
    auto combine = [&](const std::byte* lower, const std::byte* upper) {
      const void* srcs[2] = {lower, upper};
      if (count != 0) reduce(dtype, op, buf, srcs, 2, count, 1);
    };
    int v = 0;
    if (i_ < 2 * r && i_ % 2 == 0) {
      ch_.send(i_ + 1, tag_of(base_, phase, over, 0), buf, bytes);
      NodePayload m = ch_.recv(i_ + 1, tag_of(base_, phase, back, 0));
      expect_size(m, bytes, i_ + 1);
      ch_.flush();  // `buf` went out in place
      copy_bytes(buf, m.data(), bytes);
      return;
    }
    if (i_ < 2 * r) {
      NodePayload m = ch_.recv(i_ - 1, tag_of(base_, phase, over, 0));
      expect_size(m, bytes, i_ - 1);
      combine(m.data(), buf);
      v = i_ / 2;
    } else {
      v = i_ - r;
    }
    std::uint64_t step = 0;
    for (int mask = 1; mask < p; mask <<= 1, ++step) {
      const int pv = v ^ mask, peer = node_of(pv);
      ch_.send(peer, tag_of(base_, phase, step, 0), buf, bytes);
      NodePayload m = ch_.recv(peer, tag_of(base_, phase, step, 0));
      expect_size(m, bytes, peer);
      ch_.flush();  // `buf` went out in place and is overwritten now
      if (pv < v) {
        combine(m.data(), buf);
      } else {
        combine(buf, m.data());
      }
    }
    if (i_ < 2 * r) ch_.send(i_ - 1, tag_of(base_, phase, back, 0), buf, bytes);
  }

  /// Binomial-tree broadcast of `bytes` at `buf` from node `root`: ceil(log2
  /// N) rounds, where the direct broadcast has the root send it N-1 times.
  /// Node v (counted from the root) receives from v less its lowest set bit,
  /// then sends to v + 2^k for each 2^k below that bit, farthest first.
  void tree_broadcast(std::byte* buf, std::uint64_t bytes, int root, std::uint64_t phase) {
    const int v = mod(i_ - root);
    int top = 1;
    while (top < n_) top *= 2;
    int below = top;
    if (v == 0) {
      need(buf, bytes);
    } else {
      below = v & -v;
      const int parent = mod(v - below + root);
      NodePayload m = ch_.recv(parent, tag_of(base_, phase, 0, 0));
      expect_size(m, bytes, parent);
      copy_bytes(buf, m.data(), bytes);
      final(buf, bytes);
    }
    for (int mask = below >> 1; mask > 0; mask >>= 1) {
      if (v + mask < n_) ch_.send(mod(v + mask + root), tag_of(base_, phase, 0, 0), buf, bytes);
    }
  }

  /// Binomial-tree reduce toward node `root` (the broadcast's tree, leaves
  /// first): node v reduces what v + 1, v + 2, v + 4, ... (below its lowest
  /// set bit) send, then sends to its parent; the root's `buf` then holds
  /// the reduction over all nodes, after ceil(log2 N) rounds instead of the
  /// chain's N-1.
  void tree_reduce(std::byte* buf, std::uint64_t bytes, int root, DType dtype, RedOp op,
                   std::uint64_t phase) {
    const int v = mod(i_ - root);
    int top = 1;
    while (top < n_) top *= 2;
    const int below = v == 0 ? top : (v & -v);
    for (int mask = 1; mask < below && v + mask < n_; mask <<= 1) {
      const int child = mod(v + mask + root);
      NodePayload m = ch_.recv(child, tag_of(base_, phase, 0, 0));
      expect_size(m, bytes, child);
      if (bytes != 0) reduce2(dtype, op, buf, m.data(), bytes);
    }
    if (v == 0) {
      final(buf, bytes);
    } else {
      ch_.send(mod(v - below + root), tag_of(base_, phase, 0, 0), buf, bytes);
    }
  }

 private:
  void send_segment(int to, std::byte* buf, const Segment& seg, std::uint64_t phase,
                    std::uint64_t step) {
    const std::uint64_t total = segment_bytes(seg);
    for (std::uint64_t c = 0; c < chunks(total); ++c) {
      const auto [from, to_byte] = chunk_span(total, c);
      const auto pieces = pieces_of(buf, seg, from, to_byte);
      for (const auto& piece : pieces) need(piece.data(), piece.size());
      ch_.send(to, tag_of(base_, phase, step, c), pieces, nullptr);
    }
  }

  /// Transfers cut in chunks `factor` times the profile's while it lives
  /// (every node runs the same code, so both ends agree).
  class ScaledChunk {
   public:
    ScaledChunk(Algorithms& a, std::size_t factor) : a_(a), saved_(a.chunk_) {
      a_.chunk_ *= factor;
    }
    ~ScaledChunk() { a_.chunk_ = saved_; }
    ScaledChunk(const ScaledChunk&) = delete;
    ScaledChunk& operator=(const ScaledChunk&) = delete;

   private:
    Algorithms& a_;
    std::size_t saved_;
  };

  /// The receiving end of send_segment: offers each chunk of `seg` in `buf`
  /// that is one contiguous range for the message `from` sends under it.
  void post_segment(int from, std::byte* buf, const Segment& seg, std::uint64_t phase,
                    std::uint64_t step) {
    const std::uint64_t total = segment_bytes(seg);
    for (std::uint64_t c = 0; c < chunks(total); ++c) {
      const auto [lo, hi] = chunk_span(total, c);
      const auto pieces = pieces_of(buf, seg, lo, hi);
      if (pieces.size() != 1) continue;
      ch_.post(from, tag_of(base_, phase, step, c),
               {const_cast<std::byte*>(pieces[0].data()), pieces[0].size()});
    }
  }

  NodeChannel& ch_;
  int n_, i_;
  std::size_t chunk_;
  std::uint64_t base_;
  bool tell_ = false;
  bool guard_ = false;
};

}  // namespace

std::uint64_t transfer_chunk(std::uint64_t total, std::uint64_t chunk) {
  if (total < 2 * chunk || total >= 4 * chunk) return chunk;
  const std::uint64_t quarter = ((total + 3) / 4 + 4095) & ~std::uint64_t{4095};
  return std::min(quarter, chunk);
}

namespace {

bool use_direct(std::uint64_t bytes, const NodeAlgorithmOptions& o) {
  if (o.algorithm == "direct") return true;
  if (o.algorithm == "ring" || o.algorithm == "pairwise" || o.algorithm == "tree") return false;
  return bytes <= o.direct_max_bytes;
}

/// Above the direct size: pairwise (one step) or ring (N-1 steps).
bool use_pairwise(int nodes, const NodeAlgorithmOptions& o) {
  if (o.algorithm == "pairwise") return true;
  if (o.algorithm == "ring" || o.algorithm == "direct" || o.algorithm == "tree") return false;
  return nodes <= o.pairwise_max_nodes;
}

/// An all-reduce or reduce-scatter of at least this many bytes per rank (the
/// all-reduce's buffer, the reduce-scatter's output) on at least
/// kRingMinNodes nodes takes the ring where pairwise_max_nodes would allow
/// pairwise (auto only).
constexpr std::uint64_t kRingMinBytes = std::uint64_t{8} << 20;
constexpr int kRingMinNodes = 4;

/// An all-reduce above the direct size (a reduce-scatter above its small
/// sizes, scatter_pairwise): pairwise (one step of reduce-scatter, one of
/// all-gather) or the ring. The ring's steps forward what was just
/// reduced, still in cache, where pairwise sends every segment of the input
/// and of the result from memory; with one rank on the node it also reduces
/// the input where it is (ring_reduce_scatter). That wins from 8 MiB on 4
/// nodes; below it each ring step is one chunk (no pipelining), and on 3
/// nodes the two are even, so those keep pairwise (docs/architecture.md).
bool large_pairwise(std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o) {
  return use_pairwise(nodes, o) &&
         !(o.algorithm == "auto" && nodes >= kRingMinNodes && bytes >= kRingMinBytes);
}

/// Up to this many bytes per rank (and direct_max_bytes), a reduce-scatter
/// is pairwise on any number of nodes (scatter_pairwise).
constexpr std::uint64_t kPairwiseScatterMaxBytes = std::uint64_t{16} << 10;

/// A reduce-scatter's: pairwise on up to pairwise_max_nodes nodes, and at
/// every node count for the smallest operations: one round of the ring's
/// bytes instead of its N-1 sequential steps, which wins up to 16 KiB per
/// rank (above it, N-1 senders at once on each receiver cost more).
///
/// From kRingMinBytes per rank on kRingMinNodes nodes it takes the ring, as
/// the all-reduce does (large_pairwise): with one rank on the node the
/// ring reduces the input where it is and the last step straight into the
/// output, which is ahead of pairwise from there (docs/architecture.md).
bool scatter_pairwise(std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o) {
  const bool small =
      o.algorithm == "auto" && bytes <= std::min<std::uint64_t>(o.direct_max_bytes, kPairwiseScatterMaxBytes);
  return small || large_pairwise(bytes, nodes, o);
}

/// The log-depth algorithms for small operations (up to direct_max_bytes):
/// recursive doubling for the all-reduce on any number of nodes, binomial
/// trees for the broadcast and the reduce on more than pairwise_max_nodes.
/// The direct exchange's one round has every node send the whole buffer N-1
/// times (64 nodes, 64 KiB: 4 MiB out of each node per all-reduce, against
/// 384 KiB in 6 rounds), and the chain reduce takes N-1 hops. Recursive
/// doubling sends fewer messages for the same bytes, which wins from 3 nodes;
/// the broadcast and reduce trees only break even up to 8 nodes, so those keep
/// direct and chain where the exchange is small and take the trees where it
/// grows (docs/architecture.md). On 2 nodes recursive doubling is the direct
/// exchange.
bool use_tree(OpKind kind, std::uint64_t bytes, int nodes, const NodeAlgorithmOptions& o) {
  if (o.algorithm == "tree") return true;
  if (o.algorithm != "auto" || bytes > o.direct_max_bytes) return false;
  return kind == OpKind::all_reduce || nodes > o.pairwise_max_nodes;
}

enum class GatherKind { direct, pairwise, ring };

/// An all-gather's algorithm between nodes, for `total` bytes of output.
GatherKind all_gather_kind(std::uint64_t total, int nodes, const NodeAlgorithmOptions& o) {
  if (use_direct(total, o)) return GatherKind::direct;
  if (!use_pairwise(nodes, o)) return GatherKind::ring;
  // Two nodes: the ring and the pairwise exchange are the same transfers.
  const std::uint64_t per_node = total / static_cast<std::uint64_t>(nodes);
  if (o.algorithm == "auto" && nodes >= 3 && per_node >= kRingAllGatherMinBytes) {
    return GatherKind::ring;
  }
  return GatherKind::pairwise;
}

/// Segments of a contiguous buffer of `count` elements split evenly by node.
std::vector<Segment> even_segments(std::uint64_t count, std::size_t es, int n) {
  std::vector<Segment> segs(n);
  std::uint64_t at = 0;
  for (int j = 0; j < n; ++j) {
    const std::uint64_t elems = count / n + (static_cast<std::uint64_t>(j) < count % n ? 1 : 0);
    segs[j].push_back(Range{at * es, elems * es});
    at += elems;
  }
  return segs;
}

/// Segments made of rank blocks of `block` bytes: node j owns its ranks' blocks.
std::vector<Segment> rank_segments(const std::vector<int>& node_of_rank, std::uint64_t block,
                                   int n) {
  std::vector<Segment> segs(n);
  for (std::size_t r = 0; r < node_of_rank.size(); ++r) {
    segs[node_of_rank[r]].push_back(Range{r * block, block});
  }
  return segs;
}

}  // namespace

bool reduce_scatter_own_elsewhere(int nodes, const NodeAlgorithmOptions& options) {
  return nodes == 2 && use_pairwise(nodes, options);
}

bool reads_input_in_pieces(OpKind kind, std::uint64_t bytes, int nranks, int local_ranks, int nodes,
                           const NodeAlgorithmOptions& options) {
  if (local_ranks != 1 || nodes < 2 || bytes == 0) return false;
  switch (kind) {
    case OpKind::all_reduce:
      return use_direct(bytes, options) || large_pairwise(bytes, nodes, options);
    case OpKind::all_gather:
      return all_gather_kind(bytes * static_cast<std::uint64_t>(nranks), nodes, options) !=
             GatherKind::ring;
    case OpKind::reduce_scatter:
      return scatter_pairwise(bytes, nodes, options);
    case OpKind::broadcast: return true;
    default: return false;
  }
}

std::uint64_t first_input_read(OpKind kind, std::uint64_t count, DType dtype,
                               const std::vector<int>& node_of_rank, int node, int nodes,
                               const NodeAlgorithmOptions& options) {
  if (nodes < 2) return 0;
  const std::size_t es = dtype_size(dtype);
  if (kind == OpKind::all_reduce && use_direct(count * es, options)) return 0;  // read whole
  const int next = (node + 1) % nodes;
  std::vector<Segment> segs;
  if (kind == OpKind::all_reduce) segs = even_segments(count, es, nodes);
  if (kind == OpKind::reduce_scatter) segs = rank_segments(node_of_rank, count * es, nodes);
  if (segs.empty() || segs[next].empty()) return 0;
  return segs[next][0].offset;
}

NodeAlgorithm choose_node_algorithm(OpKind kind, std::uint64_t bytes, int nodes,
                                    const NodeAlgorithmOptions& options) {
  using A = NodeAlgorithm;
  if (nodes <= 1) return A::none;
  switch (kind) {
    case OpKind::all_reduce:
      if (use_tree(kind, bytes, nodes, options)) return A::recursive_doubling;
      if (use_direct(bytes, options)) return A::direct;
      return large_pairwise(bytes, nodes, options) ? A::pairwise : A::ring;
    case OpKind::all_gather:
      switch (all_gather_kind(bytes, nodes, options)) {
        case GatherKind::direct: return A::direct;
        case GatherKind::pairwise: return A::pairwise;
        case GatherKind::ring: return A::ring;
      }
      return A::ring;
    case OpKind::reduce_scatter:
      return scatter_pairwise(bytes, nodes, options) ? A::pairwise : A::ring;
    case OpKind::broadcast:
      if (use_tree(kind, bytes, nodes, options)) return A::tree;
      return use_direct(bytes, options) ? A::direct : A::chain;
    case OpKind::reduce:
      return use_tree(kind, bytes, nodes, options) ? A::tree : A::chain;
    default: return A::exchange;
  }
}

std::string_view to_string(NodeAlgorithm algorithm) {
  switch (algorithm) {
    case NodeAlgorithm::unknown: break;
    case NodeAlgorithm::none: return "none";
    case NodeAlgorithm::direct: return "direct";
    case NodeAlgorithm::pairwise: return "pairwise";
    case NodeAlgorithm::ring: return "ring";
    case NodeAlgorithm::chain: return "chain";
    case NodeAlgorithm::exchange: return "exchange";
    case NodeAlgorithm::recursive_doubling: return "recursive_doubling";
    case NodeAlgorithm::tree: return "tree";
  }
  return "unknown";
}

std::string node_algorithm(OpKind kind, std::uint64_t bytes, int nodes,
                           const NodeAlgorithmOptions& options) {
  return std::string(to_string(choose_node_algorithm(kind, bytes, nodes, options)));
}

std::string NodePlan::name() const { return std::string(to_string(algorithm)); }

std::string NodePlan::str() const {
  if (to_string(algorithm) == "unknown") return "an unknown algorithm";
  std::string s = name();
  if (chunk != 0) s += " in chunks of " + std::to_string(chunk) + " bytes";
  return s;
}

NodePlan node_plan(OpKind kind, std::uint64_t count, DType dtype, int nranks, int nodes,
                   const NodeAlgorithmOptions& options) {
  // all-gather chooses by what each node ends up with (node_algorithm).
  const std::uint64_t bytes = count * dtype_size(dtype) *
                              (kind == OpKind::all_gather ? static_cast<std::uint64_t>(nranks) : 1);
  NodePlan plan;
  plan.algorithm = choose_node_algorithm(kind, bytes, nodes, options);
  // The algorithms that cut transfers in chunks (transfer_chunk).
  if (plan.algorithm == NodeAlgorithm::pairwise || plan.algorithm == NodeAlgorithm::ring ||
      plan.algorithm == NodeAlgorithm::chain) {
    plan.chunk = options.chunk_bytes;
  }
  return plan;
}

std::vector<std::vector<std::byte>> node_exchange(NodeChannel& channel,
                                                  std::span<const std::byte> mine,
                                                  std::uint64_t tag) {
  const int n = channel.nodes(), me = channel.node();
  for (int j = 0; j < n; ++j) {
    if (j != me) channel.send(j, tag, mine.data(), mine.size());
  }
  std::vector<std::vector<std::byte>> all(n);
  for (int j = 0; j < n; ++j) {
    if (j == me) {
      all[j].assign(mine.begin(), mine.end());
      continue;
    }
    NodePayload m = channel.recv(j, tag);
    all[j].assign(m.data(), m.data() + m.size);
  }
  channel.flush();  // `mine` went out in place
  return all;
}

namespace {

void run_node_collective_unflushed(NodeChannel& ch, const NodeCollective& op,
                                   const NodeAlgorithmOptions& options, std::uint64_t base) {
  const int n = ch.nodes(), me = ch.node();
  const std::size_t es = dtype_size(op.dtype);
  const std::uint64_t one = op.count * es;
  const auto& L = op.local;
  if (L.empty()) throw Error(Code::internal, "a node collective without local ranks");
  if (op.own_contribution_elsewhere && op.kind != OpKind::reduce_scatter) {
    throw Error(Code::invalid_argument, "only a reduce-scatter leaves its own contribution to the client");
  }
  // avg is a sum until the very end, where it is divided once by nranks.
  const RedOp combine = op.redop == RedOp::avg ? RedOp::sum : op.redop;
  // Passes over whole buffers leave the thread that serves the peers when
  // large (NodeChannel::compute); per-chunk work stays where the chunk is.
  auto pass = [&](std::uint64_t bytes, const std::function<void()>& work) {
    if (bytes >= kOffloadBytes) {
      ch.compute(work);
    } else {
      work();
    }
  };
  auto finish_avg = [&](std::byte* p, std::uint64_t bytes) {
    if (op.redop != RedOp::avg || bytes == 0) return;
    pass(bytes, [&] {
      const void* src[1] = {p};
      reduce(op.dtype, RedOp::avg, p, src, 1, bytes / es, static_cast<std::size_t>(op.nranks));
    });
  };
  auto local_reduce = [&](std::byte* dst, std::uint64_t bytes) {
    if (bytes == 0) return;
    pass(bytes * L.size(), [&] {
      std::vector<const void*> srcs;
      for (const auto& b : L) srcs.push_back(b.send);
      reduce(op.dtype, combine, dst, srcs.data(), srcs.size(), bytes / es, 1);
    });
  };
  // The same `bytes` from `src` to every local rank's output but the first.
  auto copy_to_others = [&](const std::byte* src, std::uint64_t bytes) {
    if (L.size() < 2) return;
    pass(bytes * (L.size() - 1), [&] {
      for (std::size_t k = 1; k < L.size(); ++k) copy_bytes(L[k].recv, src, bytes);
    });
  };
  Algorithms algo(ch, options, base);
  // Chunks of the output are told final as they land (NodeChannel::written)
  // where nothing passes over the whole output afterwards: one rank on the
  // node (no copies to the others) and not avg (divided at the very end).
  // (avg: divided at the very end, unless the division is the client's.)
  const bool tell = L.size() == 1 && (op.redop != RedOp::avg || op.own_contribution_elsewhere);
  // The input may still be arriving: every read of it waits for its bytes.
  const bool in_pieces = reads_input_in_pieces(op.kind, one, op.nranks, static_cast<int>(L.size()), n, options);
  algo.guard_input(in_pieces);

  // An operation of zero bytes still meets every other node once, so that a
  // node whose ranks disagree (a non-zero count, another operation) is told.
  if (one == 0 && op.kind != OpKind::barrier) {
    node_exchange(ch, {}, tag_of(base, 15, 0, 0));
    return;
  }
  switch (op.kind) {
    case OpKind::barrier:
      node_exchange(ch, {}, tag_of(base, 15, 0, 0));
      return;
    case OpKind::all_reduce: {
      std::byte* w = L[0].recv;
      const auto segs = even_segments(op.count, es, n);
      // One rank on the node, pairwise: no local pass (see below).
      const bool pairwise = large_pairwise(one, n, options);
      const bool one_rank = L.size() == 1 && !use_direct(one, options) && pairwise && segs[me].size() <= 1;
      // One rank, ring: its input is reduced where it is (ring_reduce_scatter).
      const bool ring_one =
          L.size() == 1 && choose_node_algorithm(op.kind, one, n, options) == NodeAlgorithm::ring;
      if (!one_rank && !ring_one) {
        // The direct one reads the whole input here, in whatever pieces it
        // arrives (reads_input_in_pieces).
        if (in_pieces) ch.reading(L[0].send, one);
        local_reduce(w, one);
      }
      algo.tell_final(tell);
      if (n > 1 && use_tree(op.kind, one, n, options)) {
        algo.recursive_doubling_all_reduce(w, one, op.dtype, combine, 1);
      } else if (use_direct(one, options)) {
        if (n > 1) algo.direct_all_reduce(w, one, op.dtype, combine, 1);
      } else if (pairwise) {
        // Each reduced chunk goes out at once (phase 2); then the others'
        // chunks come in. With one rank, its input is read in place and
        // reduced into its output; out of place, nothing the sends read is
        // written next, so the receives need not wait for them.
        // The others' reduced segments may be received straight into `w`,
        // in place too, where the reduce-scatter sends read those very
        // segments: node j sends its chunk c of segment j only after it has
        // reduced it, that is after it received ours, so our send has been
        // read by then (by any transport: the bytes reached j). The causal
        // order stands in for the flush the NodeChannel contract asks for.
        // Received into fresh buffers and copied, in place ran at 0.77x of
        // out of place (4 daemons on 2 cores, 2-4 MiB).
        algo.post_all_gather(w, segs, 2);
        if (one_rank) {
          algo.pairwise_reduce_scatter(L[0].send, segs, op.dtype, combine, 1,
                                       w + (segs[me].empty() ? 0 : segs[me][0].offset), 2,
                                       /*flush=*/L[0].send == w);
        } else {
          algo.pairwise_reduce_scatter(w, segs, op.dtype, combine, 1, nullptr, 2);
        }
        algo.pairwise_all_gather_recv(w, segs, 2);
      } else {
        algo.ring_reduce_scatter(w, segs, op.dtype, combine, 1, ring_one ? L[0].send : nullptr);
        algo.ring_all_gather(w, segs, 2);
      }
      if (op.redop == RedOp::avg) ch.flush();  // `w` went out in place; divided next
      finish_avg(w, one);
      copy_to_others(w, one);
      return;
    }
    case OpKind::all_gather: {
      std::byte* w = L[0].recv;
      const auto segs = rank_segments(op.node_of_rank, one, n);
      auto copy_own = [&] {
        if (in_pieces) ch.reading(L[0].send, one);
        pass(one * L.size(), [&] {
          for (const auto& b : L) copy_bytes(w + b.rank * one, b.send, one);
        });
        if (tell) ch.written(w + L[0].rank * one, one);
      };
      algo.tell_final(tell);
      const GatherKind kind = all_gather_kind(one * op.nranks, n, options);
      if (L.size() == 1 && kind == GatherKind::ring) {
        // One rank: its input goes to the right from where it is, and its
        // copy into the output follows that send (not before it).
        algo.ring_all_gather_send(w, segs, 1, L[0].send);
        ch.start_sends();
        copy_own();
        algo.ring_all_gather_recv(w, segs, 1);
        return;
      }
      if (L.size() == 1 && kind == GatherKind::pairwise) {
        // One rank: its input goes out from where it is, and its copy into
        // the output overlaps the exchange.
        algo.pairwise_all_gather_send(w, segs, 1, L[0].send);
        if (ch.parallelism() <= 1 || one < kOwnCopyAsyncBytes || L[0].send == w + L[0].rank * one) {
          ch.start_sends();
          copy_own();
          algo.pairwise_all_gather_recv(w, segs, 1);
          return;
        }
        // On the pool: the thread that runs this serves the peers too (reads
        // their frames, places their chunks), and a 2 MiB copy here held it
        // for ~165 us while the other node's chunks waited. Handed to the pool
        // before the sends leave, so that a worker wakes and copies while the
        // event loop writes the sends to the sockets; handed over after them,
        // the copy ended on the operation's path (docs/architecture.md).
        if (in_pieces) ch.reading(L[0].send, one);  // in already: the sends read it
        std::byte* own_dst = w + L[0].rank * one;
        const std::byte* own_src = L[0].send;
        PendingPass own{ch, ch.compute_async([own_dst, own_src, one] { copy_bytes(own_dst, own_src, one); })};
        ch.start_sends();
        auto finish_own = [&] {
          own.wait();
          if (tell) ch.written(own_dst, one);
        };
        algo.pairwise_all_gather_recv(w, segs, 1, [&] {
          if (own.ticket && ch.compute_done(own.ticket)) finish_own();
        });
        if (own.ticket) finish_own();
        return;
      }
      copy_own();
      switch (kind) {
        case GatherKind::direct: algo.direct_all_gather(w, segs, 1); break;
        case GatherKind::pairwise: algo.pairwise_all_gather(w, segs, 1); break;
        case GatherKind::ring: algo.ring_all_gather(w, segs, 1); break;
      }
      copy_to_others(w, one * op.nranks);
      return;
    }
    case OpKind::reduce_scatter: {
      const std::uint64_t total = one * op.nranks;
      if (op.own_contribution_elsewhere &&
          (L.size() != 1 || !reduce_scatter_own_elsewhere(n, options))) {
        throw Error(Code::invalid_argument,
                    "a reduce-scatter leaving its own contribution to the client takes one rank "
                    "per node, two nodes and the pairwise algorithm; here node " +
                        std::to_string(me) + " of " + std::to_string(n) + " has " +
                        std::to_string(L.size()) + " ranks, collectives.algorithm " +
                        options.algorithm);
      }
      const bool pairwise = scatter_pairwise(one, n, options);
      if (L.size() == 1 && pairwise) {
        // One rank: its input is read in place and its segment reduced
        // straight into its output (no scratch, no copies). Its own
        // contribution left out: the other node's, as it came (the client
        // combines them on the GPU, and divides avg).
        algo.tell_final(tell);
        algo.pairwise_reduce_scatter(L[0].send, rank_segments(op.node_of_rank, one, n), op.dtype,
                                     combine, 1, L[0].recv, 0, true, op.own_contribution_elsewhere);
        if (!op.own_contribution_elsewhere) finish_avg(L[0].recv, one);
        return;
      }
      std::byte* t = ch.scratch(total);
      if (pairwise) {
        local_reduce(t, total);
        algo.pairwise_reduce_scatter(t, rank_segments(op.node_of_rank, one, n), op.dtype,
                                     combine, 1);
      } else if (L.size() == 1 && n > 1) {
        // One rank: its input is reduced where it is (no copy into `t`
        // first), and its segment straight into its output (no copy after).
        algo.tell_final(tell);
        algo.ring_reduce_scatter(t, rank_segments(op.node_of_rank, one, n), op.dtype, combine, 1,
                                 L[0].send, L[0].recv);
        finish_avg(L[0].recv, one);
        return;
      } else {
        local_reduce(t, total);
        algo.ring_reduce_scatter(t, rank_segments(op.node_of_rank, one, n), op.dtype,
                                 combine, 1);
      }
      pass(one * L.size(), [&] {
        for (const auto& b : L) copy_bytes(b.recv, t + b.rank * one, one);
      });
      for (const auto& b : L) finish_avg(b.recv, one);
      return;
    }
    case OpKind::broadcast: {
      const int root_node = op.node_of_rank[op.root];
      std::byte* src = nullptr;
      if (root_node == me) {
        for (const auto& b : L) {
          if (b.rank == op.root) src = b.send;
        }
      } else {
        src = L[0].recv;
      }
      algo.tell_final(tell && root_node != me);  // the root node only sends
      if (n > 1 && use_tree(op.kind, one, n, options)) {
        algo.tree_broadcast(src, one, root_node, 1);
      } else {
        algo.broadcast(src, one, root_node, use_direct(one, options), 1);
      }
      pass(one * L.size(), [&] {
        for (const auto& b : L) copy_bytes(b.recv, src, one);
      });
      return;
    }
    case OpKind::reduce: {
      const int root_node = op.node_of_rank[op.root];
      std::byte* t = nullptr;
      if (root_node == me) {
        for (const auto& b : L) {
          if (b.rank == op.root) t = b.recv;
        }
      } else {
        t = ch.scratch(one);
      }
      local_reduce(t, one);
      algo.tell_final(tell && root_node == me);  // elsewhere `t` is scratch
      if (n > 1 && use_tree(op.kind, one, n, options)) {
        algo.tree_reduce(t, one, root_node, op.dtype, combine, 1);
      } else {
        algo.chain_reduce(t, one, root_node, op.dtype, combine, 1);
      }
      if (root_node == me) finish_avg(t, one);
      return;
    }
    case OpKind::all_to_all: {
      // Sends that share memory with receives (in place) are read from a copy:
      // local deliveries below overwrite them.
      std::vector<std::vector<std::byte>> copies(L.size());
      std::vector<const std::byte*> src(L.size());
      for (std::size_t k = 0; k < L.size(); ++k) {
        const auto& b = L[k];
        const bool overlap = b.send < b.recv + b.recv_bytes && b.recv < b.send + b.send_bytes;
        if (overlap) {
          copies[k].assign(b.send, b.send + b.send_bytes);
          src[k] = copies[k].data();
        } else {
          src[k] = b.send;
        }
      }
      std::vector<std::vector<int>> ranks_of(n);
      for (int r = 0; r < op.nranks; ++r) ranks_of[op.node_of_rank[r]].push_back(r);
      // Message to node j: for each of my ranks r (ascending), its blocks for
      // each of j's ranks d (ascending).
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        std::vector<std::span<const std::byte>> pieces;
        for (std::size_t k = 0; k < L.size(); ++k) {
          for (int d : ranks_of[j]) pieces.emplace_back(src[k] + d * one, one);
        }
        ch.send(j, tag_of(base, 1, 0, 0), pieces, nullptr);
      }
      for (std::size_t k = 0; k < L.size(); ++k) {
        for (const auto& b : L) std::memcpy(b.recv + L[k].rank * one, src[k] + b.rank * one, one);
      }
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        NodePayload m = ch.recv(j, tag_of(base, 1, 0, 0));
        expect_size(m, ranks_of[j].size() * L.size() * one, j);
        std::uint64_t pos = 0;
        for (int r : ranks_of[j]) {
          for (const auto& b : L) {
            std::memcpy(b.recv + r * one, m.data() + pos, one);
            pos += one;
          }
        }
      }
      ch.flush();  // the sends read `copies` in place
      return;
    }
    default:
      throw Error(Code::internal, "no node algorithm for " + std::string(to_string(op.kind)));
  }
}

}  // namespace

void run_node_collective(NodeChannel& ch, const NodeCollective& op,
                         const NodeAlgorithmOptions& options, std::uint64_t base) {
  run_node_collective_unflushed(ch, op, options, base);
  // Sends read the ranks' buffers in place: the operation is complete (and
  // the buffers are the clients' again) only once every send has left.
  ch.flush();
}

}  // namespace collectived::engine
