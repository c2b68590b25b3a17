// The pairwise exchanges between nodes: every node sends each other node its
// share at once, in chunks, and reduces (or copies) what arrives. Each node
// sends the ring's bytes in one step instead of N-1 store-and-forward steps,
// which keeps every link busy: the choice up to pairwise_max_nodes nodes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/algorithms/context.h"

namespace collectived::engine::algorithms {

/// Pairwise reduce-scatter: every node sends each other node that node's
/// segment at once (in chunks), then reduces what it receives for its own
/// segment, chunk by chunk, over all nodes in node order (deterministic).
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
void pairwise_reduce_scatter(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                             DType dtype, RedOp op, std::uint64_t phase,
                             std::byte* own_out = nullptr, std::uint64_t gather_phase = 0,
                             bool flush = true, bool skip_own = false);

/// Pairwise all-gather: every node sends its segment to every other one, in
/// chunks, and copies in what it receives as it arrives.
void pairwise_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                         std::uint64_t phase);
/// Offers `buf`'s segments of the other nodes to the channel, chunk by
/// chunk (where a chunk is one contiguous range), for the all-gather
/// messages of `phase`: the transport may read them straight into place.
/// Nothing may read or write those segments until they are received.
void post_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                     std::uint64_t phase);
/// Its sends (after posting its receives). `own_src` (optional): this
/// node's segment is read from there (one contiguous range) instead of
/// from `buf`, which it may fill meanwhile.
void pairwise_all_gather_send(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                              std::uint64_t phase, std::byte* own_src = nullptr);
/// Its receives: every other node's segment into `buf`. `between`
/// (optional) runs after each chunk.
void pairwise_all_gather_recv(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                              std::uint64_t phase, const std::function<void()>& between = {});

}  // namespace collectived::engine::algorithms
