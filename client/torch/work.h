// One torch operation in flight (c10d::Work) and the thread that completes
// them: it waits for libcollective's requests in submission order, copies
// staged outputs back into CPU tensors, and completes the Work and its future
// with the daemon's answer (an error names the rank, node and pid at fault).
//
// Who waits for the daemon's answer: whoever settles the Work first. A
// caller blocked in wait() settles it on its own thread, so a blocking call
// costs no hand-off between threads (on a loaded host each hand-off costs a
// scheduling delay, tens of microseconds); Progress settles the Works nobody
// waits for: at once where a future, is_completed() or CUDA work needs it,
// else after kSettleDelay once a later Work was submitted behind it. A
// caller who waits for each operation never wakes Progress.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
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
#include "client/torch/torch_compat.h"

namespace collectived::client::torch_backend {

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
#if COLLECTIVED_TORCH_HAS_BACKEND_OPTIONS
  void blockCurrentStream() override;
#endif
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

  /// Waits for the requests and completes the Work, unless another thread
  /// does or did (then returns at once). False: another thread is at it.
  bool try_settle();
  bool settled() const { return state_.load() == kSettled; }
  /// Progress should settle it without waiting for a caller (a future was
  /// asked for, or CUDA work, whose wait() does not block).
  bool urgent() const { return urgent_.load(); }
  void make_urgent() { urgent_ = true; }
  std::chrono::steady_clock::time_point submitted() const { return submitted_; }
  /// CUDA: completes the future now, stream-ordered (see Future's devices).
  void cuda_submitted();
  /// CUDA work that failed: told to the group, whose next operation raises
  /// it (the caller's stream was released with undefined output, and wait()
  /// may have returned before the failure was known).
  std::function<void(const std::string&)> on_cuda_failure;
  /// Wakes Progress (set by Progress::enqueue).
  std::function<void()> on_settled;
  /// Progress waits for a Work another thread claimed (set by enqueue).
  const std::atomic<bool>* progress_waits_ = nullptr;

 private:
  const std::string what_;
  std::vector<at::Tensor> outputs_;
  std::unique_ptr<CudaLaunch> cuda_;
  void complete(const std::string& error);
  static constexpr int kPending = 0, kClaimed = 1, kSettled = 2;
  const std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> state_{kPending};
  std::atomic<bool> urgent_{false};
  const std::chrono::steady_clock::time_point submitted_ = std::chrono::steady_clock::now();
};

/// The completing thread of one process group.
class Progress {
 public:
  Progress();
  /// Waits for the Works in flight (each within its deadline), then stops.
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// A Work not waited for is settled after this long (its completion, seen
  /// by is_completed() alone, is that late at most).
  static constexpr std::chrono::microseconds kSettleDelay{500};

  void enqueue(c10::intrusive_ptr<Work> w);
  /// Blocks until every Work enqueued so far is complete.
  void drain();
  /// Something changed for a Work in the queue (settled, or now urgent).
  void poke();

 private:
  void run();
  /// One look at the head `w` (mu_ held by `lock`; released and taken
  /// again while it settles or waits).
  void step(std::unique_lock<std::mutex>& lock, const c10::intrusive_ptr<Work>& w);
  std::mutex mu_;
  std::condition_variable cv_;          ///< wakes Progress
  std::condition_variable drained_cv_;  ///< Works popped (drain() waits)
  std::deque<c10::intrusive_ptr<Work>> queue_;
  /// Works done with, released by the next enqueue() or drain() on the
  /// caller's thread, never by Progress (run() says why).
  std::vector<c10::intrusive_ptr<Work>> graveyard_;
  std::uint64_t enqueued_ = 0, completed_ = 0;
  bool stop_ = false;
  /// Progress waits for a Work another thread claimed: settling pokes it.
  std::atomic<bool> waiting_for_claim_{false};
  std::thread thread_;
};

}  // namespace collectived::client::torch_backend
