// The GPU executor with CUDA: client allocations opened once and cached, the
// clients' flag pages and interprocess events, pooled streams and events per
// GPU, and collectives as kernels over the peer mappings (engine/gpu/kernels.cu).
//
// Stream hand-off for one operation (docs/gpu.md):
//   client stream: ... producer ... | record IPC event E_r | wait flag[w_r] >= t_r | ...
//   daemon streams: wait E_0..E_n-1 | kernels | join | write flag[w_r] = t_r for every rank
// The client's wait is enqueued at submission, before the daemon has done anything:
// a stream memory operation on a word of a shared page, not an event, because
// cuStreamWaitEvent waits for the event's most recent record at the time of the
// call, and the daemon records nothing until every rank has submitted.
//
// The executor is a facade over parts with one job each: the GPUs and their
// pooled streams and events (devices.h), client allocations opened once
// (importer.h), clients' flag pages and the RankSync per rank (sessions.h),
// operations inside the node (local_path.h, kernel_share.h) and across nodes
// through host memory (staged_path.h), and the completion thread with the
// deadlines (completion.h). They share one lock (executor_state.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <thread>

#include "engine/gpu/completion.h"
#include "engine/gpu/executor.h"
#include "engine/gpu/executor_state.h"
#include "engine/gpu/importer.h"
#include "engine/gpu/local_path.h"
#include "engine/gpu/mps.h"
#include "engine/gpu/sessions.h"
#include "engine/gpu/staged_path.h"
#include "engine/log.h"

namespace collectived::engine::gpu {
namespace {

class CudaExecutor final : public GpuExecutor {
 public:
  CudaExecutor(Logger& log, const GpuOptions& options)
      : log_(log),
        stage_chunk_bytes_(options.stage_chunk_bytes),
        state_(log),
        importer_(state_),
        sessions_(state_),
        completion_(state_),
        local_(state_, completion_, options),
        staged_(state_, completion_) {
    // Every kernel loaded when the context is made. With lazy loading (the
    // default since CUDA 12.2) the first launch of each kernel loads it, and
    // loading may synchronize the context: a launch enqueued behind a stream
    // that waits for a client's input (which may never come) then blocked the
    // daemon's event loop -- the "client killed while queued" hang.
    ::setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    status_.mps = options.mps;
    mps_ = std::make_unique<MpsControl>(log, options.mps);
    status_.mps_reason = mps_->reason();
    status_.mps_active = mps_->active();
    try {
      init();
      status_.available = true;
    } catch (const Error& e) {
      status_.available = false;
      status_.reason = e.what();
      log_.info("gpu_unavailable", {{"reason", e.what()}});
      return;
    }
    completion_.start();
    reaper_ = std::thread([this] { state_.graveyard->reap(); });
  }

  ~CudaExecutor() override {
    completion_.stop();
    sessions_.clear();
    importer_.clear();
    state_.graveyard->close();
    if (reaper_.joinable()) reaper_.join();
    for (auto& g : state_.graveyard->take()) g.reset();
    state_.devices.destroy();
  }

  GpuStatus status() const override {
    std::lock_guard lock(state_.mu);
    GpuStatus s = status_;
    s.mappings = 0;
    s.mapped_bytes = 0;
    importer_.count_locked(s);
    return s;
  }

  std::shared_ptr<DeviceMemory> open(std::uint64_t session, GpuRegisterArgs a) override {
    require();
    const int dev = state_.devices.of(a.device_uuid);
    std::shared_ptr<Mapping> m = importer_.open(session, a, dev);
    if (!m) return nullptr;  // more pieces to come
    return std::make_shared<Registered>(std::move(m), a.buffer_id, state_.graveyard);
  }

  void attach_flags(std::uint64_t session, UniqueFd memfd, std::uint64_t bytes) override {
    require();
    sessions_.attach_flags(session, std::move(memfd), bytes);
  }

  std::shared_ptr<RankSync> make_sync(std::uint64_t session, const GpuSyncArgs& a) override {
    require();
    return sessions_.make_sync(session, a);
  }

  std::vector<std::shared_ptr<RankSync>> make_chunked(std::uint64_t session,
                                                      const GpuSyncArgs& args,
                                                      ChunkedArgs chunked) override {
    require();
    return sessions_.make_chunked(session, args, std::move(chunked));
  }

  std::uint64_t stage_chunk_bytes() const override { return stage_chunk_bytes_; }

  void client_gone(std::uint64_t session) override {
    std::lock_guard lock(state_.mu);
    sessions_.forget_locked(session);
    importer_.forget_locked(session);
    completion_.client_gone_locked(session);
  }

  void run(GpuCollective op, std::function<void(Code, std::string)> done) override {
    require();
    local_.run(std::move(op), std::move(done));
  }

  std::shared_ptr<GpuStage> stage_in(GpuCollective op,
                                     std::function<void(Code, std::string)> ready) override {
    require();
    return staged_.stage_in(std::move(op), std::move(ready));
  }

  void stage_out(std::shared_ptr<GpuStage> gstage,
                 std::function<void(Code, std::string)> done) override {
    require();
    staged_.stage_out(std::move(gstage), std::move(done));
  }

  void stage_out_early(GpuStage& gstage, int r, std::uint64_t offset,
                       std::uint64_t bytes) override {
    staged_.stage_out_early(gstage, r, offset, bytes);
  }

 private:
  void require() const {
    if (!status_.available) throw Error(Code::unavailable, status_.reason);
  }

  void init() {
    state_.cu = CudaDriver::load();
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
      throw Error(Code::unavailable, std::string("no GPU: cudaGetDeviceCount: ") +
                                         (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
    }
    state_.devices.open(count, status_.devices);
    status_.reason = "CUDA driver API " + std::to_string(state_.cu->driver_version()) + ", " +
                     std::to_string(count) + " GPU(s)";
    log_.info("gpu_ready",
              {{"devices", count}, {"driver", state_.cu->driver_version()}, {"mps", status_.mps}});
  }

  Logger& log_;
  // Across nodes, operations of more than this many bytes per rank (count x
  // element size) are cut into chunks of it, so that the copies to and from
  // host memory overlap the exchange between nodes (0: never cut, the
  // default: what it gains depends on the host path between the daemons;
  // docs/gpu.md, "Pipelined"). Every daemon of a cluster must use the same
  // value (profile gpu.stage_chunk_bytes).
  const std::uint64_t stage_chunk_bytes_;
  std::unique_ptr<MpsControl> mps_;
  GpuStatus status_;
  // After mps_: the pinned pool goes back before the MPS daemon stops.
  ExecutorState state_;
  Importer importer_;
  Sessions sessions_;
  Completion completion_;
  LocalPath local_;
  StagedPath staged_;
  std::thread reaper_;
};

}  // namespace

std::unique_ptr<GpuExecutor> make_gpu_executor(Logger& log, const GpuOptions& options) {
  return std::make_unique<CudaExecutor>(log, options);
}

}  // namespace collectived::engine::gpu
