#include "engine/algorithms/exchange.h"

#include <cstring>

namespace collectived::engine {

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

}  // namespace collectived::engine

namespace collectived::engine::algorithms {

void exchange_all_to_all(Context& c, const NodeCollective& op, std::uint64_t one) {
  const int n = c.n(), me = c.i();
  NodeChannel& ch = c.ch();
  const auto& L = op.local;
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
    ch.send(j, c.tag(1, 0, 0), pieces, nullptr);
  }
  for (std::size_t k = 0; k < L.size(); ++k) {
    for (const auto& b : L) std::memcpy(b.recv + L[k].rank * one, src[k] + b.rank * one, one);
  }
  for (int j = 0; j < n; ++j) {
    if (j == me) continue;
    NodePayload m = ch.recv(j, c.tag(1, 0, 0));
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
}

}  // namespace collectived::engine::algorithms
