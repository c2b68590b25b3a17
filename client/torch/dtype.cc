#include "client/torch/dtype.h"

#include <c10/util/Exception.h>

namespace collectived::client::torch_backend {

collective_dtype_t wire_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return COLLECTIVE_FLOAT32;
    case at::kDouble: return COLLECTIVE_FLOAT64;
    case at::kHalf: return COLLECTIVE_FLOAT16;
    case at::kBFloat16: return COLLECTIVE_BFLOAT16;
    case at::kChar: return COLLECTIVE_INT8;
    case at::kByte: return COLLECTIVE_UINT8;
    case at::kBool: return COLLECTIVE_UINT8;
    case at::kInt: return COLLECTIVE_INT32;
    case at::kUInt32: return COLLECTIVE_UINT32;
    case at::kLong: return COLLECTIVE_INT64;
    case at::kUInt64: return COLLECTIVE_UINT64;
    case at::kComplexFloat: return COLLECTIVE_FLOAT32;
    case at::kComplexDouble: return COLLECTIVE_FLOAT64;
    case at::kComplexHalf: return COLLECTIVE_FLOAT16;
    default: break;
  }
  TORCH_CHECK(false, "collectived: ", what, " does not take dtype ", t.scalar_type(),
              " (supported: float32, float64, float16, bfloat16, int8, uint8, int32, uint32, "
              "int64, uint64, bool, and complex64/complex128 as their real view)");
}

std::size_t wire_count(const at::Tensor& t) {
  const auto n = static_cast<std::size_t>(t.numel());
  return t.is_complex() ? 2 * n : n;
}

std::string reduce_op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

Reduction wire_reduction(const c10d::ReduceOp& op, const at::Tensor& t, const char* what) {
  Reduction r;
  const bool is_bool = t.scalar_type() == at::kBool;
  if (t.is_complex()) {
    TORCH_CHECK(op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG ||
                    op.op_ == c10d::ReduceOp::PREMUL_SUM,
                "collectived: ", what, " of complex tensors takes SUM, AVG or PREMUL_SUM only, "
                "not ", reduce_op_name(op), " (a complex value has no order and its product "
                "is not element-wise on the real view)");
  }
  switch (op.op_) {
    case c10d::ReduceOp::SUM: r.op = is_bool ? COLLECTIVE_MAX : COLLECTIVE_SUM; return r;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(!is_bool, "collectived: ", what, ": ReduceOp.AVG does not take bool tensors");
      r.op = COLLECTIVE_AVG;
      return r;
    case c10d::ReduceOp::PRODUCT: r.op = COLLECTIVE_PROD; return r;
    case c10d::ReduceOp::MIN: r.op = COLLECTIVE_MIN; return r;
    case c10d::ReduceOp::MAX: r.op = COLLECTIVE_MAX; return r;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK(t.is_floating_point() || t.is_complex(), "collectived: ", what,
                  ": PREMUL_SUM takes floating-point tensors, not ", t.scalar_type());
      const auto* s = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(s != nullptr, "collectived: ", what,
                  ": PREMUL_SUM without its factor (make it with "
                  "torch.distributed._make_nccl_premul_sum)");
      r.op = COLLECTIVE_SUM;
      r.premul = true;
      if (s->tensor_factor.defined()) {
        r.factor_tensor = s->tensor_factor;
      } else {
        r.factor = s->double_factor;
      }
      return r;
    }
    default: break;
  }
  TORCH_CHECK(false, "collectived: ", what, " does not support ReduceOp.", reduce_op_name(op),
              " (supported: SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)");
}

}  // namespace collectived::client::torch_backend
