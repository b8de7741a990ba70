// SPDX-License-Identifier: MIT
#include "ops/moe_init_routing/validate.h"

#include <climits>

namespace ort_ops::moe_init_routing {

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;

int64_t read_num_experts(const OrtKernelInfo* info) {
  const int64_t num_experts = attr_int(info, "num_experts", -1);
  if (num_experts < 1)
    fail_invalid(kOp, "attribute 'num_experts' must be given and >= 1, got ", num_experts);
  return num_experts;
}

Inputs read_inputs(const Ort::KernelContext& ctx) {
  return Inputs{read_input(ctx, 0), read_input(ctx, 1), read_input(ctx, 2)};
}

Dims validate_inputs(const Inputs& in) {
  const InputView &x = in.x, &ids = in.expert_ids;
  require_present(kOp, "x", x);
  require_present(kOp, "expert_ids", ids);
  require_dtype(kOp, "x", x, {F32, F16, I8});
  require_rank(kOp, "x", x, 2);
  require_dtype(kOp, "expert_ids", ids, {I32});
  require_rank(kOp, "expert_ids", ids, 2);
  const int64_t m = x.dim(0), h = x.dim(1), k = ids.dim(1);
  if (ids.dim(0) != m)
    fail_invalid(kOp, "input 'expert_ids' must have shape [", m, ", K] (rows of 'x'), got ",
                 shape_str(ids.shape));
  const bool int8 = x.dtype == I8;
  if (int8 != in.x_scale.present)
    fail_invalid(kOp, "input 'x_scale' must be given exactly when 'x' is int8 (its row scales), got x ",
                 dtype_name(x.dtype), in.x_scale.present ? " with" : " without", " x_scale");
  if (int8) {
    require_dtype(kOp, "x_scale", in.x_scale, {F32});
    require_shape(kOp, "x_scale", in.x_scale, {m});
  }
  const int64_t total = m * k;
  if (total > INT32_MAX)  // sorted_to_flat is int32 (the contract)
    fail_unsupported(kOp, "M * K must be <= ", INT32_MAX, " (sorted_to_flat is int32), got ",
                     total);
  return Dims{m, h, k, total, int8 ? 1 : x.dtype == F32 ? 4 : 2};
}

void check_expert_ids(const int32_t* id, const Dims& d, int64_t num_experts) {
  for (int64_t f = 0; f < d.total; ++f)
    if (id[f] < 0 || id[f] >= num_experts)
      fail_invalid(kOp, "input 'expert_ids' must be in [0, ", num_experts, "), got ", id[f],
                   " at token ", f / d.K, ", slot ", f % d.K);
}

// sorted_x follows x's dtype: x is the one dynamically typed input (ORT infers the output from it);
// expert_ids is fixed int32, so ORT refuses another dtype when the session is created.
const OpSignature& signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static const OpSignature sig{kOp, {{ANY}, {I32}, {F32, /*optional=*/true}},
                               {{ANY}, {I32}, {I64}, {F32, /*optional=*/true}}};
  return sig;
}

}  // namespace ort_ops::moe_init_routing
