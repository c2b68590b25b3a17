#include "engine/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <utility>

#include "ipc/error.h"

// The sanitizers follow stack switches only when told (their fiber APIs);
// without this ASan reports false stack errors after a switch and TSan mixes
// the fibers' histories up.
#if defined(__SANITIZE_ADDRESS__)
#define COLLECTIVED_ASAN_FIBERS 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COLLECTIVED_ASAN_FIBERS 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define COLLECTIVED_TSAN_FIBERS 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define COLLECTIVED_TSAN_FIBERS 1
#endif
#endif
#ifdef COLLECTIVED_ASAN_FIBERS
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef COLLECTIVED_TSAN_FIBERS
#include <sanitizer/tsan_interface.h>
#endif

namespace collectived::engine {
namespace {
thread_local Fiber* t_current = nullptr;
}

FiberStack::FiberStack(std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  bytes_ = (bytes + page - 1) / page * page;
  mapped_ = bytes_ + page;
  void* m = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) throw_errno("mmap of a " + std::to_string(mapped_) + "-byte fiber stack");
  if (::mprotect(m, page, PROT_NONE) != 0) {
    const int e = errno;
    ::munmap(m, mapped_);
    errno = e;
    throw_errno("mprotect of a fiber stack's guard page");
  }
  mapping_ = m;
}

FiberStack::~FiberStack() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapped_);
}

FiberStack::FiberStack(FiberStack&& o) noexcept
    : mapping_(std::exchange(o.mapping_, nullptr)),
      mapped_(std::exchange(o.mapped_, 0)),
      bytes_(std::exchange(o.bytes_, 0)) {}

FiberStack& FiberStack::operator=(FiberStack&& o) noexcept {
  if (this != &o) {
    if (mapping_ != nullptr) ::munmap(mapping_, mapped_);
    mapping_ = std::exchange(o.mapping_, nullptr);
    mapped_ = std::exchange(o.mapped_, 0);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void* FiberStack::base() const {
  return mapping_ == nullptr ? nullptr : static_cast<char*>(mapping_) + (mapped_ - bytes_);
}

Fiber::Fiber(std::function<void()> body, std::size_t stack_bytes)
    : Fiber(std::move(body), FiberStack(stack_bytes)) {}

Fiber::Fiber(std::function<void()> body, FiberStack stack)
    : body_(std::move(body)), stack_(stack ? std::move(stack) : FiberStack(kDefaultStackBytes)) {
#ifdef COLLECTIVED_ASAN_FIBERS
  // A reused stack still carries the poisoned redzones of the frames that the
  // previous fiber left without returning (its trampoline's): clear them.
  __asan_unpoison_memory_region(stack_.base(), stack_.size());
#endif
  if (::getcontext(&context_) != 0) throw_errno("getcontext");
  context_.uc_stack.ss_sp = stack_.base();
  context_.uc_stack.ss_size = stack_.size();
  context_.uc_link = nullptr;  // the body never returns through uc_link: see trampoline
  const auto self = reinterpret_cast<std::uintptr_t>(this);
  ::makecontext(&context_, reinterpret_cast<void (*)()>(&Fiber::trampoline), 2,
                static_cast<unsigned>(self >> 32), static_cast<unsigned>(self & 0xffffffffu));
#ifdef COLLECTIVED_TSAN_FIBERS
  tsan_fiber_ = __tsan_create_fiber(0);
#endif
}

Fiber::~Fiber() {
#ifdef COLLECTIVED_TSAN_FIBERS
  if (tsan_fiber_ != nullptr) __tsan_destroy_fiber(tsan_fiber_);
#endif
}

FiberStack Fiber::take_stack() {
  if (started_ && !finished_) {
    throw Error(Code::internal, "a fiber's stack was taken while the fiber was suspended on it");
  }
  finished_ = true;
  return std::move(stack_);
}

Fiber* Fiber::current() { return t_current; }

void Fiber::trampoline(unsigned hi, unsigned lo) {
  auto* self = reinterpret_cast<Fiber*>((static_cast<std::uintptr_t>(hi) << 32) | lo);
#ifdef COLLECTIVED_ASAN_FIBERS
  __sanitizer_finish_switch_fiber(nullptr, &self->caller_stack_bottom_, &self->caller_stack_size_);
#endif
  try {
    self->body_();
  } catch (...) {
    self->error_ = std::current_exception();
  }
  self->finished_ = true;
  self->switch_out(true);
  // Never resumed again: resume() refuses a finished fiber.
}

bool Fiber::resume() {
  if (finished_) return true;
  started_ = true;
  outer_ = t_current;
  t_current = this;
  switch_in();
  t_current = outer_;
  outer_ = nullptr;
  if (finished_ && error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return finished_;
}

void Fiber::yield() { switch_out(false); }

void Fiber::switch_in() {
#ifdef COLLECTIVED_TSAN_FIBERS
  tsan_caller_ = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(tsan_fiber_, 0);
#endif
#ifdef COLLECTIVED_ASAN_FIBERS
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, static_cast<char*>(context_.uc_stack.ss_sp), stack_.size());
#endif
  ::swapcontext(&caller_, &context_);
#ifdef COLLECTIVED_ASAN_FIBERS
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void Fiber::switch_out(bool finishing) {
#ifdef COLLECTIVED_TSAN_FIBERS
  __tsan_switch_to_fiber(tsan_caller_, 0);
#endif
#ifdef COLLECTIVED_ASAN_FIBERS
  // A finishing fiber's fake stack is freed (null save slot).
  __sanitizer_start_switch_fiber(finishing ? nullptr : &fake_stack_, caller_stack_bottom_,
                                 caller_stack_size_);
#else
  (void)finishing;
#endif
  ::swapcontext(&context_, &caller_);
#ifdef COLLECTIVED_ASAN_FIBERS
  __sanitizer_finish_switch_fiber(fake_stack_, &caller_stack_bottom_, &caller_stack_size_);
#endif
}

}  // namespace collectived::engine
