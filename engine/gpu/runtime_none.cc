// The GPU executor of a build without CUDA: every request is refused, saying why.
#include "engine/gpu/executor.h"

namespace collectived::engine::gpu {
namespace {

constexpr const char* kWhy =
    "no GPU support: collectived was built without CUDA (COLLECTIVED_CUDA=OFF or no nvcc at "
    "configure time)";

class NoGpu final : public GpuExecutor {
 public:
  explicit NoGpu(const GpuOptions& o) : chunk_(o.stage_chunk_bytes) {
    status_.reason = kWhy;
    status_.mps = o.mps;
  }
  GpuStatus status() const override { return status_; }
  std::shared_ptr<DeviceMemory> open(std::uint64_t, GpuRegisterArgs) override { fail(); }
  void attach_flags(std::uint64_t, UniqueFd, std::uint64_t) override { fail(); }
  std::shared_ptr<RankSync> make_sync(std::uint64_t, const GpuSyncArgs&) override { fail(); }
  void client_gone(std::uint64_t) override {}
  void run(GpuCollective, std::function<void(Code, std::string)>) override { fail(); }
  std::shared_ptr<GpuStage> stage_in(GpuCollective, std::function<void(Code, std::string)>) override {
    fail();
  }
  void stage_out(std::shared_ptr<GpuStage>, std::function<void(Code, std::string)>) override { fail(); }
  std::vector<std::shared_ptr<RankSync>> make_chunked(std::uint64_t, const GpuSyncArgs&,
                                                      ChunkedArgs) override {
    fail();
  }
  // Host ranks cut operations across nodes like GPU ranks do (the session).
  std::uint64_t stage_chunk_bytes() const override { return chunk_; }

 private:
  [[noreturn]] static void fail() { throw Error(Code::unavailable, kWhy); }
  GpuStatus status_;
  std::uint64_t chunk_ = 0;
};

}  // namespace

std::unique_ptr<GpuExecutor> make_gpu_executor(Logger&, const GpuOptions& options) {
  return std::make_unique<NoGpu>(options);
}

}  // namespace collectived::engine::gpu
