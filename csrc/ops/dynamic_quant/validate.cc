// SPDX-License-Identifier: MIT
#include "ops/dynamic_quant/validate.h"

namespace ort_ops::dynamic_quant {

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

Inputs read_inputs(const Ort::KernelContext& ctx) {
  return Inputs{read_input(ctx, 0), read_input(ctx, 1)};
}

Dims validate_inputs(const Inputs& in) {
  require_present(kOp, "x", in.x);
  require_dtype(kOp, "x", in.x, {F32, F16});
  if (in.x.rank() < 1) fail_invalid(kOp, "input 'x' must have rank >= 1, got a scalar (rank 0)");
  Dims d;
  d.K = in.x.dim(-1);
  if (in.smooth_scale.present) {
    require_dtype(kOp, "smooth_scale", in.smooth_scale, {F32, F16});
    require_shape(kOp, "smooth_scale", in.smooth_scale, {d.K});
  }
  d.scale_shape.assign(in.x.shape.begin(), in.x.shape.end() - 1);
  d.rows = 1;
  for (int64_t s : d.scale_shape) d.rows *= s;
  return d;
}

// Every output has a fixed dtype, so x and smooth_scale may both be dynamically typed (the kernels report a
// wrong float dtype themselves).
const OpSignature& signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static const OpSignature sig{kOp, {{ANY}, {ANY, true}}, {{I8}, {F32}}};
  return sig;
}

}  // namespace ort_ops::dynamic_quant
