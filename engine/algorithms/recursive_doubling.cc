#include "engine/algorithms/recursive_doubling.h"

namespace collectived::engine::algorithms {

void recursive_doubling_all_reduce(Context& c, std::byte* buf, std::uint64_t bytes, DType dtype,
                                   RedOp op, std::uint64_t phase) {
  const int n = c.n(), i = c.i();
  NodeChannel& ch = c.ch();
  int p = 1;
  while (p * 2 <= n) p *= 2;
  const int r = n - p;
  const std::uint64_t count = bytes / dtype_size(dtype);
  auto node_of = [r](int v) { return v < r ? 2 * v + 1 : v + r; };
  // Steps: 0..log2(p)-1 the rounds (on 2 nodes: the direct exchange's
  // message), then the hand-over and the hand-back.
  int rounds = 0;
  for (int m = 1; m < p; m <<= 1) ++rounds;
  const std::uint64_t over = static_cast<std::uint64_t>(rounds), back = over + 1;
  auto combine = [&](const std::byte* lower, const std::byte* upper) {
    const void* srcs[2] = {lower, upper};
    if (count != 0) reduce(dtype, op, buf, srcs, 2, count, 1);
  };
  int v = 0;
  if (i < 2 * r && i % 2 == 0) {
    ch.send(i + 1, c.tag(phase, over, 0), buf, bytes);
    NodePayload m = ch.recv(i + 1, c.tag(phase, back, 0));
    expect_size(m, bytes, i + 1);
    ch.flush();  // `buf` went out in place
    copy_bytes(buf, m.data(), bytes);
    return;
  }
  if (i < 2 * r) {
    NodePayload m = ch.recv(i - 1, c.tag(phase, over, 0));
    expect_size(m, bytes, i - 1);
    combine(m.data(), buf);
    v = i / 2;
  } else {
    v = i - r;
  }
  std::uint64_t step = 0;
  for (int mask = 1; mask < p; mask <<= 1, ++step) {
    const int pv = v ^ mask, peer = node_of(pv);
    ch.send(peer, c.tag(phase, step, 0), buf, bytes);
    NodePayload m = ch.recv(peer, c.tag(phase, step, 0));
    expect_size(m, bytes, peer);
    ch.flush();  // `buf` went out in place and is overwritten now
    if (pv < v) {
      combine(m.data(), buf);
    } else {
      combine(buf, m.data());
    }
  }
  if (i < 2 * r) ch.send(i - 1, c.tag(phase, back, 0), buf, bytes);
}

}  // namespace collectived::engine::algorithms
