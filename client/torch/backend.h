// ProcessGroupCollectived: torch.distributed's backend "collectived"
// (c10d::Backend) over libcollective. One communicator per process group,
// joined through the group's store; CPU tensors run on memory the daemon maps
// (host_memory.h), CUDA tensors through libcollective's stream-ordered calls
// on an internal stream (cuda_launch.h); a Progress thread completes the Works.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "client/collective.h"
#include "client/torch/cuda_launch.h"
#include "client/torch/host_memory.h"
#include "client/torch/torch_compat.h"
#include "client/torch/work.h"

namespace collectived::client::torch_backend {

class Launch;

class Backend final : public c10d::Backend {
 public:
  struct Config {
    std::string socket;  ///< empty: $COLLECTIVED_SOCKET, else the default
    std::chrono::milliseconds timeout{kBackendDefaultTimeout};
    std::string group_name;
  };

  /// Joins the group's communicator: rank 0 makes the unique id and puts it
  /// in `store`, every rank takes it from there. Throws c10::Error.
  Backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Config config);
  /// Leaves the communicator once the Works in flight are done.
  ~Backend() override;

  const std::string getBackendName() const override { return "collectived"; }
#if COLLECTIVED_TORCH_HAS_BACKEND_OPTIONS
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
#endif
  bool supportsCoalescing() const override { return true; }
#if COLLECTIVED_TORCH_HAS_BACKEND_OPTIONS
  void setTimeout(std::chrono::milliseconds timeout) override;
#else
  void setTimeout(std::chrono::milliseconds timeout);
#endif
#if COLLECTIVED_TORCH_HAS_ERROR_TYPE
  c10d::ErrorType getError() override;
#endif
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void abort() override;
  void shutdown() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  /// "communicator NAME (rank r of n)" as libcollective names it.
  const std::string& where() const;

 private:
  friend class Launch;
  /// The operation's Launch: a new one, or between startCoalescing and
  /// endCoalescing the one they share. `timeout`: opts.timeout (unset: the
  /// group's), which becomes the operation's deadline in the daemon.
  struct Started {
    std::unique_ptr<Launch> owned;
    Launch* launch = nullptr;
    Launch* operator->() const { return launch; }
    Launch& operator*() const { return *launch; }
  };
  Started start(c10d::OpType type, const char* what, const at::Tensor& first,
                std::chrono::milliseconds timeout);
  /// Submits a started operation (coalescing: a Work that stands for it
  /// until endCoalescing's).
  c10::intrusive_ptr<c10d::Work> finish(Started& op, std::vector<at::Tensor> outputs);
  collective_comm_t* comm() const;
  /// One send or receive of a point-to-point operation (send, recv, gather,
  /// scatter, uneven all-to-all).
  c10::intrusive_ptr<c10d::Work> point_to_point(std::vector<at::Tensor>& tensors, int peer,
                                                bool is_send);

  std::shared_ptr<NodeConnection> node_;
  SharedHostAllocator* alloc_ = nullptr;
  Config config_;
  const std::string where_;  ///< made once: every operation's name carries it
  collective_comm_t* comm_ = nullptr;
  CudaStreams streams_;
  std::unique_ptr<Progress> progress_;
  /// Serialises submissions: an open send/recv group belongs to one caller.
  std::recursive_mutex mu_;
  /// Between startCoalescing and endCoalescing: the one Work every operation
  /// adds its requests to, and whether a send/recv group is open for it.
  std::unique_ptr<Launch> coalesced_;
  bool coalescing_ = false;
  bool group_open_ = false;
  std::chrono::milliseconds comm_timeout_{0};
  /// The first failure of an operation on CUDA tensors (see
  /// Work::on_cuda_failure): every later operation raises it.
  struct AsyncError {
    std::mutex mu;
    std::string message;
  };
  std::shared_ptr<AsyncError> async_error_ = std::make_shared<AsyncError>();
};

}  // namespace collectived::client::torch_backend
