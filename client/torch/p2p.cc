// The point-to-point side of Backend: send, recv, gather, scatter and
// all-to-all, each one libcollective send/recv group (NCCL's model: the k-th
// send from a to b meets the k-th receive at b from a; tags are not matched,
// as ProcessGroupNCCL does not match them either).
#include <c10/util/Exception.h>

#include <numeric>

#include "client/torch/backend.h"
#include "client/torch/dtype.h"
#include "client/torch/launch.h"

namespace collectived::client::torch_backend {

namespace {

/// Opens the operation's group: its own, or (coalescing) the one that
/// endCoalescing closes.
class Group {
 public:
  Group(collective_comm_t* comm, Launch& op, bool coalescing, bool& open)
      : comm_(comm), op_(op), coalescing_(coalescing) {
    if (!coalescing || !open) op.call(collective_group_start(comm));
    if (coalescing) open = true;
  }
  void send(const at::Tensor& t, int peer, const char* what) {
    const std::size_t n = wire_count(t);
    if (n == 0) return;
    op_.call(collective_send(comm_, op_.in(t), n, wire_dtype(t, what), peer));
  }
  void recv(const at::Tensor& t, int peer, const char* what) {
    const std::size_t n = wire_count(t);
    if (n == 0) return;
    op_.call(collective_recv(comm_, op_.out(t), n, wire_dtype(t, what), peer));
  }
  /// Submits the group (not while coalescing: endCoalescing does).
  void end() {
    if (coalescing_) return;
    op_.call(op_.cuda() ? collective_group_end_stream(comm_, op_.stream(), op_.next())
                        : collective_group_end(comm_, op_.next()));
  }

 private:
  collective_comm_t* comm_;
  Launch& op_;
  bool coalescing_;
};

void check_peer(int peer, int size, const char* what) {
  TORCH_CHECK(peer >= 0 && peer < size, "collectived: ", what, ": rank ", peer,
              " is not in the group (", size, " ranks)");
}

}  // namespace

c10::intrusive_ptr<c10d::Work> Backend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  (void)tag;
  return point_to_point(tensors, dst, true);
}

c10::intrusive_ptr<c10d::Work> Backend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  (void)tag;
  return point_to_point(tensors, src, false);
}

