// A stackful coroutine: code written as blocking calls that runs on whichever
// thread resumes it and gives that thread back while it waits.
//
// The engine runs each operation between nodes in a fiber on the thread that
// reads the peer sockets, so that a message arriving, the reduction of its
// chunk and the send of the next one happen on one thread, with no hand-off
// (a futex wake-up and two context switches per message) to a thread of the
// operation's own. node_algorithms.cc stays written as plain blocking code.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>

#include <ucontext.h>

namespace collectived::engine {

/// Owns a stack (mmap'ed, with a guard page below it) and a context. Not
/// thread-safe: one thread at a time resumes it. Move-free and copy-free.
class Fiber {
 public:
  /// Prepares `body` to run on a stack of `stack_bytes`; nothing runs yet.
  explicit Fiber(std::function<void()> body, std::size_t stack_bytes = std::size_t{512} << 10);
  /// A fiber must be finished (or never started) when destroyed: a suspended
  /// one would leave the objects on its stack undestroyed.
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  /// Runs the fiber on this thread until it yields or its body returns.
  /// Rethrows what the body threw. Returns true once the body has returned.
  bool resume();
  /// From inside the fiber: returns to the resume() that ran it.
  void yield();
  bool finished() const { return finished_; }
  bool started() const { return started_; }

  /// The fiber running on this thread, or null.
  static Fiber* current();

 private:
  static void trampoline(unsigned hi, unsigned lo);
  void switch_in();
  void switch_out(bool finishing);

  std::function<void()> body_;
  void* stack_ = nullptr;          // the mapping, guard page included
  std::size_t mapped_ = 0;
  std::size_t stack_bytes_ = 0;
  ucontext_t context_{};
  ucontext_t caller_{};
  Fiber* outer_ = nullptr;         // the fiber that resumed this one, if any
  bool started_ = false;
  bool finished_ = false;
  std::exception_ptr error_;
  // Sanitizer bookkeeping (see fiber.cc); unused in builds without them.
  [[maybe_unused]] void* fake_stack_ = nullptr;
  [[maybe_unused]] const void* caller_stack_bottom_ = nullptr;
  [[maybe_unused]] std::size_t caller_stack_size_ = 0;
  [[maybe_unused]] void* tsan_fiber_ = nullptr;
  [[maybe_unused]] void* tsan_caller_ = nullptr;
};

}  // namespace collectived::engine
