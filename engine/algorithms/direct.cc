#include "engine/algorithms/direct.h"

namespace collectived::engine::algorithms {

void direct_all_gather(Context& c, std::byte* buf, const std::vector<Segment>& segs,
                       std::uint64_t phase) {
  const int n = c.n(), i = c.i();
  NodeChannel& ch = c.ch();
  const std::uint64_t mine = segment_bytes(segs[i]);
  const auto pieces = pieces_of(buf, segs[i], 0, mine);
  for (int j = 0; j < n; ++j) {
    if (j != i) ch.send(j, c.tag(phase, 0, 0), pieces, nullptr);
  }
  for (int j = 0; j < n; ++j) {
    if (j == i) continue;
    NodePayload m = ch.recv(j, c.tag(phase, 0, 0));
    const std::uint64_t total = segment_bytes(segs[j]);
    expect_size(m, total, j);
    for_pieces(buf, segs[j], 0, total, [&](std::byte* p, std::uint64_t off, std::uint64_t len) {
      std::memcpy(p, m.data() + off, len);
      c.final(p, len);
    });
  }
}

void direct_all_reduce(Context& c, std::byte* buf, std::uint64_t bytes, DType dtype, RedOp op,
                       std::uint64_t phase) {
  const int n = c.n(), i = c.i();
  NodeChannel& ch = c.ch();
  for (int j = 0; j < n; ++j) {
    if (j != i) ch.send(j, c.tag(phase, 0, 0), buf, bytes);
  }
  std::vector<NodePayload> in(n);
  std::vector<const void*> srcs(n);
  for (int j = 0; j < n; ++j) {
    if (j == i) {
      srcs[j] = buf;
      continue;
    }
    in[j] = ch.recv(j, c.tag(phase, 0, 0));
    expect_size(in[j], bytes, j);
    srcs[j] = in[j].data();
  }
  ch.flush();  // `buf` went out in place and is overwritten now
  reduce(dtype, op, buf, srcs.data(), srcs.size(), bytes / dtype_size(dtype), 1);
}

void direct_broadcast(Context& c, std::byte* buf, std::uint64_t bytes, int root,
                      std::uint64_t phase) {
  const int n = c.n(), i = c.i();
  NodeChannel& ch = c.ch();
  if (i == root) {
    c.need(buf, bytes);
    for (int j = 0; j < n; ++j) {
      if (j != i) ch.send(j, c.tag(phase, 0, 0), buf, bytes);
    }
  } else {
    NodePayload m = ch.recv(root, c.tag(phase, 0, 0));
    expect_size(m, bytes, root);
    copy_bytes(buf, m.data(), bytes);
    c.final(buf, bytes);
  }
}

}  // namespace collectived::engine::algorithms
