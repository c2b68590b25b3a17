#include "engine/algorithms/chain.h"

#include <memory>

namespace collectived::engine::algorithms {

void chain_broadcast(Context& c, std::byte* buf, std::uint64_t bytes, int root,
                     std::uint64_t phase) {
  const int n = c.n(), i = c.i();
  NodeChannel& ch = c.ch();
  const int pos = c.mod(i - root);
  const int prev = c.mod(i - 1), next = c.mod(i + 1);
  const bool has_next = pos + 1 < n;
  const std::uint64_t nc = std::max<std::uint64_t>(c.chunks(bytes), 1);
  for (std::uint64_t k = 0; pos != 0 && k < nc; ++k) {
    // Each chunk may be read straight into place, and is forwarded from there.
    const auto [from, to] = c.chunk_span(bytes, k);
    ch.post(prev, c.tag(phase, 0, k), {buf + from, to - from});
  }
  if (c.broadcast_waits(bytes)) {
    if (pos != 0) c.tell_ready(prev, phase);
    if (has_next) c.await_ready(next, phase);
  }
  for (std::uint64_t k = 0; k < nc; ++k) {
    const auto [from, to] = c.chunk_span(bytes, k);
    const std::uint64_t len = to - from;
    if (pos == 0) {
      c.need(buf + from, len);
      ch.send(next, c.tag(phase, 0, k), buf + from, len);
      continue;
    }
    auto m = std::make_shared<NodePayload>(ch.recv(prev, c.tag(phase, 0, k)));
    expect_size(*m, len, prev);
    if (has_next) ch.send(next, c.tag(phase, 0, k), m->data(), m->size, m);
    copy_bytes(buf + from, m->data(), len);
    c.final(buf + from, len);
  }
}

void chain_reduce(Context& c, std::byte* buf, std::uint64_t bytes, int root, DType dtype, RedOp op,
                  std::uint64_t phase) {
  const int n = c.n(), i = c.i();
  NodeChannel& ch = c.ch();
  const int pos = c.mod(i - root - 1);
  const int prev = c.mod(i - 1), next = c.mod(i + 1);
  const std::uint64_t nc = std::max<std::uint64_t>(c.chunks(bytes), 1);
  for (std::uint64_t k = 0; k < nc; ++k) {
    const auto [from, to] = c.chunk_span(bytes, k);
    const std::uint64_t len = to - from;
    if (pos > 0) {
      NodePayload m = ch.recv(prev, c.tag(phase, 0, k));
      expect_size(m, len, prev);
      if (len != 0) reduce2(dtype, op, buf + from, m.data(), len);
      if (pos + 1 == n) c.final(buf + from, len);  // the root: reduced over every node
    }
    if (pos + 1 < n) ch.send(next, c.tag(phase, 0, k), buf + from, len);
  }
}

}  // namespace collectived::engine::algorithms
