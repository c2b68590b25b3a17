#include "engine/comm.h"

#include <algorithm>

namespace collectived::engine::detail {

std::string Desc::str() const {
  std::string s(to_string(kind));
  if (kind == OpKind::barrier || kind == OpKind::split) return s;
  s += "(count=" + std::to_string(count) + ", dtype=" + std::string(to_string(dtype));
  if (kind == OpKind::all_reduce || kind == OpKind::reduce || kind == OpKind::reduce_scatter) {
    s += ", op=" + std::string(to_string(redop));
  }
  if (kind == OpKind::broadcast || kind == OpKind::reduce) s += ", root=" + std::to_string(root);
  if (gpu) s += ", on GPU buffers";
  return s + ")";
}

std::string hex_prefix(const std::string& bytes, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < std::min(n, bytes.size()); ++i) {
    const auto b = static_cast<unsigned char>(bytes[i]);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

std::string desc_mismatch(const Comm& comm, std::uint64_t seq, int rank_a, const Desc& a,
                          int rank_b, const Desc& b) {
  return "mismatched operations for sequence number " + std::to_string(seq) + ": " +
         comm.who(rank_a) + " submitted " + a.str() + " but " + comm.who(rank_b) + " submitted " +
         b.str();
}

std::string p2p_mismatch(int from, std::uint64_t send_count, DType send_dtype, int to,
                         std::uint64_t recv_count, DType recv_dtype) {
  return "mismatched send/recv: rank " + std::to_string(from) + " sends " +
         std::to_string(send_count) + " " + std::string(to_string(send_dtype)) + " to rank " +
         std::to_string(to) + " but rank " + std::to_string(to) + " receives " +
         std::to_string(recv_count) + " " + std::string(to_string(recv_dtype)) + " from rank " +
         std::to_string(from);
}

std::string plan_mismatch(const Comm& comm, std::uint64_t seq, const Desc& desc,
                          const NodePlan& mine, int node, const NodePlan& theirs) {
  return "mismatched plans for sequence number " + std::to_string(seq) + ", " + desc.str() +
         ": node " + comm.node_text(comm.my_node) + " runs it as " + mine.str() + ", node " +
         comm.node_text(node) + " as " + theirs.str() +
         "; the daemons' profiles disagree (collectives.algorithm, collectives.direct_max_bytes, "
         "collectives.pairwise_max_nodes and tcp.chunk_bytes must be the same on every node)";
}

std::string ranks_text(const Comm& comm, int node) {
  std::vector<int> ranks;
  for (int r = 0; r < comm.nranks; ++r) {
    if (comm.node_of_rank[r] == node) ranks.push_back(r);
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

}  // namespace collectived::engine::detail
