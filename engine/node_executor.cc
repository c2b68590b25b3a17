#include "engine/node_executor.h"

#include <pthread.h>

#include <cstdio>

#include "engine/node_inbox.h"

namespace collectived::engine::detail {

void NodeRunner::run(std::function<void()> f) {
  if (post) {
    post(std::move(f));
    return;
  }
  std::lock_guard l(mu);
  if (stop) return;
  if (!thread.joinable()) {
    thread = std::thread([this] {
      ::pthread_setname_np(::pthread_self(), "cd-node");
      std::unique_lock lk(mu);
      while (!stop) {
        if (queue.empty()) {
          if (!cv.wait_for(lk, std::chrono::milliseconds(20), [&] { return stop || !queue.empty(); })) {
            lk.unlock();
            if (idle) idle();
            lk.lock();
          }
          continue;
        }
        auto job = std::move(queue.front());
        queue.pop_front();
        lk.unlock();
        job();
        lk.lock();
      }
    });
  }
  queue.push_back(std::move(f));
  cv.notify_one();
}

void NodeRunner::shut() {
  std::thread t;
  {
    std::lock_guard l(mu);
    stop = true;
    t = std::move(thread);
    queue.clear();
  }
  cv.notify_all();
  if (t.joinable()) t.join();
}

void Executor::wake(const std::shared_ptr<Executor>& ex) {
  if (ex->wake_posted.exchange(true)) return;
  ex->runner->run([ex] { drive(ex); });
}

void Executor::wait(Executor& ex) {
  Fiber* f = Fiber::current();
  if (f == nullptr) throw Error(Code::internal, "an operation between nodes waited outside its fiber");
  ex.waiting = true;
  f->yield();
  ex.waiting = false;
}

void Executor::drive(const std::shared_ptr<Executor>& ex) {
  ex->wake_posted.store(false);
  if (ex->fiber && !ex->waiting) return;  // it is running, further up this thread's stack
  if (!ex->fiber) {
    {
      std::lock_guard l(ex->mu);
      if (ex->jobs.empty()) return;
    }
    // The executor owns the fiber, which only runs while the executor lives.
    ex->fiber = std::make_unique<Fiber>([raw = ex.get()] {
      for (;;) {
        std::function<void()> job;
        {
          std::lock_guard l(raw->mu);
          if (raw->jobs.empty()) return;
          job = std::move(raw->jobs.front());
          raw->jobs.pop_front();
        }
        job();
      }
    }, std::move(ex->spare_stack));
  }
  ex->waiting = false;
  ex->resumed_at = Clock::now();
  bool finished = true;
  try {
    finished = ex->fiber->resume();
  } catch (const std::exception& e) {
    // run_across_nodes answers every error itself; this would be a bug. No
    // logger here (the executor outlives nothing it could borrow one from):
    // the daemon's log format on stderr.
    std::fprintf(stderr, "level=error event=node_job_threw comm=%s error=\"%s\"\n",
                 ex->comm.c_str(), e.what());
  }
  if (finished) {
    ex->spare_stack = ex->fiber->take_stack();
    ex->fiber.reset();
  }
}

void Executor::take_turns(const std::shared_ptr<Executor>& ex) {
  // 5 ms: long enough that a large operation's chunks go by in batches, short
  // enough for heartbeats (deadlines.heartbeat_ms) and small operations.
  if (Clock::now() - ex->resumed_at < std::chrono::milliseconds(5)) return;
  yield(ex);
}

void Executor::yield(const std::shared_ptr<Executor>& ex) {
  wake(ex);
  wait(*ex);
}

void notify(Inbox& in) {
  if (auto ex = in.exec.lock()) Executor::wake(ex);
}

}  // namespace collectived::engine::detail
