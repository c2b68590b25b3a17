// The node thread, and the fibers on it that run each communicator's
// operations between nodes one after another (engine/fiber.h). A blocked
// operation yields the thread, so it never holds up another communicator,
// the event loop or the worker pool.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "engine/fiber.h"
#include "engine/op.h"
#include "engine/transport/transport.h"

namespace collectived::engine::detail {

/// Where operations between nodes run: the node thread. The daemon sets
/// `post` to its event loop (the thread that reads the peer sockets), so that
/// a chunk that arrives is reduced and forwarded on the thread that read it;
/// without `post` (tests) the runner starts a thread of its own. Shared with
/// every executor and the callbacks that wake them, so that a late callback
/// finds it stopped rather than a destroyed engine.
struct NodeRunner {
  std::function<void(std::function<void()>)> post;  // set once, before serving
  /// Called by the own thread when idle for 20 ms (deadline checks).
  std::function<void()> idle;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stop = false;
  std::thread thread;

  /// Runs `f` later on the node thread (never inline).
  void run(std::function<void()> f);
  /// Stops and joins the own thread; later run() calls are dropped.
  void shut();
};

/// Runs a communicator's operations that span nodes, one after another, in a
/// fiber (engine/fiber.h) on the node thread. They block on other nodes: a
/// blocked operation yields the thread, so it never holds up another
/// communicator, the event loop or the worker pool.
struct Executor {
  std::shared_ptr<NodeRunner> runner;
  std::string comm;  // the communicator's name, for the log
  std::mutex mu;  // guards jobs
  std::deque<std::function<void()>> jobs;
  /// Set when a wake-up is queued on the node thread (at most one at a time).
  std::atomic<bool> wake_posted{false};
  // Node thread only:
  std::unique_ptr<Fiber> fiber;  // running the jobs
  /// The stack of the last fiber, for the next one: a fiber lasts while jobs
  /// are queued, so one operation at a time would map a stack each.
  FiberStack spare_stack;
  bool waiting = false;          // the fiber yielded in wait()
  Clock::time_point resumed_at;  // when the fiber last got the thread
  /// Scratch memory of the operations (NodeChannel::scratch).
  std::shared_ptr<MessageBytes> scratch;

  /// From any thread: resumes the fiber (or starts the next job) soon, on the
  /// node thread. Cheap when already queued.
  static void wake(const std::shared_ptr<Executor>& ex);
  /// From inside the executor's fiber: gives the node thread back until
  /// wake() (a message, a send done, a deadline sweep). Spurious returns
  /// happen: the caller re-checks what it waits for.
  static void wait(Executor& ex);
  /// On the node thread: resumes the fiber, or starts one for queued jobs.
  static void drive(const std::shared_ptr<Executor>& ex);
  /// From inside the fiber: gives the thread to the other handlers of the
  /// event loop (clients, heartbeats, other communicators) if it has held it
  /// for more than a few milliseconds, then goes on.
  static void take_turns(const std::shared_ptr<Executor>& ex);
  /// From inside the fiber: gives the thread to the handlers queued on it
  /// before this call (a send posted to the transport), then goes on.
  static void yield(const std::shared_ptr<Executor>& ex);
};

}  // namespace collectived::engine::detail
