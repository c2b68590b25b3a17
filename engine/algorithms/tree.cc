#include "engine/algorithms/tree.h"

namespace collectived::engine::algorithms {

void tree_broadcast(Context& c, std::byte* buf, std::uint64_t bytes, int root,
                    std::uint64_t phase) {
  const int n = c.n();
  NodeChannel& ch = c.ch();
  const int v = c.mod(c.i() - root);
  int top = 1;
  while (top < n) top *= 2;
  int below = top;
  if (v == 0) {
    c.need(buf, bytes);
  } else {
    below = v & -v;
    const int parent = c.mod(v - below + root);
    NodePayload m = ch.recv(parent, c.tag(phase, 0, 0));
    expect_size(m, bytes, parent);
    copy_bytes(buf, m.data(), bytes);
    c.final(buf, bytes);
  }
  for (int mask = below >> 1; mask > 0; mask >>= 1) {
    if (v + mask < n) ch.send(c.mod(v + mask + root), c.tag(phase, 0, 0), buf, bytes);
  }
}

void tree_reduce(Context& c, std::byte* buf, std::uint64_t bytes, int root, DType dtype, RedOp op,
                 std::uint64_t phase) {
  const int n = c.n();
  NodeChannel& ch = c.ch();
  const int v = c.mod(c.i() - root);
  int top = 1;
  while (top < n) top *= 2;
  const int below = v == 0 ? top : (v & -v);
  for (int mask = 1; mask < below && v + mask < n; mask <<= 1) {
    const int child = c.mod(v + mask + root);
    NodePayload m = ch.recv(child, c.tag(phase, 0, 0));
    expect_size(m, bytes, child);
    if (bytes != 0) reduce2(dtype, op, buf, m.data(), bytes);
  }
  if (v == 0) {
    c.final(buf, bytes);
  } else {
    ch.send(c.mod(v - below + root), c.tag(phase, 0, 0), buf, bytes);
  }
}

}  // namespace collectived::engine::algorithms
