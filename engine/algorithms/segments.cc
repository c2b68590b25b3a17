#include "engine/algorithms/segments.h"

namespace collectived::engine::algorithms {

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

std::vector<Segment> rank_segments(const std::vector<int>& node_of_rank, std::uint64_t block,
                                   int n) {
  std::vector<Segment> segs(n);
  for (std::size_t r = 0; r < node_of_rank.size(); ++r) {
    segs[node_of_rank[r]].push_back(Range{r * block, block});
  }
  return segs;
}

}  // namespace collectived::engine::algorithms
