#include "client/torch/work.h"

#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

namespace collectived::torch_backend {

namespace {

bool blocking_wait() {
  for (const char* name : {"COLLECTIVED_TORCH_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && std::strcmp(v, "1") == 0) return true;
  }
  return false;
}

c10d::OpType type_or_unknown(c10d::OpType t) { return t; }

}  // namespace

Work::Work(int rank, c10d::OpType type, std::string what, std::vector<at::Tensor> outputs,
           std::unique_ptr<CudaLaunch> cuda, std::chrono::milliseconds timeout)
    : c10d::Work(rank, type_or_unknown(type)),
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
  std::lock_guard lock(mutex_);
  if (!completed_) return false;
  return exception_ != nullptr || cuda_ == nullptr || cuda_->done();
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
  std::unique_lock lock(mutex_);
  // No timeout given: the operation's own deadline answers first (the
  // daemon's), so this never waits for ever.
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

void Work::blockCurrentStream() { synchronize(); }

c10::intrusive_ptr<c10::ivalue::Future> Work::getFuture() { return future_; }

std::vector<at::Tensor> Work::result() { return outputs_; }

void Work::cuda_submitted() {
  // The caller's stream is the internal one here (CudaLaunch's guard): the
  // future records its events there, and whoever waits on it waits for them.
  future_->markCompleted(c10::IValue(outputs_));
  cuda_->restore();
}

void Work::complete(const std::string& error, c10d::WorkResult kind) {
  (void)kind;
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
  {
    std::lock_guard lock(mu_);
    queue_.push_back(std::move(w));
    ++enqueued_;
  }
  cv_.notify_all();
}

void Progress::drain() {
  std::unique_lock lock(mu_);
  const std::uint64_t target = enqueued_;
  cv_.wait(lock, [&] { return completed_ >= target; });
}

void Progress::run() {
  for (;;) {
    c10::intrusive_ptr<Work> w;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      w = queue_.front();
    }
    std::string error;
    c10d::WorkResult kind = c10d::WorkResult::SUCCESS;
    for (auto* r : w->requests) {
      // -1: up to the operation's own deadline (the daemon answers by then).
      const collective_result_t res = collective_wait(r, -1);
      if (res != COLLECTIVE_OK && error.empty()) {
        error = collective_last_error();
        kind = res == COLLECTIVE_TIMEOUT ? c10d::WorkResult::TIMEOUT : c10d::WorkResult::COMM_ERROR;
      }
      collective_request_free(r);
    }
    w->requests.clear();
    w->complete(error, kind);
    {
      std::lock_guard lock(mu_);
      queue_.pop_front();
      ++completed_;
    }
    cv_.notify_all();
  }
}

}  // namespace collectived::torch_backend
