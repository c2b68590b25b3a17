#include "client/torch/launch.h"

#include <c10/util/Exception.h>

#include <cstring>

#include "client/torch/backend.h"

namespace collectived::client::torch_backend {

Launch::Launch(Backend& b, c10d::OpType type, std::string what, const at::Tensor& first)
    : b_(b), type_(type), what_(std::move(what) + " on " + b.where()) {
  if (first.defined() && first.is_cuda()) {
    cuda_ = std::make_unique<CudaLaunch>(b.streams_, first.device());
  } else {
    TORCH_CHECK(!first.defined() || first.is_cpu(), "collectived: ", what_,
                " takes CPU or CUDA tensors, not ", first.device());
  }
}

Launch::~Launch() {
  // Not submitted (a check or a call threw): nothing may run on, but the
  // requests already made must be waited for and freed.
  if (!submitted_) {
    for (auto* r : requests_) {
      collective_wait(r, -1);
      collective_request_free(r);
    }
    if (cuda_) {
      cuda_->finish(tensors_);
      cuda_->restore();
    }
  }
}

void* Launch::stream() const { return cuda_ ? cuda_->stream() : nullptr; }

void Launch::check(const at::Tensor& t, const char* role) const {
  TORCH_CHECK(t.defined(), "collectived: ", what_, ": the ", role, " tensor is undefined");
  if (cuda_) {
    TORCH_CHECK(t.is_cuda() && t.device() == cuda_->device(), "collectived: ", what_,
                ": every tensor must be on ", cuda_->device(), "; the ", role, " tensor is on ",
                t.device());
  } else {
    TORCH_CHECK(t.is_cpu(), "collectived: ", what_, ": every tensor must be on the CPU; the ",
                role, " tensor is on ", t.device());
  }
  TORCH_CHECK(t.is_non_overlapping_and_dense() && t.is_contiguous(), "collectived: ", what_,
              ": the ", role, " tensor must be contiguous (call .contiguous() first)");
  TORCH_CHECK(!t.is_sparse(), "collectived: ", what_, " does not take sparse tensors");
}

void* Launch::staged(const at::Tensor& t, bool copy_in, bool copy_out) {
  tensors_.push_back(t);
  void* p = t.data_ptr();
  const std::size_t bytes = t.nbytes();
  if (cuda_ || bytes == 0) return p;
  SharedHostAllocator* a = b_.alloc_;
  if (a->registered(p, bytes) && a->node() == b_.node_) return p;
  c10::DataPtr block = a->allocate_registered(bytes);
  void* s = block.get();
  if (copy_in) std::memcpy(s, p, bytes);
  if (copy_out) {
    steps_.push_back([s, p, bytes] { std::memcpy(p, s, bytes); });
  }
  blocks_.push_back(std::move(block));
  return s;
}

const void* Launch::in(const at::Tensor& t) { return staged(t, true, false); }
void* Launch::out(const at::Tensor& t) { return staged(t, false, true); }
void* Launch::inout(const at::Tensor& t) { return staged(t, true, true); }

collective_request_t** Launch::next() {
  requests_.push_back(nullptr);
  return &requests_.back();
}

void Launch::call(collective_result_t r) {
  if (r == COLLECTIVE_OK) return;
  if (!requests_.empty() && requests_.back() == nullptr) requests_.pop_back();
  std::string message = collective_last_error();
  TORCH_CHECK(false, "collectived: ", what_, " failed: ", message);
}

void Launch::then(std::function<void()> fn) {
  if (cuda_) {
    fn();  // enqueued on the internal stream, which is current
  } else {
    steps_.push_back(std::move(fn));
  }
}

void Launch::keep(const at::Tensor& t) { tensors_.push_back(t); }

c10::intrusive_ptr<Work> Launch::submit(std::vector<at::Tensor> outputs) {
  submitted_ = true;
  if (cuda_) cuda_->finish(tensors_);
  const bool on_gpu = cuda_ != nullptr;
  auto w = c10::make_intrusive<Work>(b_.getRank(), type_, what_, std::move(outputs),
                                     std::move(cuda_), b_.config_.timeout);
  w->requests = std::move(requests_);
  w->keep_blocks = std::move(blocks_);
  w->keep_tensors = std::move(tensors_);
  if (!steps_.empty()) {
    w->on_success = [steps = std::move(steps_)] {
      for (const auto& s : steps) s();
    };
  }
  if (on_gpu) {
    w->on_cuda_failure = [e = b_.async_error_](const std::string& m) {
      std::lock_guard lock(e->mu);
      if (e->message.empty()) e->message = m;
    };
    w->cuda_submitted();
  }
  b_.progress_->enqueue(w);
  return w;
}

}  // namespace collectived::client::torch_backend
