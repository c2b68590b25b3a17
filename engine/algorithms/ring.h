// The ring between nodes: reduce-scatter and all-gather in N-1 steps, each to
// one neighbour, pipelined in chunks so that the reduction of one chunk
// overlaps the transfer of the next. For large operations on many nodes,
// where sending to every node at once (pairwise.h) costs more than it gives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/algorithms/context.h"

namespace collectived::engine::algorithms {

/// Ring reduce-scatter: afterwards node j's segment of `buf` holds the
/// reduction over all nodes. Step s: node i sends segment i-s-1 to the right
/// and reduces segment i-s-2 from the left into its own copy, then forwards
/// that chunk at step s+1.
/// With `in` (the input, laid out as `buf`), the first step sends from it
/// and every step reduces it with what came into `buf`: out of place with
/// one rank on the node, no pass copies the input into `buf` first.
/// With `own_out`, the last step reduces this node's own segment there
/// (its bytes in segment order) instead of into `buf`.
void ring_reduce_scatter(Context& c, std::byte* buf, const std::vector<Segment>& segs, DType dtype,
                         RedOp op, std::uint64_t phase, const std::byte* in = nullptr,
                         std::byte* own_out = nullptr);

/// Ring all-gather: node i's own segment is in `buf`; afterwards every
/// segment is. Each chunk is forwarded as soon as it arrives, from where it
/// was received: the receives are posted in place (NodeChannel::post).
void ring_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                     std::uint64_t phase);
/// Its start: posts the receives and sends this node's segment. `own_src`
/// (optional): the segment is read from there (one contiguous range)
/// instead of from `buf`, which the caller may fill meanwhile.
void ring_all_gather_send(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                          std::uint64_t phase, std::byte* own_src = nullptr);
/// The rest: every other node's segment, received into `buf` and forwarded.
void ring_all_gather_recv(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                          std::uint64_t phase);

}  // namespace collectived::engine::algorithms
