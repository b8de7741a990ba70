// SPDX-License-Identifier: MIT
#include "ops/swiglu/validate.h"

namespace ort_ops::swiglu {

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

Inputs read_inputs(const Ort::KernelContext& ctx) { return Inputs{read_input(ctx, 0)}; }

Dims validate_inputs(const Inputs& in) {
  require_present(kOp, "x", in.x);
  require_dtype(kOp, "x", in.x, {F32, F16});
  if (in.x.rank() < 1) fail_invalid(kOp, "input 'x' must have rank >= 1, got a scalar (rank 0)");
  const int64_t width = in.x.dim(-1);
  if (width % 2 != 0)
    fail_invalid(kOp, "input 'x' must have an even last dim (2 * I), got ", width, " (shape ",
                 shape_str(in.x.shape), ")");
  Dims d;
  d.I = width / 2;
  d.y_shape = in.x.shape;
  d.y_shape.back() = d.I;
  d.rows = 1;
  for (size_t i = 0; i + 1 < in.x.shape.size(); ++i) d.rows *= in.x.shape[i];
  return d;
}

// y's dtype is x's: x is the op's one dynamically typed input, so ORT infers y from it (op_base.h).
const OpSignature& signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  static const OpSignature sig{kOp, {{ANY}}, {{ANY}}};
  return sig;
}

}  // namespace ort_ops::swiglu
