#include "engine/algorithms/ring.h"

namespace collectived::engine::algorithms {

namespace {

/// The ring all-gather moves chunks this many times tcp.chunk_bytes (8 MiB by
/// default; transfer_chunk: a segment below two of them goes whole). Each
/// chunk is received, then forwarded by the fiber: fewer, larger ones cost
/// fewer wake-ups, and an all-gather's ring gains nothing from finer ones
/// (each node forwards what it has; the bytes per link are the same).
constexpr std::size_t kRingAllGatherChunks = 8;

/// Offers `buf`'s segments of the other nodes to the channel for the ring
/// all-gather's messages from `left` (step s carries node i-s-1's
/// segment), chunk by chunk where a chunk is one contiguous range.
void post_ring_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                          std::uint64_t phase, int left) {
  for (int s = 0; s + 1 < c.n(); ++s) {
    const Segment& seg = segs[c.mod(c.i() - s - 1)];
    if (c.posted(segment_bytes(seg))) c.post_segment(left, buf, seg, phase, s);
  }
}

}  // namespace

void ring_reduce_scatter(Context& c, std::byte* buf, const std::vector<Segment>& segs, DType dtype,
                         RedOp op, std::uint64_t phase, const std::byte* in, std::byte* own_out) {
  const int n = c.n(), i = c.i();
  if (n == 1) return;
  NodeChannel& ch = c.ch();
  const int right = c.mod(i + 1), left = c.mod(i - 1);
  c.send_segment(right, in != nullptr ? const_cast<std::byte*>(in) : buf, segs[c.mod(i - 1)], phase,
                 0);
  for (int s = 0; s + 1 < n; ++s) {
    const Segment& seg = segs[c.mod(i - s - 2)];
    const std::uint64_t total = segment_bytes(seg);
    for (std::uint64_t k = 0; k < c.chunks(total); ++k) {
      const auto [from, to] = c.chunk_span(total, k);
      NodePayload m = ch.recv(left, c.tag(phase, s, k));
      expect_size(m, to - from, left);
      const bool last = s + 2 == n;  // the last step reduces this node's own segment
      const std::uint64_t at =
          from;  // a copy: clang before 16 does not capture structured bindings
      for_pieces(buf, seg, from, to, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
        std::byte* dst = last && own_out != nullptr ? own_out + at + off : p;
        if (len != 0) {
          // reduce2's order: what came in, then this node's value.
          const void* srcs[2] = {m.data() + off, in != nullptr ? in + (p - buf) : p};
          reduce(dtype, op, dst, srcs, 2, len / dtype_size(dtype), 1);
        }
        if (last) c.final(dst, len);
      });
      if (s + 2 < n) {
        const auto pieces = pieces_of(buf, seg, from, to);
        ch.send(right, c.tag(phase, s + 1, k), pieces, nullptr);
      }
    }
  }
  // What was sent is read in place; the caller may overwrite it next (the
  // all-gather receives into the segments sent here).
  ch.flush();
}

void ring_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                     std::uint64_t phase) {
  ring_all_gather_send(c, buf, segs, phase);
  ring_all_gather_recv(c, buf, segs, phase);
}

void ring_all_gather_send(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                          std::uint64_t phase, std::byte* own_src) {
  const int n = c.n(), i = c.i();
  if (n == 1) return;
  const int right = c.mod(i + 1), left = c.mod(i - 1);
  const Context::ScaledChunk larger(c, kRingAllGatherChunks);
  post_ring_all_gather(c, buf, segs, phase, left);
  // Ready to receive as in the pairwise all-gather: the left node's first
  // send is its own segment, at once; forwarded chunks follow receipts, by
  // which time the right node has posted.
  if (c.all_gather_waits(segment_bytes(segs[left]))) c.tell_ready(left, phase);
  if (c.all_gather_waits(segment_bytes(segs[i]))) c.await_ready(right, phase);
  if (own_src != nullptr) {
    c.send_segment(right, own_src, Segment{Range{0, segment_bytes(segs[i])}}, phase, 0);
  } else {
    c.send_segment(right, buf, segs[i], phase, 0);
  }
}

void ring_all_gather_recv(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                          std::uint64_t phase) {
  const int n = c.n(), i = c.i();
  if (n == 1) return;
  NodeChannel& ch = c.ch();
  const int right = c.mod(i + 1), left = c.mod(i - 1);
  const Context::ScaledChunk larger(c, kRingAllGatherChunks);
  for (int s = 0; s + 1 < n; ++s) {
    const Segment& seg = segs[c.mod(i - s - 1)];
    const std::uint64_t total = segment_bytes(seg);
    for (std::uint64_t k = 0; k < c.chunks(total); ++k) {
      const auto [from, to] = c.chunk_span(total, k);
      NodePayload m = ch.recv(left, c.tag(phase, s, k));
      expect_size(m, to - from, left);
      // Nothing to copy where the transport placed it.
      for_pieces(buf, seg, from, to, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
        copy_bytes(p, m.data() + off, len);
        c.final(p, len);
      });
      // Forwarded from its place in `buf`, final now and not written again.
      if (s + 2 < n) {
        const auto pieces = pieces_of(buf, seg, from, to);
        ch.send(right, c.tag(phase, s + 1, k), pieces, nullptr);
      }
    }
  }
}

}  // namespace collectived::engine::algorithms
