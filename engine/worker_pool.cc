#include "engine/worker_pool.h"

#include <cstdio>
#include <exception>

namespace collectived::engine {

WorkerPool::WorkerPool(std::size_t threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  threads_.reserve(threads);
  for (std::size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::submit(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void WorkerPool::submit_all(std::vector<std::function<void()>> tasks) {
  if (tasks.empty()) return;
  const bool many = tasks.size() > 1;
  {
    std::lock_guard lock(mutex_);
    for (auto& t : tasks) queue_.push_back(std::move(t));
  }
  if (many) {
    cv_.notify_all();
  } else {
    cv_.notify_one();
  }
}

void WorkerPool::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      // Drain before stopping: a task may complete an operation someone waits on.
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      task();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "level=error event=worker_task_threw error=\"%s\"\n", e.what());
    }
  }
}

}  // namespace collectived::engine
