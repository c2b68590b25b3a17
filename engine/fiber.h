// A stackful coroutine: code written as blocking calls that runs on whichever
// thread resumes it and gives that thread back while it waits.
//
// The engine runs each operation between nodes in a fiber on the thread that
// reads the peer sockets, so that a message arriving, the reduction of its
// chunk and the send of the next one happen on one thread, with no hand-off
// (a futex wake-up and two context switches per message) to a thread of the
// operation's own. The algorithms (engine/algorithms/) stay written as plain blocking code.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>

#include <ucontext.h>

namespace collectived::engine {

/// A fiber's stack: an anonymous mapping with an inaccessible guard page
/// below it, so that an overflow faults instead of corrupting the heap. Pages
/// are committed as the stack grows into them. Movable, not copyable; empty
/// when default-constructed or moved from.
class FiberStack {
 public:
  FiberStack() = default;
  /// Maps `bytes` (rounded up to whole pages) plus the guard page.
  explicit FiberStack(std::size_t bytes);
  ~FiberStack();
  FiberStack(FiberStack&& o) noexcept;
  FiberStack& operator=(FiberStack&& o) noexcept;
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;

  /// The usable stack, above the guard page.
  void* base() const;
  std::size_t size() const { return bytes_; }
  explicit operator bool() const { return mapping_ != nullptr; }

 private:
  void* mapping_ = nullptr;  // guard page included
  std::size_t mapped_ = 0;
  std::size_t bytes_ = 0;
};

/// Owns a stack (FiberStack) and a context. Not thread-safe: one thread at a
/// time resumes it. Move-free and copy-free.
class Fiber {
 public:
  static constexpr std::size_t kDefaultStackBytes = std::size_t{512} << 10;
  /// Prepares `body` to run on a stack of `stack_bytes`; nothing runs yet.
  explicit Fiber(std::function<void()> body, std::size_t stack_bytes = kDefaultStackBytes);
  /// The same on a stack that another fiber has finished with (take_stack),
  /// or on a fresh one of the default size where `stack` is empty. A reused
  /// stack's pages are already committed: a new mapping costs an mmap, an
  /// mprotect, a page fault per page the body touches and, at the end, an
  /// munmap that interrupts every other thread of the process to flush its
  /// TLB.
  Fiber(std::function<void()> body, FiberStack stack);
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
  /// The stack, for another fiber, from a fiber that has finished or never
  /// started; this one cannot run afterwards (resume() returns true).
  FiberStack take_stack();
  bool started() const { return started_; }

  /// The fiber running on this thread, or null.
  static Fiber* current();

 private:
  static void trampoline(unsigned hi, unsigned lo);
  void switch_in();
  void switch_out(bool finishing);

  std::function<void()> body_;
  FiberStack stack_;
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
