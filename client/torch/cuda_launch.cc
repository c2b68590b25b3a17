#include "client/torch/cuda_launch.h"

#include <c10/util/Exception.h>

#if COLLECTIVED_TORCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace collectived::client::torch_backend {

#if COLLECTIVED_TORCH_CUDA

struct CudaStreams::Impl {
  std::mutex mu;
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  c10::cuda::CUDAStream get(c10::DeviceIndex d) {
    std::lock_guard lock(mu);
    auto it = streams.find(d);
    if (it == streams.end()) {
      it = streams.emplace(d, c10::cuda::getStreamFromPool(/*isHighPriority=*/true, d)).first;
    }
    return it->second;
  }
};

struct CudaLaunch::State {
  c10::Device device;
  c10::cuda::CUDAStream internal;
  c10::cuda::CUDAStream caller;
  at::cuda::CUDAEvent end{cudaEventDisableTiming};
  std::optional<c10::cuda::CUDAStreamGuard> guard;
  State(c10::Device d, c10::cuda::CUDAStream i, c10::cuda::CUDAStream c)
      : device(d), internal(i), caller(c) {}
};

CudaStreams::CudaStreams() : impl_(std::make_unique<Impl>()) {}
CudaStreams::~CudaStreams() = default;

CudaLaunch::CudaLaunch(CudaStreams& streams, c10::Device device) {
  c10::cuda::CUDAGuard device_guard(device);
  auto caller = c10::cuda::getCurrentCUDAStream(device.index());
  auto internal = streams.impl().get(device.index());
  s_ = std::make_unique<State>(device, internal, caller);
  at::cuda::CUDAEvent ready(cudaEventDisableTiming);
  ready.record(caller);
  ready.block(internal);
  s_->guard.emplace(internal);
}

CudaLaunch::~CudaLaunch() = default;

void* CudaLaunch::stream() const { return s_->internal.stream(); }
c10::Device CudaLaunch::device() const { return s_->device; }

void CudaLaunch::finish(const std::vector<at::Tensor>& used) {
  s_->end.record(s_->internal);
  for (const auto& t : used) {
    if (t.defined() && t.is_cuda() && t.storage().data_ptr().get() != nullptr) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), s_->internal);
    }
  }
}

void CudaLaunch::restore() { s_->guard.reset(); }

bool CudaLaunch::done() const { return s_->end.query(); }

void CudaLaunch::block_current_stream() const {
  s_->end.block(c10::cuda::getCurrentCUDAStream(s_->device.index()));
}

void CudaLaunch::synchronize() const { s_->end.synchronize(); }

bool cuda_built() { return true; }

#else  // no CUDA in this torch

struct CudaStreams::Impl {};
struct CudaLaunch::State {};
CudaStreams::CudaStreams() : impl_(std::make_unique<Impl>()) {}
CudaStreams::~CudaStreams() = default;
CudaLaunch::CudaLaunch(CudaStreams&, c10::Device) {
  TORCH_CHECK(false, "collectived: this build of collectived_torch has no CUDA support");
}
CudaLaunch::~CudaLaunch() = default;
void* CudaLaunch::stream() const { return nullptr; }
c10::Device CudaLaunch::device() const { return c10::Device(c10::DeviceType::CPU); }
void CudaLaunch::finish(const std::vector<at::Tensor>&) {}
void CudaLaunch::restore() {}
bool CudaLaunch::done() const { return true; }
void CudaLaunch::block_current_stream() const {}
void CudaLaunch::synchronize() const {}
bool cuda_built() { return false; }

#endif

}  // namespace collectived::client::torch_backend
