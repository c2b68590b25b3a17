#include "engine/algorithms/context.h"

namespace collectived::engine {

std::uint64_t transfer_chunk(std::uint64_t total, std::uint64_t chunk) {
  if (total < 2 * chunk || total >= 4 * chunk) return chunk;
  const std::uint64_t quarter = ((total + 3) / 4 + 4095) & ~std::uint64_t{4095};
  return std::min(quarter, chunk);
}

}  // namespace collectived::engine

namespace collectived::engine::algorithms {

void Context::send_segment(int to, std::byte* buf, const Segment& seg, std::uint64_t phase,
                           std::uint64_t step) {
  const std::uint64_t total = segment_bytes(seg);
  for (std::uint64_t c = 0; c < chunks(total); ++c) {
    const auto [from, to_byte] = chunk_span(total, c);
    const auto pieces = pieces_of(buf, seg, from, to_byte);
    for (const auto& piece : pieces) need(piece.data(), piece.size());
    ch_.send(to, tag(phase, step, c), pieces, nullptr);
  }
}

void Context::post_segment(int from, std::byte* buf, const Segment& seg, std::uint64_t phase,
                           std::uint64_t step) {
  const std::uint64_t total = segment_bytes(seg);
  for (std::uint64_t c = 0; c < chunks(total); ++c) {
    const auto [lo, hi] = chunk_span(total, c);
    const auto pieces = pieces_of(buf, seg, lo, hi);
    if (pieces.size() != 1) continue;
    ch_.post(from, tag(phase, step, c),
             {const_cast<std::byte*>(pieces[0].data()), pieces[0].size()});
  }
}

}  // namespace collectived::engine::algorithms
