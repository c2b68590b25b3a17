// How torch's element types and reductions map onto libcollective's, and the
// errors for those that do not (client/collective.h: collective_dtype_t,
// collective_redop_t).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>

#include "client/collective.h"

namespace collectived::client::torch_backend {

/// What one reduction becomes on the wire.
struct Reduction {
  collective_redop_t op = COLLECTIVE_SUM;
  /// PREMUL_SUM: the inputs are scaled by this first (then SUM). Either a
  /// scalar or a one-element tensor (FSDP passes both kinds).
  bool premul = false;
  double factor = 1.0;
  at::Tensor factor_tensor;
};

/// The wire type of a tensor's elements for `what` (the operation's name, for
/// errors). Complex tensors travel as their real view (2 elements each);
/// bool as uint8. Throws c10::Error naming the dtype for the rest.
collective_dtype_t wire_dtype(const at::Tensor& t, const char* what);

/// Elements on the wire for `t` (complex counts twice).
std::size_t wire_count(const at::Tensor& t);

/// The reduction for `op` on tensors like `t`: bool SUM becomes MAX (logical
/// or, as ProcessGroupNCCL does, so that uint8 cannot overflow), bool AVG and
/// complex MIN/MAX/PRODUCT are refused, BAND/BOR/BXOR are refused by name.
Reduction wire_reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* what);

std::string reduce_op_name(const c10d::ReduceOp& op);

}  // namespace collectived::client::torch_backend
