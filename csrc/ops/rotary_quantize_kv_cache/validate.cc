// SPDX-License-Identifier: MIT
#include "ops/rotary_quantize_kv_cache/validate.h"

#include <string>

namespace ort_ops::rotary_quantize_kv_cache {

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

Attrs read_attrs(const OrtKernelInfo* info) {
  Attrs a;
  a.num_heads = attr_int(info, "num_heads", 0);
  if (a.num_heads <= 0) fail_invalid(kOp, "attribute 'num_heads' must be given and > 0, got ", a.num_heads);
  a.kv_num_heads = attr_int(info, "kv_num_heads", 0);
  if (a.kv_num_heads <= 0)
    fail_invalid(kOp, "attribute 'kv_num_heads' must be given and > 0, got ", a.kv_num_heads);
  if (a.num_heads % a.kv_num_heads != 0)
    fail_invalid(kOp, "attribute 'num_heads' must be a multiple of 'kv_num_heads' (", a.kv_num_heads, "), got ",
                 a.num_heads);
  const int64_t interleaved = attr_int(info, "interleaved", 0);
  if (interleaved != 0 && interleaved != 1)
    fail_invalid(kOp, "attribute 'interleaved' must be 0 or 1, got ", interleaved);
  a.interleaved = interleaved == 1;
  return a;
}

Inputs read_inputs(const Ort::KernelContext& ctx) {
  return Inputs{read_input(ctx, 0), read_input(ctx, 1), read_input(ctx, 2),
                {read_input(ctx, 3), read_input(ctx, 4), read_input(ctx, 5), read_input(ctx, 6), read_input(ctx, 7)}};
}

Dims validate_inputs(const Inputs& in, const Attrs& a) {
  require_dtype(kOp, "qkv", in.qkv, {F32, F16});
  for (const auto& [name, v] : {std::pair<const char*, const InputView&>{"cos", in.cos}, {"sin", in.sin}})
    if (v.dtype != in.qkv.dtype)
      fail_invalid(kOp, "input '", name, "' must have the dtype of 'qkv' (", dtype_name(in.qkv.dtype), "), got ",
                   dtype_name(v.dtype));
  require_dtype(kOp, "cos", in.cos, {F32, F16});  // the alignment check
  require_dtype(kOp, "sin", in.sin, {F32, F16});
  quantize_kv_cache::check_cache_dtypes(kOp, in.caches);
  require_rank(kOp, "qkv", in.qkv, 2);
  const int64_t T = in.qkv.dim(0), width = in.qkv.dim(1);
  const int64_t heads = a.num_heads + 2 * a.kv_num_heads;
  if (width % heads != 0 || width == 0)
    fail_invalid(kOp, "input 'qkv' must have a last dim (num_heads + 2 * kv_num_heads) * head_dim = ", heads,
                 " * head_dim with head_dim > 0, got ", width);
  const int64_t D = width / heads;
  if (in.cos.rank() != 2 || in.cos.dim(0) != T || in.cos.dim(1) < 1 || in.cos.dim(1) > D / 2)
    fail_invalid(kOp, "input 'cos' must have shape [", T, ", R/2] with 1 <= R/2 <= head_dim/2 = ", D / 2, ", got ",
                 shape_str(in.cos.shape));
  require_shape(kOp, "sin", in.sin, in.cos.shape);
  Dims d;
  d.T = T;
  d.Hq = a.num_heads;
  d.Hkv = a.kv_num_heads;
  d.D = D;
  d.half = in.cos.dim(1);
  d.cache = quantize_kv_cache::check_cache_shapes(kOp, in.caches, T, a.kv_num_heads, D);
  return d;
}

namespace {

// query's dtype (qkv's) and shape [T, Hq, D] for ORT's graph resolution: with three dynamically
// typed inputs ORT does not infer the output's type itself. A dim the graph leaves open (or a
// graph the kernel will refuse) gets a symbolic dim; the kernel reports what is wrong at Run.
OrtStatusPtr ORT_API_CALL infer_outputs(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  using Dim = Ort::ShapeInferContext::SymbolicInteger;
  try {
    const OrtApi& api = Ort::GetApi();
    OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by ctx
    Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(ctx, 0, &info));
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    Ort::ThrowOnError(api.GetTensorElementType(info, &type));
    Ort::ShapeInferContext sctx(&api, ctx);
    const Ort::ShapeInferContext::Shape& qkv = sctx.GetInputShape(0);
    Ort::ShapeInferContext::Shape query{Dim("RotaryQuantizeKVCache_tokens"), Dim("RotaryQuantizeKVCache_heads"),
                                        Dim("RotaryQuantizeKVCache_head_dim")};
    if (!qkv.empty()) query[0] = qkv[0];
    int64_t hq = 0, hkv = 0;
    try {
      hq = sctx.GetAttrInt("num_heads");
      hkv = sctx.GetAttrInt("kv_num_heads");
    } catch (const Ort::Exception&) {  // missing: the kernel refuses the node with its message
    }
    if (hq > 0) query[1] = Dim(hq);
    const int64_t heads = hq + 2 * hkv;
    if (hq > 0 && hkv > 0 && qkv.size() == 2 && qkv[1].IsInt() && qkv[1].AsInt() > 0 && qkv[1].AsInt() % heads == 0)
      query[2] = Dim(qkv[1].AsInt() / heads);
    return sctx.SetOutputShape(0, query, type).release();
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), (std::string(kOp) + ": " + e.what()).c_str());
  }
}

}  // namespace

// qkv, cos and sin are dynamically typed (float32 or float16, one dtype, checked by the kernels);
// infer_outputs gives query qkv's dtype. The caches have fixed dtypes.
const OpSignature& signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  static const OpSignature sig{kOp,
                               {{ANY}, {ANY}, {ANY}, {I64}, {I8}, {I8}, {F32}, {F32}},
                               {{ANY}, {I8}, {I8}, {F32}, {F32}},
                               infer_outputs};
  return sig;
}

}  // namespace ort_ops::rotary_quantize_kv_cache
