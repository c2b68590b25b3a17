// The daemon's worker threads: collectives execute here, never on the event
// loop.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace collectived::engine {

/// A fixed set of threads taking tasks from one FIFO. Tasks must not throw
/// (an escaping exception would be a bug: it is caught and counted).
class WorkerPool {
 public:
  /// `threads` == 0: one per online CPU. Idle workers look for new tasks for
  /// `spin` before they sleep.
  explicit WorkerPool(std::size_t threads,
                      std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void submit(std::function<void()> task);
  /// Submits several tasks with one wake-up of all workers.
  void submit_all(std::vector<std::function<void()>> tasks);
  std::size_t size() const { return threads_.size(); }

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::atomic<std::size_t> pending_{0};
  const std::chrono::microseconds spin_;
  std::vector<std::thread> threads_;
};

}  // namespace collectived::engine
