#include "client/torch/work.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>

namespace collectived::client::torch_backend {

namespace {

bool blocking_wait() {
  for (const char* name : {"COLLECTIVED_TORCH_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && std::strcmp(v, "1") == 0) return true;
  }
  return false;
}

}  // namespace

Work::Work(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
           std::unique_ptr<CudaLaunch> cuda, std::chrono::milliseconds timeout)
    : c10d::Work(rank, type),
      what_(std::move(what)),
      outputs_(std::move(outputs)),
      cuda_(std::move(cuda)),
      timeout_(timeout) {
  std::vector<c10::Device> devices;
  if (cuda_) devices.push_back(cuda_->device());
  future_ = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), devices);
}

Work::~Work() {
  // A request never handed to Progress (the submission failed part-way).
  for (auto* r : requests) collective_request_free(r);
}

bool Work::isCompleted() {
  {
    std::lock_guard lock(mutex_);
    if (exception_ != nullptr) return true;
    // CUDA: done when the GPU is past the operation (ProcessGroupNCCL's test),
    // whether or not the daemon's answer has been read yet.
    if (cuda_ != nullptr) return cuda_->done();
    if (completed_) return true;
  }
  // Asked, so Progress settles it (nobody else may).
  if (!urgent_.exchange(true) && on_settled) on_settled();
  return false;
}

bool Work::isSuccess() const {
  std::lock_guard lock(mutex_);
  return completed_ && exception_ == nullptr;
}

std::exception_ptr Work::exception() const {
  std::lock_guard lock(mutex_);
  return exception_;
}

bool Work::wait(std::chrono::milliseconds timeout) {
  if (cuda_ != nullptr && !blocking_wait()) {
    {
      std::lock_guard lock(mutex_);
      if (exception_) std::rethrow_exception(exception_);
    }
    cuda_->block_current_stream();
    return true;
  }
  // No timeout given: settle it here; the operation's own deadline (the
  // daemon's) answers first, so this never waits for ever.
  if (timeout == kNoTimeout) try_settle();
  if (!settled() && !urgent_.exchange(true) && on_settled) on_settled();  // Progress: settle it
  std::unique_lock lock(mutex_);
  if (timeout == kNoTimeout) {
    cv_.wait(lock, [&] { return completed_; });
  } else if (!cv_.wait_for(lock, timeout, [&] { return completed_; })) {
    TORCH_CHECK(false, "collectived: ", what_, " not complete after wait(timeout=",
                timeout.count(), " ms); it is still in flight, within its deadline of ",
                timeout_.count(), " ms");
  }
  if (exception_) std::rethrow_exception(exception_);
  lock.unlock();
  if (cuda_ != nullptr) cuda_->block_current_stream();
  return true;
}

void Work::synchronize() {
  if (cuda_ != nullptr) cuda_->block_current_stream();
}

#if COLLECTIVED_TORCH_HAS_BACKEND_OPTIONS
void Work::blockCurrentStream() { synchronize(); }
#endif

c10::intrusive_ptr<c10::ivalue::Future> Work::getFuture() {
  // Its callbacks (DDP's comm hooks) run when Progress settles the Work.
  if (!urgent_.exchange(true) && on_settled) on_settled();
  return future_;
}

std::vector<at::Tensor> Work::result() { return outputs_; }

bool Work::try_settle() {
  int expected = kPending;
  if (!state_.compare_exchange_strong(expected, kClaimed)) return state_.load() == kSettled;
  std::string error;
  for (auto* r : requests) {
    // -1: up to the operation's own deadline (the daemon answers by then).
    if (collective_wait(r, -1) != COLLECTIVE_OK && error.empty()) error = collective_last_error();
    collective_request_free(r);
  }
  requests.clear();
  complete(error);
  state_ = kSettled;
  // Progress pops settled Works when it gets to them; it is woken only when
  // it waits for this one (claimed here while it was due there).
  if (on_settled && progress_waits_ != nullptr && progress_waits_->load()) on_settled();
  return true;
}

void Work::cuda_submitted() {
  urgent_ = true;
  // The caller's stream is the internal one here (CudaLaunch's guard): the
  // future records its events there, and whoever waits on it waits for them.
  future_->markCompleted(c10::IValue(outputs_));
  cuda_->restore();
}

