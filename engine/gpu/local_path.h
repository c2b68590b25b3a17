// Operations whose ranks are all on this node (GpuExecutor::run): every
// rank's stream hand-off, each executing GPU's share (KernelShare), the join
// on the lead GPU and the release of every rank's stream, queued for the
// completion thread (Completion).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/gpu/completion.h"
#include "engine/gpu/executor.h"
#include "engine/gpu/executor_state.h"

namespace collectived::engine::gpu {

class LocalPath {
 public:
  LocalPath(ExecutorState& state, Completion& completion, const GpuOptions& options);
  LocalPath(const LocalPath&) = delete;
  LocalPath& operator=(const LocalPath&) = delete;

  /// GpuExecutor::run (the executor checked that a GPU is there).
  void run(GpuCollective op, std::function<void(Code, std::string)> done);

 private:
  // The steps of run(), under the executor's lock.
  void wait_for_inputs_locked(const GpuCollective& op, const std::vector<int>& exec,
                              std::size_t slot, Pending& p);
  void enqueue_shares_locked(const GpuCollective& op, const std::vector<int>& rank_dev,
                             const std::vector<int>& exec, std::size_t slot, Pending& p);
  void join_locked(GpuCollective& op, const std::vector<int>& exec, std::size_t slot, Pending& p);
  /// A pooled event of GPU `dev`, returned to the pool with `p`'s.
  cudaEvent_t take_event(Pending& p, int dev);
  cudaStream_t stream_of(int dev, std::size_t slot) { return s_.devices[dev].streams[slot]; }
  /// GpuOptions::debug_sync: synchronize after each step of an operation
  /// and name the step that failed (diagnosis only: it blocks).
  void debug_sync(const std::vector<int>& exec, std::size_t slot, const char* step);

  ExecutorState& s_;
  Completion& completion_;
  const bool debug_sync_;  // GpuOptions::debug_sync
  // Bytes per rank up to which one GPU runs the whole operation (one-shot);
  // above, every GPU computes its share. GpuOptions::one_shot_bytes overrides.
  const std::uint64_t one_shot_bytes_;
  const bool one_shot_env_;
  // Copies from one GPU to another of at least this many bytes go to the
  // copy engines (cudaMemcpyAsync over the peer mapping) instead of the copy
  // kernel; 0: always the kernel (profile gpu.copy_engine_min_bytes).
  const std::uint64_t copy_engine_min_bytes_;
  // A broadcast split over this many GPUs or more takes two steps
  // (broadcast_step; profile gpu.two_step_min_gpus).
  const int two_step_min_gpus_;
};

}  // namespace collectived::engine::gpu
