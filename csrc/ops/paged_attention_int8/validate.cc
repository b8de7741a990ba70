// SPDX-License-Identifier: MIT
#include "ops/paged_attention_int8/validate.h"

#include <cmath>

namespace ort_ops::paged_attention_int8 {

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;

float Attrs::softmax_scale(int64_t D) const {
  return has_scale ? scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
}

Attrs parse_attrs(const OrtKernelInfo* info, const DeviceChecks& device) {
  Attrs a;
  const std::string qk = attr_string(info, "qk_quant", "s8");
  a.pv_quant = attr_string(info, "pv_quant", "s8");
  if (qk != "s8" && qk != "none")
    fail_invalid(kOp, "attribute 'qk_quant' must be s8 or none, got '", qk, "'");
  if (a.pv_quant != "s8" && a.pv_quant != "u8" && a.pv_quant != "none")
    fail_invalid(kOp, "attribute 'pv_quant' must be s8, u8 or none, got '", a.pv_quant, "'");
  a.qk_s8 = qk == "s8";
  if (device.attrs) device.attrs(a);
  a.partition_size = attr_int(info, "partition_size", 256);
  if (a.partition_size <= 0 || a.partition_size % 32 != 0)
    fail_invalid(kOp, "attribute 'partition_size' must be a positive multiple of 32, got ",
                 a.partition_size);
  a.has_scale = has_attr(info, "scale");
  if (a.has_scale) {
    a.scale = attr_float(info, "scale", 0.0f);
    if (!std::isfinite(a.scale))
      fail_invalid(kOp, "attribute 'scale' must be finite, got ", a.scale);
  }
  a.window = attr_int(info, "window", 0);
  if (a.window < 0)
    fail_invalid(kOp, "attribute 'window' must be >= 0 (0: no window), got ", a.window);
  a.softcap = attr_float(info, "softcap", 0.0f);
  if (!std::isfinite(a.softcap) || a.softcap < 0.0f)
    fail_invalid(kOp, "attribute 'softcap' must be finite and >= 0 (0: off), got ", a.softcap);
  return a;
}

Inputs read_inputs(const Ort::KernelContext& ctx) {
  return Inputs{read_input(ctx, 0), read_input(ctx, 1), read_input(ctx, 2), read_input(ctx, 3),
                read_input(ctx, 4), read_input(ctx, 5), read_input(ctx, 6), read_input(ctx, 7),
                read_input(ctx, 8)};
}

Dims validate_inputs(const Inputs& in, const DeviceChecks& device) {
  const InputView &q = in.query, &kc = in.key_cache, &bt = in.block_tables, &cu = in.cu_seqlens_q;
  require_dtype(kOp, "query", q, {F32, F16});
  require_dtype(kOp, "key_cache", kc, {I8});
  require_dtype(kOp, "value_cache", in.value_cache, {I8});
  require_dtype(kOp, "key_scale", in.key_scale, {F32});
  require_dtype(kOp, "value_scale", in.value_scale, {F32});
  require_dtype(kOp, "block_tables", bt, {I32});
  require_dtype(kOp, "seq_lens", in.seq_lens, {I32});
  require_rank(kOp, "query", q, 3);
  const int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2);
  require_rank(kOp, "key_cache", kc, 4);
  const int64_t N = kc.dim(0), Hkv = kc.dim(1), B = kc.dim(2);
  require_shape(kOp, "key_cache", kc, {N, Hkv, B, D});
  if (device.head_dim_and_block_size) device.head_dim_and_block_size(D, B);
  if (Hkv <= 0 || Hq % Hkv != 0)
    fail_invalid(kOp, "query heads (", Hq, ") must be a multiple of kv heads (", Hkv,
                 ", dim 1 of input 'key_cache')");
  require_shape(kOp, "value_cache", in.value_cache, {N, Hkv, D, B});
  require_shape(kOp, "key_scale", in.key_scale, {N, Hkv, B});
  require_shape(kOp, "value_scale", in.value_scale, {N, Hkv, B});
  require_rank(kOp, "block_tables", bt, 2);
  const int64_t S = bt.dim(0), M = bt.dim(1);
  require_shape(kOp, "seq_lens", in.seq_lens, {S});
  if (cu.present) {
    require_dtype(kOp, "cu_seqlens_q", cu, {I32});
    require_shape(kOp, "cu_seqlens_q", cu, {S + 1});
  } else if (T != S) {
    fail_invalid(kOp, "input 'query' must have T == S == ", S,
                 " rows in decode (no 'cu_seqlens_q'), got T = ", T);
  }
  if (in.head_sink.present) {
    require_dtype(kOp, "head_sink", in.head_sink, {F32});
    require_shape(kOp, "head_sink", in.head_sink, {Hq});
  }
  return Dims{T, Hq, D, N, Hkv, B, S, M};
}

// The output dtype follows the query's, so the query is the one dynamically typed input (the kernels
// report a wrong float dtype); the other inputs have fixed dtypes, which ORT checks at session creation.
const OpSignature& signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static const OpSignature sig{kOp, {{ANY}, {I8}, {I8}, {F32}, {F32}, {I32}, {I32}, {I32, true}, {F32, true}}, {{ANY}}};
  return sig;
}

}  // namespace ort_ops::paged_attention_int8
