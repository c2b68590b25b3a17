// The collectives of Backend: all-reduce, broadcast, reduce, all-gather,
// reduce-scatter and barrier, each one libcollective call per tensor.
#include <c10/util/Exception.h>

#include "client/torch/backend.h"
#include "client/torch/dtype.h"
#include "client/torch/launch.h"

namespace collectived::client::torch_backend {

namespace {

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* what) {
  TORCH_CHECK(tensors.size() == 1, "collectived: ", what, " takes one tensor per process, not ",
              tensors.size());
  return tensors[0];
}

/// PREMUL_SUM's input: `t` times the factor, a new tensor (on the internal
/// stream for CUDA tensors: the launch made it current).
at::Tensor premultiplied(const at::Tensor& t, const Reduction& r) {
  if (r.factor_tensor.defined()) return t * r.factor_tensor.to(t.device(), t.scalar_type());
  return t * r.factor;
}

/// One pair of a *_tensor operation: both tensors checked, of one dtype, the
/// larger `times` the smaller (the group's size).
void check_pair(const Launch& op, const at::Tensor& small, const at::Tensor& large, int times,
                const char* what, const char* small_role, const char* large_role) {
  op.check(small, small_role);
  op.check(large, large_role);
  TORCH_CHECK(small.scalar_type() == large.scalar_type(), "collectived: ", what, ": the ",
              small_role, " is ", small.scalar_type(), ", the ", large_role, " ",
              large.scalar_type());
  TORCH_CHECK(large.numel() == small.numel() * times, "collectived: ", what, ": the ", large_role,
              " has ", large.numel(), " elements, not ", times, " x ", small.numel());
}

}  // namespace

