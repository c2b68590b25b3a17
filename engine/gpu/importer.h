// Client GPU allocations opened in the daemon, once (runtime.cc's open()):
// legacy IPC handles cached by handle, cuMemCreate memory (one allocation, or
// the pieces a buffer spans, arriving one request after the other) and
// cudaMallocAsync pools. The executor's lock guards the cache.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "engine/gpu/executor.h"
#include "engine/gpu/executor_state.h"
#include "engine/gpu/mapping.h"
#include "engine/gpu/vmm_range.h"

namespace collectived::engine::gpu {

class Importer {
 public:
  explicit Importer(ExecutorState& state) : s_(state) {}
  Importer(const Importer&) = delete;
  Importer& operator=(const Importer&) = delete;

  /// The client allocation `a` opened on GPU `dev`; null while a
  /// registration of several pieces waits for the rest.
  std::shared_ptr<Mapping> open(std::uint64_t session, GpuRegisterArgs& a, int dev);
  /// Adds the open mappings and their bytes to `s` (under the executor's lock).
  void count_locked(GpuStatus& s) const;
  /// The client went away (under the lock): its unfinished registration goes.
  void forget_locked(std::uint64_t session);
  /// At the executor's end.
  void clear() { building_.clear(); }

 private:
  /// A registration of several cuMemCreate allocations whose pieces are
  /// still coming (RegisterGpu.pieces, one request after the other).
  struct Building {
    std::shared_ptr<VmmRange> vmm_building;
    int vmm_device = -1;  // its GPU
  };

  std::shared_ptr<Mapping> open_legacy(const GpuRegisterArgs& a, int dev);
  /// cuMemCreate memory: one allocation (a.fd), or the next pieces of a
  /// registration of several that one buffer spans (a.pieces: PyTorch's
  /// expandable segments), imported and mapped back to back into one range
  /// of the daemon's (VmmRange). Null while pieces are still to come: the
  /// range being filled waits in the session.
  std::shared_ptr<Mapping> open_vmm(std::uint64_t session, GpuRegisterArgs& a, int dev);
  std::shared_ptr<Mapping> open_pool(GpuRegisterArgs& a, int dev);

  ExecutorState& s_;
  std::map<std::string, std::weak_ptr<Mapping>> legacy_cache_;
  std::shared_ptr<std::atomic<std::uint32_t>> other_mappings_ =
      std::make_shared<std::atomic<std::uint32_t>>(0);
  std::map<std::uint64_t, Building> building_;  // by session
};

}  // namespace collectived::engine::gpu
