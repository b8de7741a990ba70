// SPDX-License-Identifier: MIT
#include "ops/moe_finalize_routing/validate.h"

namespace ort_ops::moe_finalize_routing {

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;

Inputs read_inputs(const Ort::KernelContext& ctx) {
  return Inputs{read_input(ctx, 0), read_input(ctx, 1), read_input(ctx, 2), read_input(ctx, 3)};
}

Dims validate_inputs(const Inputs& in) {
  require_present(kOp, "expert_out", in.expert_out);
  require_present(kOp, "sorted_to_flat", in.sorted_to_flat);
  require_present(kOp, "topk_weights", in.topk_weights);
  require_dtype(kOp, "topk_weights", in.topk_weights, {F32, F16});
  require_rank(kOp, "topk_weights", in.topk_weights, 2);
  const int64_t m = in.topk_weights.dim(0), k = in.topk_weights.dim(1), total = m * k;
  require_dtype(kOp, "expert_out", in.expert_out, {F32, F16});
  require_rank(kOp, "expert_out", in.expert_out, 2);
  const int64_t h = in.expert_out.dim(1);
  require_shape(kOp, "expert_out", in.expert_out, {total, h});
  require_dtype(kOp, "sorted_to_flat", in.sorted_to_flat, {I32});
  require_shape(kOp, "sorted_to_flat", in.sorted_to_flat, {total});
  if (in.residual.present) {
    require_dtype(kOp, "residual", in.residual, {F32, F16});
    require_shape(kOp, "residual", in.residual, {m, h});
  }
  return Dims{m, k, h, total};
}

// The output is fixed float32, so every input may be dynamically typed (the kernels check them).
const OpSignature& signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static const OpSignature sig{kOp, {{ANY}, {ANY}, {ANY}, {ANY, true}}, {{F32}}};
  return sig;
}

}  // namespace ort_ops::moe_finalize_routing
