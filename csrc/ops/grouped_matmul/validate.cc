// SPDX-License-Identifier: MIT
#include "ops/grouped_matmul/validate.h"

#include <cmath>
#include <string>

namespace ort_ops::grouped_matmul {

constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

Inputs read_inputs(const Ort::KernelContext& ctx) {
  return Inputs{read_input(ctx, 0), read_input(ctx, 1), read_input(ctx, 2), read_input(ctx, 3),
                read_input(ctx, 4), read_input(ctx, 5)};
}

Dims validate_inputs(const char* op, const Inputs& in, bool even_n, const DeviceChecks& device) {
  const InputView &x = in.x, &w = in.weight, &ws = in.weight_scale, &xs = in.x_scale,
                  &gl = in.group_list;
  require_present(op, "x", x);
  require_present(op, "weight", w);
  require_present(op, "weight_scale", ws);
  require_present(op, "x_scale", xs);
  require_present(op, "group_list", gl);
  require_dtype(op, "x", x, {I8});
  require_rank(op, "x", x, 2);
  require_dtype(op, "weight", w, {I8});
  require_rank(op, "weight", w, 3);
  const Dims d{x.dim(0), x.dim(1), w.dim(2), w.dim(0)};
  if (w.dim(1) != d.k)
    fail_invalid(op, "input 'weight' must have shape [E, ", d.k, ", N] (K of 'x'), got ",
                 shape_str(w.shape));
  if (even_n && d.n % 2 != 0)
    fail_invalid(op, "input 'weight' must have an even N (last dim), got ", d.n);
  if (device.after_weight) device.after_weight(op, d);
  require_dtype(op, "weight_scale", ws, {F32, F16});
  require_shape(op, "weight_scale", ws, {d.e, d.n});
  require_dtype(op, "x_scale", xs, {F32, F16});
  require_shape(op, "x_scale", xs, {d.m});
  require_dtype(op, "group_list", gl, {I64});
  require_shape(op, "group_list", gl, {d.e});
  if (in.bias.present) {
    require_dtype(op, "bias", in.bias, {F32});
    require_shape(op, "bias", in.bias, {d.e, d.n});
  }
  return d;
}

// Every output has a fixed dtype, so every input may be dynamically typed and the kernels name the
// input in their own dtype errors.
const OpSignature& swiglu_quant_signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static const OpSignature sig{"GroupedMatmulSwigluQuant",
                               {{ANY}, {ANY}, {ANY}, {ANY}, {ANY}, {ANY, /*optional=*/true}},
                               {{I8}, {F32}, {F32}}};
  return sig;
}

// As GroupedMatmulSwigluQuant (input 5, bias, optional); the output is fixed float32.
const OpSignature& dequant_signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static const OpSignature sig{"GroupedMatmulDequant",
                               {{ANY}, {ANY}, {ANY}, {ANY}, {ANY}, {ANY, /*optional=*/true}},
                               {{F32}}};
  return sig;
}

int64_t read_group_list_type(const char* op, const OrtKernelInfo* info) {
  const int64_t t = attr_int(info, "group_list_type", 0);
  if (t != 0 && t != 1)
    fail_invalid(op, "attribute 'group_list_type' must be 0 (cumulative) or 1 (counts), got ", t);
  return t;
}

Act read_activation(const char* op, const OrtKernelInfo* info) {
  Act act;
  const std::string s = attr_string(info, "activation", "");
  if (s == "swiglu_oai")
    act.kind = Activation::kSwigluOai;
  else if (s.empty() && has_attr(info, "activation"))
    fail_invalid(op,
                 "attribute 'activation' must be 'swiglu' or 'swiglu_oai', got a non-string value");
  else if (!s.empty() && s != "swiglu")
    fail_invalid(op, "attribute 'activation' must be 'swiglu' or 'swiglu_oai', got '", s, "'");
  act.alpha = attr_float(info, "alpha", kOaiAlpha);
  act.limit = attr_float(info, "limit", kOaiLimit);
  if (!std::isfinite(act.alpha))
    fail_invalid(op, "attribute 'alpha' must be finite, got ", act.alpha);
  if (!(std::isfinite(act.limit) && act.limit > 0.0f))
    fail_invalid(op, "attribute 'limit' must be finite and > 0, got ", act.limit);
  return act;
}

}  // namespace ort_ops::grouped_matmul
