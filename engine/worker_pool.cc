#include "engine/worker_pool.h"

#include <pthread.h>

#include <cstdio>
#include <exception>

#include <sched.h>

namespace collectived::engine {

WorkerPool::WorkerPool(std::size_t threads, std::chrono::microseconds spin) : spin_(spin) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  threads_.reserve(threads);
  for (std::size_t i = 0; i < threads; ++i) threads_.emplace_back([this] {
    ::pthread_setname_np(::pthread_self(), "cd-worker");
    run();
  });
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
    pending_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_one();
}

void WorkerPool::submit_all(std::vector<std::function<void()>> tasks) {
  if (tasks.empty()) return;
  const bool many = tasks.size() > 1;
  {
    std::lock_guard lock(mutex_);
    for (auto& t : tasks) queue_.push_back(std::move(t));
    pending_.fetch_add(tasks.size(), std::memory_order_release);
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
    // Before sleeping, look for work for a short while: waking a sleeping
    // thread costs tens of microseconds on virtual machines, more than a small
    // collective takes. sched_yield keeps the spin from starving the clients
    // when there are more runnable threads than cores.
    const auto spin_until = std::chrono::steady_clock::now() + spin_;
    while (pending_.load(std::memory_order_acquire) == 0 &&
           std::chrono::steady_clock::now() < spin_until) {
      sched_yield();
    }
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      // Drain before stopping: a task may complete an operation someone waits on.
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      pending_.fetch_sub(1, std::memory_order_release);
    }
    try {
      task();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "level=error event=worker_task_threw error=\"%s\"\n", e.what());
    }
  }
}

}  // namespace collectived::engine
