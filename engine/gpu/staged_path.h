// Operations across nodes on GPU buffers (GpuExecutor::stage_in, stage_out,
// stage_out_early): each local rank's input copied to pinned host memory (in
// pieces that the exchange between nodes reads as they come), or left in the
// client's own host staging where the client staged it; the host collective
// runs there; the outputs go back to the GPUs, early where a chunk is final.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/gpu/completion.h"
#include "engine/gpu/executor.h"
#include "engine/gpu/executor_state.h"
#include "engine/gpu/pinned_pool.h"
#include "engine/gpu/rank_sync.h"

namespace collectived::engine::gpu {

/// A staged operation (across nodes): pinned host buffers per local rank.
class Stage final : public GpuStage {
 public:
  Stage(std::shared_ptr<PinnedPool> pool, std::shared_ptr<Graveyard> graveyard)
      : pool_(std::move(pool)), graveyard_(std::move(graveyard)) {}
  ~Stage() override {
    if (!early_events.empty()) {
      // Early copies back (stage_out_early) and no stage_out, which takes
      // their events (it failed): the GPU may still be copying from the
      // staging into the ranks' outputs.
      auto l = std::make_shared<StagingLeftovers>();
      l->syncs = std::move(op.sync);
      l->pool = pool_;
      l->blocks = std::move(blocks_);
      for (auto& [dev, e] : early_events) l->events.push_back(e);
      graveyard_->bury(std::move(l));
      return;
    }
    for (auto& [p, bytes] : blocks_) pool_->give(p, bytes);
  }
  Span take(std::uint64_t bytes) {
    if (bytes == 0) return {};
    std::uint64_t got = 0;
    std::byte* p = pool_->take(bytes, got);
    blocks_.emplace_back(p, got);
    return Span{nullptr, p, bytes};
  }
  GpuCollective op;
  std::size_t slot = 0;
  /// By rank: (offset, bytes) of its output copied back early, and one
  /// event per device (from the executor's pool) recorded after the latest
  /// of those copies, until stage_out takes them back to the pool.
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> early;
  std::vector<std::pair<int, cudaEvent_t>> early_events;

 private:
  std::shared_ptr<PinnedPool> pool_;
  std::shared_ptr<Graveyard> graveyard_;
  std::vector<std::pair<std::byte*, std::uint64_t>> blocks_;
};

class StagedPath {
 public:
  StagedPath(ExecutorState& state, Completion& completion) : s_(state), completion_(completion) {}
  StagedPath(const StagedPath&) = delete;
  StagedPath& operator=(const StagedPath&) = delete;

  /// GpuExecutor's calls of the same names (the executor checked that a GPU is there).
  std::shared_ptr<GpuStage> stage_in(GpuCollective op,
                                     std::function<void(Code, std::string)> ready);
  void stage_out(std::shared_ptr<GpuStage> gstage, std::function<void(Code, std::string)> done);
  void stage_out_early(GpuStage& gstage, int r, std::uint64_t offset, std::uint64_t bytes);

 private:
  using ReadyWords = std::vector<std::pair<const Sync*, std::uint32_t>>;

  // The parts of stage_in.
  /// Each rank's host staging (outside the lock: a first cudaHostAlloc of a
  /// size takes milliseconds); whether some rank was staged by its client.
  bool stage_buffers(const GpuCollective& op, Stage* st);
  /// Inputs in pieces where every local rank is staged by its client: each
  /// piece's ready values, by piece.
  std::vector<ReadyWords> by_client_pieces(const GpuCollective& op, Stage* st, Pending& p,
                                           std::uint32_t& pieces);
  /// Inputs in pieces copied by the daemon.
  void by_daemon_pieces(const GpuCollective& op, Stage* st, Pending& p, std::uint64_t& piece,
                        std::uint32_t& pieces);
  /// The copies to the host, each rank's stream hand-off first.
  void enqueue_inputs_locked(const GpuCollective& op, Stage* st, Pending& p,
                             std::vector<Pending>& later,
                             const std::vector<ReadyWords>& client_pieces, std::uint64_t piece,
                             std::uint32_t pieces);
  /// stage_out's copies of a chunk of a pipelined operation.
  void out_chunk_locked(const GpuCollective& op, Stage* st, Sync* s, int r, Pending& p);
  /// The first chunk of a pipelined staged operation to reach stage_in
  /// (under mu_): waits for the rank's input, then copies every chunk's input
  /// to the host, recording one event per chunk.
  void start_pipe(ChunkPipe& pp, const Sync& s, std::size_t slot, const std::string& who);

  ExecutorState& s_;
  Completion& completion_;
};

}  // namespace collectived::engine::gpu
