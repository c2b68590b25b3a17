// Turns a matched operation into tasks for the worker pool. Every rank's
// buffers are mapped into the daemon, so the work is the reduction or the copy
// itself, done once, directly between client buffers.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "engine/dtype.h"
#include "engine/op.h"

namespace collectived::engine {

/// Everything the tasks of one collective need, per rank by index.
struct CollectivePlanInput {
  OpKind kind = OpKind::barrier;
  DType dtype = DType::uint8;
  RedOp redop = RedOp::sum;
  std::uint64_t count = 0;
  int root = 0;
  std::vector<Span> send;  ///< per rank (empty span where the rank sends nothing)
  std::vector<Span> recv;  ///< per rank
};

/// Splits a collective into tasks. `on_done` runs once, on the worker that
/// finishes the last task. Large operations are split so that every worker
/// gets a share; small ones are one task. Returns at least one task.
std::vector<std::function<void()>> plan_collective(CollectivePlanInput in, std::size_t workers,
                                                   std::function<void()> on_done);

/// A copy of `bytes` from `src` to `dst`, split like a collective.
std::vector<std::function<void()>> plan_copy(Span src, Span dst, std::size_t workers,
                                             std::function<void()> on_done);

}  // namespace collectived::engine