void Work::complete(const std::string& error) {
  std::exception_ptr e;
  std::string why = error;
  // libcollective's messages start with the library's name; ours does.
  if (why.rfind("collectived: ", 0) == 0) why.erase(0, 13);
  if (error.empty()) {
    try {
      if (on_success) on_success();
    } catch (...) {
      e = std::current_exception();
    }
  } else {
    // DistBackendError: torch.distributed.DistBackendError, a RuntimeError.
    e = std::make_exception_ptr(c10::DistBackendError(
        c10::SourceLocation{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)},
        "collectived: " + what_ + " failed: " + why));
  }
  on_success = nullptr;
  if (e && cuda_ != nullptr && on_cuda_failure) on_cuda_failure("collectived: " + what_ + " failed: " + why);
  keep_blocks.clear();
  keep_tensors.clear();
  {
    std::lock_guard lock(mutex_);
    completed_ = true;
    exception_ = e;
  }
  cv_.notify_all();
  if (cuda_ == nullptr) {
    if (e) {
      future_->setError(e);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }
}

Progress::Progress() : thread_([this] { run(); }) {}

Progress::~Progress() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Progress::enqueue(c10::intrusive_ptr<Work> w) {
  w->on_settled = [this] { poke(); };
  w->progress_waits_ = &waiting_for_claim_;
  std::vector<c10::intrusive_ptr<Work>> done;
  bool wake;
  {
    std::lock_guard lock(mu_);
    // The Works settled since (by their waiters) go here, so that a caller
    // who waits for each operation never wakes Progress: each wake-up is a
    // context switch, which costs most where ranks outnumber cores.
    while (!queue_.empty() && queue_.front()->settled()) {
      done.push_back(std::move(queue_.front()));
      queue_.pop_front();
      ++completed_;
    }
    // Progress is needed only for a Work nobody waits for: one still
    // pending when the next is submitted, or one whose future, completion
    // or CUDA work is asked for (urgent, or poked later).
    wake = !queue_.empty() || w->urgent();
    queue_.push_back(std::move(w));
    ++enqueued_;
    std::move(graveyard_.begin(), graveyard_.end(), std::back_inserter(done));
    graveyard_.clear();
  }
  if (wake) cv_.notify_all();
  if (!done.empty()) drained_cv_.notify_all();
  // The last references go here, unlocked (see run()).
  done.clear();
}

void Progress::poke() {
  { std::lock_guard lock(mu_); }  // orders the change before the waiter's check
  cv_.notify_all();
}

void Progress::drain() {
  std::vector<c10::intrusive_ptr<Work>> dead;
  {
    std::unique_lock lock(mu_);
    const std::uint64_t target = enqueued_;
    for (auto& w : queue_) w->make_urgent();
    cv_.notify_all();
    drained_cv_.wait(lock, [&] { return completed_ >= target; });
    dead.swap(graveyard_);
  }
  // The last references go here, unlocked (see run()).
  dead.clear();
}

void Progress::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    c10::intrusive_ptr<Work> w = queue_.front();
    step(lock, w);
    // Never the last reference here: it may free tensors whose owner is
    // Python, which takes the GIL, and a thread that asks for the GIL while
    // the interpreter finalizes is ended (pthread_exit) inside ~Work, which
    // cannot unwind (std::terminate at exit, seen with FSDP2). The threads
    // that submit or drain, Python's own, release them (enqueue, drain).
    // Still at the head, the queue holds it too: dropping `w` frees nothing.
    if (queue_.empty() || queue_.front() != w) graveyard_.push_back(std::move(w));
  }
}

void Progress::step(std::unique_lock<std::mutex>& lock, const c10::intrusive_ptr<Work>& w) {
  if (!w->settled()) {
    // Give a caller about to wait() the chance to settle it on its own
    // thread; settle it here once it is urgent or has waited long enough.
    const auto due = w->submitted() + kSettleDelay;
    if (!stop_ && !w->urgent() && std::chrono::steady_clock::now() < due) {
      cv_.wait_until(lock, due, [&] { return stop_ || w->urgent() || w->settled(); });
      return;
    }
    lock.unlock();
    if (!w->try_settle()) {
      // A caller is settling it: wait for its poke.
      lock.lock();
      waiting_for_claim_ = true;
      cv_.wait(lock, [&] { return w->settled(); });
      waiting_for_claim_ = false;
      lock.unlock();
    }
    lock.lock();
  }
  // A submitter may have popped it meanwhile (enqueue pops settled Works).
  if (queue_.empty() || queue_.front() != w) return;
  queue_.pop_front();
  ++completed_;
  drained_cv_.notify_all();
}

}  // namespace collectived::client::torch_backend
