// Collectives run by libcollective itself, on the caller's stream: for a
// communicator whose ranks each own one GPU of one node, all-reduce,
// reduce-scatter, all-gather and broadcast are kernels the client launches
// (client/direct_kernels.cu) over scratch memory that every rank maps from
// every other (CUDA IPC, NVLink), with no hand-off to the daemon's streams.
// Without MPS each such hand-off between processes costs a GPU context
// switch (~35 us for the two of an operation); this path has none.
//
// The daemon still brokers everything: it says whether the node allows it
// (profile gpu.client_kernels, the MPS mode), and the ranks agree on it and
// exchange their scratch handles through a host all-gather on the
// communicator itself, at the first stream-ordered collective. Every rank
// decides the same way from the same gathered data, so either all ranks run
// an operation here or all send it to the daemon.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "client/collective.h"
#include "client/direct_abi.h"
#include "engine/gpu/cuda_driver.h"
#include "ipc/error.h"

namespace collectived::client {

// The CUDA driver loader (engine/gpu/cuda_driver.h), a leaf library the client links.
namespace gpu = engine::gpu;

/// What the daemon allows (its AttachedGpu answer).
struct DirectPolicy {
  bool allowed = false;
  std::string reason;
  std::uint64_t max_bytes = 0;  ///< largest rank buffer the kernels take
  int two_step_min_ranks = 3;       ///< gpu.two_step_min_gpus (one GPU per rank)
  std::uint64_t two_step_bytes = 0;  ///< gpu.two_step_bytes; 0 = never
};

/// direct_kernels.cu built for the GPU architectures of the build; empty
/// where libcollective was built without CUDA.
std::span<const unsigned char> direct_fatbin();

/// direct_fatbin() loaded as a module in the current context: a
/// non-copyable owner, unloaded when it goes. `cu` must outlive it.
class KernelModule {
 public:
  /// Null where it cannot be loaded (no fatbin, the driver refused).
  /// cuModuleLoadData may wait for work queued on the GPU: call it where the
  /// caller's streams cannot be waiting on the caller.
  static std::unique_ptr<KernelModule> load(const gpu::CudaDriver& cu);
  ~KernelModule();
  KernelModule(const KernelModule&) = delete;
  KernelModule& operator=(const KernelModule&) = delete;
  /// The kernel `name` (an extern "C" name), or null where there is none.
  gpu::cu::Function function(const char* name) const;

 private:
  KernelModule(const gpu::CudaDriver& cu, gpu::cu::Module m) : cu_(cu), module_(m) {}
  const gpu::CudaDriver& cu_;
  gpu::cu::Module module_;
};

/// Completion of an operation the client ran itself (the request's side).
class LocalCompletion {
 public:
  virtual ~LocalCompletion() = default;
  /// Waits up to `timeout` for the GPU to finish the operation. False: not
  /// yet. True: done, `code` and `message` say how.
  virtual bool poll(std::chrono::milliseconds timeout, Code& code, std::string& message) = 0;
};

class DirectComm {
 public:
  /// A collective call: every rank of `comm` makes it at the same operation
  /// (its first stream-ordered collective on it), in context `ctx` (the
  /// caller's stream's). Returns null, with `why` saying so, where the
  /// communicator's operations go to the daemon. Throws Error when the
  /// exchange itself fails.
  static std::unique_ptr<DirectComm> setup(collective_comm_t* comm,
                                           std::shared_ptr<const gpu::CudaDriver> cu,
                                           gpu::cu::Context ctx, const DirectPolicy& policy,
                                           const std::string& node, std::string& why);
  ~DirectComm();
  DirectComm(const DirectComm&) = delete;
  DirectComm& operator=(const DirectComm&) = delete;

  /// Largest rank buffer (bytes of one rank's block) an operation may have.
  std::uint64_t max_bytes() const { return slot_bytes_; }
  /// "client kernels: 2 ranks on GPU-.., GPU-.. (node n), up to 16777216 bytes per rank".
  const std::string& description() const { return description_; }

  /// Enqueues one operation on `stream` (count > 0; a rank's block of
  /// count elements fits max_bytes()). With `completion`, returns what the
  /// request polls. Throws Error (the communicator is broken after a peer
  /// failed to arrive, the stream is on another GPU, a launch failed).
  std::unique_ptr<LocalCompletion> run(direct::Kind kind, const void* send, void* recv,
                                       std::uint64_t count, int dtype, int redop, int root,
                                       gpu::cu::Stream stream, bool completion,
                                       const std::string& what);

  struct Shared;  // what completions share with the communicator (direct.cc)

 private:
  DirectComm() = default;
  void check_error_word();

  std::shared_ptr<Shared> shared_;
  collective_comm_t* comm_ = nullptr;  // owns this (CommGpu)
  std::mutex mu_;
  int rank_ = 0, nranks_ = 0;
  std::uint64_t slot_bytes_ = 0;
  std::uint64_t two_step_bytes_ = UINT64_MAX;  ///< direct::Args::two_step_bytes
  std::uint64_t seq_ = 0;
  std::string description_;
  gpu::cu::Stream last_stream_ = nullptr;
};

}  // namespace collectived::client
