// The CUDA side of one operation on CUDA tensors: the group's internal
// stream on the tensors' device waits for the caller's current stream
// (an event), libcollective's stream-ordered calls go on the internal stream,
// and an end event lets the caller's stream, the Work and the future wait for
// it without blocking the CPU. The same shape as ProcessGroupNCCL's.
// Where torch has no CUDA (COLLECTIVED_TORCH_CUDA=0), CudaLaunch refuses CUDA tensors.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace collectived::client::torch_backend {

/// The internal streams of one process group, one per device, made at first use.
class CudaStreams {
 public:
  CudaStreams();
  ~CudaStreams();
  CudaStreams(const CudaStreams&) = delete;
  CudaStreams& operator=(const CudaStreams&) = delete;
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

class CudaLaunch {
 public:
  /// Makes the internal stream of `device` wait for the caller's current
  /// stream there, and makes it current (allocations for temporaries then
  /// belong to it) until finish().
  CudaLaunch(CudaStreams& streams, c10::Device device);
  ~CudaLaunch();
  CudaLaunch(const CudaLaunch&) = delete;
  CudaLaunch& operator=(const CudaLaunch&) = delete;

  /// The internal stream, as libcollective takes it (a cudaStream_t).
  void* stream() const;
  c10::Device device() const;
  /// After the operation's calls: records the end event, and marks every
  /// tensor as used on the internal stream (the caching allocator then keeps
  /// its memory until the stream is past it).
  void finish(const std::vector<at::Tensor>& used);
  /// Makes the caller's stream current again (after the future was marked).
  void restore();
  /// The end event has been reached (never blocks).
  bool done() const;
  /// Makes the caller's current stream on the device wait for the end event.
  void block_current_stream() const;
  /// Blocks the CPU until the end event is reached.
  void synchronize() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

/// Whether this build drives CUDA tensors.
bool cuda_built();

}  // namespace collectived::client::torch_backend