c10::intrusive_ptr<c10d::Work> Backend::point_to_point(std::vector<at::Tensor>& tensors, int peer,
                                                       bool is_send) {
  std::lock_guard lock(mu_);
  const char* what = is_send ? "send" : "recv";
  TORCH_CHECK(tensors.size() == 1, "collectived: ", what, " takes one tensor, not ",
              tensors.size());
  check_peer(peer, getSize(), what);
  const at::Tensor& t = tensors[0];
  if (t.is_cuda() && !coalescing_) {
    // A lone send or receive of CUDA tensors goes through host memory: a
    // rank's stream-ordered groups complete in submission order, so a GPU
    // send posted before its rank's receive could not wait for the peer's
    // send (both ranks isend, then irecv). batch_isend_irecv keeps the GPU
    // path: its sends and receives are one group.
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU));
    if (is_send) host.copy_(t);  // after the caller's stream's work on it
    auto op = start(is_send ? c10d::OpType::SEND : c10d::OpType::RECV, what, host,
                    c10d::kUnsetTimeout);
    Group g(comm(), *op, false, group_open_);
    if (is_send) {
      g.send(host, peer, what);
    } else {
      g.recv(host, peer, what);
      op->then([t, host] { t.copy_(host); });  // before wait() returns
    }
    g.end();
    return finish(op, tensors);
  }
  auto op = start(is_send ? c10d::OpType::SEND : c10d::OpType::RECV, what, t, c10d::kUnsetTimeout);
  op->check(t, is_send ? "send" : "receive");
  Group g(comm(), *op, coalescing_, group_open_);
  if (is_send) {
    g.send(t, peer, what);
  } else {
    g.recv(t, peer, what);
  }
  g.end();
  return finish(op, tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false, "collectived: recv from any source is not supported (name the source "
              "rank; NCCL has no such receive either)");
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_splits,
                                                      std::vector<int64_t>& input_splits,
                                                      const c10d::AllToAllOptions& opts) {
  std::lock_guard lock(mu_);
  const int n = getSize();
  auto op = start(c10d::OpType::ALLTOALL_BASE, "all_to_all_single", input, opts.timeout);
  op->check(input, "input");
  op->check(output, "output");
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "collectived: all_to_all_single: "
              "the input is ", input.scalar_type(), ", the output ", output.scalar_type());
  const collective_dtype_t dt = wire_dtype(input, "all_to_all_single");
  if (output_splits.empty() && input_splits.empty()) {
    TORCH_CHECK(input.numel() == output.numel() && input.numel() % n == 0,
                "collectived: all_to_all_single with equal splits needs input and output of "
                "the same size, divisible by the group's ", n, " ranks (input ", input.numel(),
                ", output ", output.numel(), " elements)");
    const std::size_t count = wire_count(input) / static_cast<std::size_t>(n);
    if (count > 0) {
      const void* send = op->in(input);
      void* recv = op->out(output);
      op->call(op->cuda() ? collective_all_to_all_stream(comm(), send, recv, count, dt,
                                                         op->stream(), op->next())
                          : collective_all_to_all(comm(), send, recv, count, dt, op->next()));
    }
    return finish(op, {output});
  }
  // Uneven splits: one send and one receive per peer, in rows of the first
  // dimension (an empty split list means equal rows).
  auto split = [&](std::vector<int64_t> s, const at::Tensor& t, const char* which) {
    if (s.empty()) {
      TORCH_CHECK(t.size(0) % n == 0, "collectived: all_to_all_single: the ", which,
                  "'s first dimension ", t.size(0), " does not divide into ", n, " ranks");
      s.assign(n, t.size(0) / n);
    }
    TORCH_CHECK(static_cast<int>(s.size()) == n, "collectived: all_to_all_single: ", s.size(),
                " ", which, " splits for ", n, " ranks");
    TORCH_CHECK(std::accumulate(s.begin(), s.end(), int64_t{0}) == t.size(0),
                "collectived: all_to_all_single: the ", which, " splits do not add up to its ",
                "first dimension ", t.size(0));
    return s;
  };
  TORCH_CHECK(input.dim() > 0 && output.dim() > 0,
              "collectived: all_to_all_single with splits takes tensors of one dimension or more");
  const auto in_s = split(input_splits, input, "input");
  const auto out_s = split(output_splits, output, "output");
  // Whole tensors staged once (CPU), then pieces of them named per peer.
  const auto* in_base = static_cast<const std::byte*>(op->in(input));
  auto* out_base = static_cast<std::byte*>(op->out(output));
  const std::size_t in_row = input.numel() == 0 ? 0 : input.nbytes() / input.size(0);
  const std::size_t out_row = output.numel() == 0 ? 0 : output.nbytes() / output.size(0);
  const std::size_t esize = collective_dtype_size(dt);
  Group g(comm(), *op, coalescing_, group_open_);
  int64_t in_off = 0, out_off = 0;
  for (int p = 0; p < n; ++p) {
    if (in_s[p] > 0 && in_row > 0) {
      op->call(collective_send(comm(), in_base + in_off * in_row, in_s[p] * in_row / esize, dt, p));
    }
    if (out_s[p] > 0 && out_row > 0) {
      op->call(collective_recv(comm(), out_base + out_off * out_row, out_s[p] * out_row / esize,
                               dt, p));
    }
    in_off += in_s[p];
    out_off += out_s[p];
  }
  g.end();
  return finish(op, {output});
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs,
                                                 std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  std::lock_guard lock(mu_);
  const int n = getSize();
  TORCH_CHECK(static_cast<int>(inputs.size()) == n && static_cast<int>(outputs.size()) == n,
              "collectived: all_to_all takes ", n, " inputs and ", n, " outputs");
  auto op = start(c10d::OpType::ALLTOALL, "all_to_all", inputs[0], opts.timeout);
  Group g(comm(), *op, coalescing_, group_open_);
  for (int p = 0; p < n; ++p) {
    op->check(inputs[p], "input");
    op->check(outputs[p], "output");
    g.send(inputs[p], p, "all_to_all");
    g.recv(outputs[p], p, "all_to_all");
  }
  g.end();
  return finish(op, outputs);
}

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::GatherOptions& opts) {
  std::lock_guard lock(mu_);
  const int root = static_cast<int>(opts.rootRank);
  check_peer(root, getSize(), "gather");
  TORCH_CHECK(inputs.size() == 1, "collectived: gather takes one input tensor");
  const at::Tensor& in = inputs[0];
  auto op = start(c10d::OpType::GATHER, "gather", in, opts.timeout);
  op->check(in, "input");
  std::vector<at::Tensor> result;
  if (getRank() == root) {
    TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                "collectived: gather's root takes one list of ", getSize(), " outputs");
    result = outputs[0];
    for (int p = 0; p < getSize(); ++p) {
      op->check(result[p], "output");
      TORCH_CHECK(result[p].numel() == in.numel() && result[p].scalar_type() == in.scalar_type(),
                  "collectived: gather: output ", p, " must have the input's ", in.numel(),
                  " elements of ", in.scalar_type());
    }
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "collectived: gather: only the root (rank ", root, ") takes outputs");
  }
  Group g(comm(), *op, coalescing_, group_open_);
  g.send(in, root, "gather");  // the root sends to itself: one path for every rank
  for (std::size_t p = 0; p < result.size(); ++p) g.recv(result[p], static_cast<int>(p), "gather");
  g.end();
  return finish(op, result);
}

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  std::lock_guard lock(mu_);
  const int root = static_cast<int>(opts.rootRank);
  check_peer(root, getSize(), "scatter");
  TORCH_CHECK(outputs.size() == 1, "collectived: scatter takes one output tensor");
  const at::Tensor& out = outputs[0];
  auto op = start(c10d::OpType::SCATTER, "scatter", out, opts.timeout);
  op->check(out, "output");
  std::vector<at::Tensor> sources;
  if (getRank() == root) {
    TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                "collectived: scatter's root takes one list of ", getSize(), " inputs");
    sources = inputs[0];
    for (int p = 0; p < getSize(); ++p) {
      op->check(sources[p], "input");
      TORCH_CHECK(sources[p].numel() == out.numel() && sources[p].scalar_type() == out.scalar_type(),
                  "collectived: scatter: input ", p, " must have the output's ", out.numel(),
                  " elements of ", out.scalar_type());
    }
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "collectived: scatter: only the root (rank ", root, ") takes inputs");
  }
  Group g(comm(), *op, coalescing_, group_open_);
  for (std::size_t p = 0; p < sources.size(); ++p) g.send(sources[p], static_cast<int>(p), "scatter");
  g.recv(out, root, "scatter");
  g.end();
  return finish(op, outputs);
}

}  // namespace collectived::client::torch_backend
