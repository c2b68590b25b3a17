// One torch operation in flight (c10d::Work) and the thread that completes
// them: it waits for libcollective's requests in submission order, copies
// staged outputs back into CPU tensors, and completes the Work and its future
// with the daemon's answer (an error names the rank, node and pid at fault).
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/collective.h"
#include "client/torch/cuda_launch.h"

namespace collectived::torch_backend {

class Work final : public c10d::Work {
 public:
  Work(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
       std::unique_ptr<CudaLaunch> cuda, std::chrono::milliseconds timeout);
  ~Work() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  /// CPU: blocks until done (or `timeout`), raises the operation's error.
  /// CUDA: raises an error already known, else makes the current stream wait
  /// for the operation and returns (COLLECTIVED_TORCH_BLOCKING_WAIT=1: also
  /// waits for the daemon's answer, as TORCH_NCCL_BLOCKING_WAIT does).
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  void blockCurrentStream() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;

  const std::string& what() const { return what_; }

  // Filled by the submitting thread before the Work is handed to Progress.
  std::vector<collective_request_t*> requests;
  /// Run by Progress after every request succeeded (copies staged outputs).
  std::function<void()> on_success;
  /// Held until completion: staging blocks, temporaries, the inputs.
  std::vector<c10::DataPtr> keep_blocks;
  std::vector<at::Tensor> keep_tensors;

  /// Progress's side: the outcome of the requests.
  void complete(const std::string& error, c10d::WorkResult kind);
  /// CUDA: completes the future now, stream-ordered (see Future's devices).
  void cuda_submitted();

 private:
  const std::string what_;
  std::vector<at::Tensor> outputs_;
  std::unique_ptr<CudaLaunch> cuda_;
  const std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// The completing thread of one process group.
class Progress {
 public:
  Progress();
  /// Waits for the Works in flight (each within its deadline), then stops.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void enqueue(c10::intrusive_ptr<Work> w);
  /// Blocks until every Work enqueued so far is complete.
  void drain();

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<Work>> queue_;
  std::uint64_t enqueued_ = 0, completed_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace collectived::torch_backend
