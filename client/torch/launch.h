// One torch operation being submitted: where each tensor's bytes are for the
// daemon (a CPU tensor in registered memory as it is, any other CPU tensor
// through a registered staging block, a CUDA tensor as it is, on the group's
// internal stream), the requests libcollective returns, and what completes
// the Work (staged outputs copied back).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "client/collective.h"
#include "client/torch/cuda_launch.h"
#include "client/torch/work.h"

namespace collectived::client::torch_backend {

class Backend;

class Launch {
 public:
  /// `first`: a tensor of the operation; its device decides CPU or CUDA.
  Launch(Backend& b, c10d::OpType type, std::string what, const at::Tensor& first);
  ~Launch();
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  bool cuda() const { return cuda_ != nullptr; }
  /// The internal stream (CUDA), or null.
  void* stream() const;
  const std::string& what() const { return what_; }

  /// Refuses a tensor on another device than the operation's, or not
  /// contiguous, with an error naming `role`.
  void check(const at::Tensor& t, const char* role) const;
  /// The bytes the daemon reads for `t` (staged: copied now).
  const void* in(const at::Tensor& t);
  /// The bytes the daemon writes for `t` (staged: copied back on success).
  void* out(const at::Tensor& t);
  /// Read and written (in place).
  void* inout(const at::Tensor& t);
  /// Where libcollective puts the next request.
  collective_request_t** next();
  /// Throws the library's message when `r` is not OK.
  void call(collective_result_t r);
  /// Runs on success, after the staged outputs before it were copied back
  /// (CPU); CUDA: run now, on the internal stream.
  void then(std::function<void()> fn);
  /// Kept alive until the operation completes.
  void keep(const at::Tensor& t);

  /// Hands the operation to the group's Progress and returns its Work.
  c10::intrusive_ptr<Work> submit(std::vector<at::Tensor> outputs);

 private:
  void* staged(const at::Tensor& t, bool copy_in, bool copy_out);
  Backend& b_;
  c10d::OpType type_;
  std::string what_;
  std::unique_ptr<CudaLaunch> cuda_;
  std::vector<collective_request_t*> requests_;
  std::vector<std::function<void()>> steps_;
  std::vector<c10::DataPtr> blocks_;
  std::vector<at::Tensor> tensors_;
  bool submitted_ = false;
};

}  // namespace collectived::client::torch_backend