c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  c10d::AllreduceCoalescedOptions o;
  o.reduceOp = opts.reduceOp;
  o.timeout = opts.timeout;
  single(tensors, "all_reduce");
  return allreduce_coalesced(tensors, o);
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  std::lock_guard lock(mu_);
  TORCH_CHECK(!tensors.empty(), "collectived: all_reduce of no tensors");
  auto op = start(c10d::OpType::ALLREDUCE, "all_reduce", tensors[0], opts.timeout);
  for (const auto& t : tensors) {
    op->check(t, "input");
    const collective_dtype_t dt = wire_dtype(t, "all_reduce");
    const Reduction r = wire_reduction(opts.reduceOp, t, "all_reduce");
    const std::size_t n = wire_count(t);
    if (n == 0) continue;
    const void* send;
    void* recv;
    if (r.premul) {
      const at::Tensor scaled = premultiplied(t, r);
      send = op->in(scaled);
      recv = op->out(t);
    } else {
      recv = op->inout(t);
      send = recv;
    }
    op->call(op->cuda() ? collective_all_reduce_stream(comm(), send, recv, n, dt, r.op,
                                                       op->stream(), op->next())
                        : collective_all_reduce(comm(), send, recv, n, dt, r.op, op->next()));
  }
  return finish(op, tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::broadcast(std::vector<at::Tensor>& tensors,
                                                  const c10d::BroadcastOptions& opts) {
  std::lock_guard lock(mu_);
  const at::Tensor& t = single(tensors, "broadcast");
  auto op = start(c10d::OpType::BROADCAST, "broadcast", t, opts.timeout);
  op->check(t, "input");
  const collective_dtype_t dt = wire_dtype(t, "broadcast");
  const std::size_t n = wire_count(t);
  const int root = static_cast<int>(opts.rootRank);
  if (n > 0) {
    void* p = root == getRank() ? op->inout(t) : op->out(t);
    op->call(op->cuda() ? collective_broadcast_stream(comm(), p, p, n, dt, root, op->stream(),
                                                      op->next())
                        : collective_broadcast(comm(), p, p, n, dt, root, op->next()));
  }
  return finish(op, tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors,
                                               const c10d::ReduceOptions& opts) {
  std::lock_guard lock(mu_);
  const at::Tensor& t = single(tensors, "reduce");
  auto op = start(c10d::OpType::REDUCE, "reduce", t, opts.timeout);
  op->check(t, "input");
  const collective_dtype_t dt = wire_dtype(t, "reduce");
  const Reduction r = wire_reduction(opts.reduceOp, t, "reduce");
  const std::size_t n = wire_count(t);
  const int root = static_cast<int>(opts.rootRank);
  if (n > 0) {
    const bool is_root = root == getRank();
    const void* send;
    void* recv;
    if (r.premul) {
      send = op->in(premultiplied(t, r));
      recv = is_root ? op->out(t) : const_cast<void*>(send);
    } else {
      recv = is_root ? op->inout(t) : const_cast<void*>(op->in(t));
      send = recv;
    }
    op->call(op->cuda() ? collective_reduce_stream(comm(), send, recv, n, dt, r.op, root,
                                                   op->stream(), op->next())
                        : collective_reduce(comm(), send, recv, n, dt, r.op, root, op->next()));
  }
  return finish(op, tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return allgather_into_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  std::lock_guard lock(mu_);
  TORCH_CHECK(!inputs.empty() && outputs.size() == inputs.size(),
              "collectived: all_gather_into_tensor takes as many outputs as inputs (",
              outputs.size(), " and ", inputs.size(), ")");
  auto op = start(c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", inputs[0],
                  opts.timeout);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& in = inputs[i];
    const at::Tensor& out = outputs[i];
    check_pair(*op, in, out, getSize(), "all_gather_into_tensor", "input", "output");
    const collective_dtype_t dt = wire_dtype(in, "all_gather_into_tensor");
    const std::size_t n = wire_count(in);
    if (n == 0) continue;
    void* recv = op->out(out);
    const void* send = op->in(in);
    op->call(op->cuda() ? collective_all_gather_stream(comm(), send, recv, n, dt, op->stream(),
                                                       op->next())
                        : collective_all_gather(comm(), send, recv, n, dt, op->next()));
  }
  return finish(op, outputs);
}

c10::intrusive_ptr<c10d::Work> Backend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::AllgatherOptions& opts) {
  std::lock_guard lock(mu_);
  const at::Tensor& in = single(inputs, "all_gather");
  TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
              "collectived: all_gather takes one list of ", getSize(), " output tensors");
  auto op = start(c10d::OpType::ALLGATHER, "all_gather", in, opts.timeout);
  op->check(in, "input");
  for (const auto& o : outputs[0]) {
    TORCH_CHECK(o.numel() == in.numel() && o.scalar_type() == in.scalar_type(),
                "collectived: all_gather: every output must have the input's ", in.numel(),
                " elements of ", in.scalar_type());
    TORCH_CHECK(o.device() == in.device(), "collectived: all_gather: outputs on ", o.device(),
                ", the input on ", in.device());
  }
  const collective_dtype_t dt = wire_dtype(in, "all_gather");
  const std::size_t n = wire_count(in);
  if (n > 0) {
    // Gathered into one flat tensor, then copied into the list (the list's
    // tensors are separate allocations).
    at::Tensor flat = at::empty({getSize() * in.numel()}, in.options());
    const void* send = op->in(in);
    void* recv = op->out(flat);
    op->call(op->cuda() ? collective_all_gather_stream(comm(), send, recv, n, dt, op->stream(),
                                                       op->next())
                        : collective_all_gather(comm(), send, recv, n, dt, op->next()));
    std::vector<at::Tensor> list = outputs[0];
    op->then([flat, list, m = in.numel()] {
      for (std::size_t r = 0; r < list.size(); ++r) {
        list[r].copy_(flat.narrow(0, static_cast<int64_t>(r) * m, m).view_as(list[r]));
      }
    });
  }
  return finish(op, outputs[0]);
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // Each input gathered as allgather does, under one Work.
  TORCH_CHECK(outputs.size() == inputs.size(), "collectived: allgather_coalesced takes one "
              "output list per input");
  std::lock_guard lock(mu_);
  const bool was = coalescing_;
  if (!was) startCoalescing();
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::vector<std::vector<at::Tensor>> o{outputs[i]};
    std::vector<at::Tensor> in{inputs[i]};
    allgather(o, in, opts);
  }
  if (was) return c10::make_intrusive<Work>(getRank(), c10d::OpType::ALLGATHER_COALESCED,
                                            "allgather_coalesced", std::vector<at::Tensor>{},
                                            nullptr, config_.timeout);
  return endCoalescing();
}

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> outs{output}, ins{input};
  return reduce_scatter_tensor_coalesced(outs, ins, opts);
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  std::lock_guard lock(mu_);
  TORCH_CHECK(!inputs.empty() && outputs.size() == inputs.size(),
              "collectived: reduce_scatter_tensor takes as many outputs as inputs (",
              outputs.size(), " and ", inputs.size(), ")");
  auto op = start(c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", inputs[0],
                  opts.timeout);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& in = inputs[i];
    const at::Tensor& out = outputs[i];
    check_pair(*op, out, in, getSize(), "reduce_scatter_tensor", "output", "input");
    const collective_dtype_t dt = wire_dtype(out, "reduce_scatter_tensor");
    const Reduction r = wire_reduction(opts.reduceOp, out, "reduce_scatter_tensor");
    const std::size_t n = wire_count(out);
    if (n == 0) continue;
    void* recv = op->out(out);
    const void* send = op->in(r.premul ? premultiplied(in, r) : in);
    op->call(op->cuda() ? collective_reduce_scatter_stream(comm(), send, recv, n, dt, r.op,
                                                           op->stream(), op->next())
                        : collective_reduce_scatter(comm(), send, recv, n, dt, r.op, op->next()));
  }
  return finish(op, outputs);
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  std::lock_guard lock(mu_);
  const at::Tensor& out = single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
              "collectived: reduce_scatter takes one list of ", getSize(), " input tensors");
  for (const auto& i : inputs[0]) {
    TORCH_CHECK(i.numel() == out.numel() && i.scalar_type() == out.scalar_type() &&
                    i.device() == out.device(),
                "collectived: reduce_scatter: every input must have the output's ", out.numel(),
                " elements of ", out.scalar_type(), " on ", out.device());
  }
  // The list flattened into one input (on the internal stream for CUDA).
  auto op = start(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", out, opts.timeout);
  op->check(out, "output");
  at::Tensor flat = at::empty({getSize() * out.numel()}, out.options());
  for (int r = 0; r < getSize(); ++r) {
    flat.narrow(0, static_cast<int64_t>(r) * out.numel(), out.numel())
        .copy_(inputs[0][r].reshape({-1}));
  }
  const collective_dtype_t dt = wire_dtype(out, "reduce_scatter");
  const Reduction r = wire_reduction(opts.reduceOp, out, "reduce_scatter");
  const std::size_t n = wire_count(out);
  if (n > 0) {
    void* recv = op->out(out);
    const void* send = op->in(r.premul ? premultiplied(flat, r) : flat);
    op->call(op->cuda() ? collective_reduce_scatter_stream(comm(), send, recv, n, dt, r.op,
                                                           op->stream(), op->next())
                        : collective_reduce_scatter(comm(), send, recv, n, dt, r.op, op->next()));
  }
  return finish(op, outputs);
}

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  std::lock_guard lock(mu_);
  // A host-side barrier: the Work completes once every rank arrived.
  auto op = start(c10d::OpType::BARRIER, "barrier", at::Tensor(), opts.timeout);
  op->call(collective_barrier(comm(), op->next()));
  return finish(op, {});
}

}  // namespace collectived::client::torch_backend
