// What the parts of the CUDA executor (runtime.cc) share: the driver, the
// GPUs, the graveyard, the pinned pool and one lock. One lock rather than one
// per part: every operation's work is enqueued on the same daemon streams,
// in submission order, and the event pools, sessions and queued operations
// that enqueueing touches are guarded with it.
#pragma once

#include <memory>
#include <mutex>

#include "engine/gpu/cuda_check.h"
#include "engine/gpu/devices.h"
#include "engine/gpu/graveyard.h"
#include "engine/gpu/pinned_pool.h"
#include "engine/log.h"

namespace collectived::engine::gpu {

struct ExecutorState {
  explicit ExecutorState(Logger& l) : log(l) {}
  ExecutorState(const ExecutorState&) = delete;
  ExecutorState& operator=(const ExecutorState&) = delete;

  Logger& log;
  std::shared_ptr<CudaDriver> cu;  // mappings hold it too: they may outlive the executor
  mutable std::mutex mu;
  Devices devices;  // filled at start, then fixed; their event pools under mu
  std::shared_ptr<Graveyard> graveyard = std::make_shared<Graveyard>();
  std::shared_ptr<PinnedPool> pinned = std::make_shared<PinnedPool>();
};

}  // namespace collectived::engine::gpu
