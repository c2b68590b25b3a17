// CUDA resources released off the event loop (runtime.cc's reaper thread).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace collectived::engine::gpu {

/// CUDA resources whose release may wait for the GPU (cudaIpcCloseMemHandle,
/// cuMemUnmap, cudaHostUnregister, cudaFreeHost) are never released on the
/// daemon's event loop: the last owner buries them here and the executor's
/// completion thread drops them. A client killed while its operation was
/// queued on a GPU stream is exactly when such a release would block.
struct Graveyard {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<void>> dead;
  bool open = true;  // false once the executor is gone: drop at once
  void bury(std::shared_ptr<void> p) {
    if (!p) return;
    std::unique_lock lock(mu);
    if (!open) {
      lock.unlock();
      p.reset();
      return;
    }
    dead.push_back(std::move(p));
    cv.notify_one();
  }
  std::vector<std::shared_ptr<void>> take() {
    std::lock_guard lock(mu);
    return std::exchange(dead, {});
  }
  /// The executor is going: what is buried from now on is dropped at once,
  /// and reap() returns.
  void close() {
    {
      std::lock_guard lock(mu);
      open = false;
    }
    cv.notify_all();
  }
  /// The reaper thread: drops buried CUDA resources, on a thread of its own:
  /// a release that waits for the GPU must not hold up the completion thread
  /// (which is what unblocks the GPU at a deadline).
  void reap() {
    for (;;) {
      std::vector<std::shared_ptr<void>> gone;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return !open || !dead.empty(); });
        if (!open) return;
        gone = std::exchange(dead, {});
      }
      gone.clear();
    }
  }
};

}  // namespace collectived::engine::gpu
