// Which bytes of a buffer each node owns in an operation: a segment is a list
// of byte ranges read as one concatenation (a contiguous share of an
// all-reduce's buffer, or the blocks of a node's ranks in an all-gather or
// reduce-scatter). The algorithms cut segments in chunks and walk them with
// for_pieces, so that one code path serves both layouts.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace collectived::engine::algorithms {

/// A byte range of a buffer.
struct Range {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};
/// What one node owns of a buffer: ranges in order, read as one concatenation.
using Segment = std::vector<Range>;

inline std::uint64_t segment_bytes(const Segment& s) {
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

inline std::vector<std::span<const std::byte>> pieces_of(std::byte* buf, const Segment& seg,
                                                         std::uint64_t from, std::uint64_t to) {
  std::vector<std::span<const std::byte>> out;
  for_pieces(buf, seg, from, to,
             [&](std::byte* p, std::uint64_t, std::uint64_t len) { out.emplace_back(p, len); });
  return out;
}

/// Segments of a contiguous buffer of `count` elements split evenly by node.
std::vector<Segment> even_segments(std::uint64_t count, std::size_t es, int n);

/// Segments made of rank blocks of `block` bytes: node j owns its ranks' blocks.
std::vector<Segment> rank_segments(const std::vector<int>& node_of_rank, std::uint64_t block,
                                   int n);

}  // namespace collectived::engine::algorithms
