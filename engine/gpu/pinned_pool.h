// Pinned host memory for staging GPU buffers through the host (across nodes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/gpu/cuda_check.h"
#include "engine/gpu/executor.h"

namespace collectived::engine::gpu {

/// Pinned host buffers for staging (cudaHostAlloc, portable): allocated on
/// first need, kept and reused (allocation costs ~ms per 100 MiB).
class PinnedPool {
 public:
  ~PinnedPool() {
    for (auto& [bytes, p] : free_) cudaFreeHost(p);
  }
  std::byte* take(std::uint64_t bytes, std::uint64_t& got) {
    {
      std::lock_guard lock(mu_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes + (std::uint64_t{4} << 20)) {
        got = it->first;
        std::byte* p = it->second;
        free_.erase(it);
        return p;
      }
    }
    got = (bytes + (std::uint64_t{2} << 20) - 1) & ~((std::uint64_t{2} << 20) - 1);
    void* p = nullptr;
    check_rt(cudaHostAlloc(&p, got, cudaHostAllocPortable),
             "cudaHostAlloc of " + std::to_string(got) + " bytes of host staging");
    return static_cast<std::byte*>(p);
  }
  void give(std::byte* p, std::uint64_t bytes) {
    std::lock_guard lock(mu_);
    free_.emplace(bytes, p);
  }

 private:
  std::mutex mu_;
  std::multimap<std::uint64_t, std::byte*> free_;
};

/// Pinned staging the GPU may still be copying into or out of: an operation
/// that ended (failed) with its copies enqueued. The reaper waits for the
/// copies' events before the staging goes back to the pool, and before the
/// ranks' streams are released from the CPU (the last RankSync holder does
/// that).
struct StagingLeftovers {
  std::vector<std::shared_ptr<RankSync>> syncs;  // destroyed last
  std::shared_ptr<PinnedPool> pool;
  std::vector<std::pair<std::byte*, std::uint64_t>> blocks;
  std::vector<cudaEvent_t> events;  // on one stream, only the last one waits
  ~StagingLeftovers() {
    for (auto e : events) {
      cudaEventSynchronize(e);
      cudaEventDestroy(e);
    }
    for (auto& [p, bytes] : blocks) pool->give(p, bytes);
  }
};

}  // namespace collectived::engine::gpu
