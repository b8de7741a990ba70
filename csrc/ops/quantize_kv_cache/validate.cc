// SPDX-License-Identifier: MIT
#include "ops/quantize_kv_cache/validate.h"

#include <algorithm>
#include <vector>

namespace ort_ops::quantize_kv_cache {

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;

Inputs read_inputs(const Ort::KernelContext& ctx) {
  return Inputs{read_input(ctx, 0), read_input(ctx, 1), read_input(ctx, 2), read_input(ctx, 3),
                read_input(ctx, 4), read_input(ctx, 5), read_input(ctx, 6)};
}

void check_cache_dtypes(const char* op, const Caches& c) {
  require_dtype(op, "slot_mapping", c.slot_mapping, {I64});
  require_dtype(op, "key_cache", c.key_cache, {I8});
  require_dtype(op, "value_cache", c.value_cache, {I8});
  require_dtype(op, "key_scale", c.key_scale, {F32});
  require_dtype(op, "value_scale", c.value_scale, {F32});
}

Dims check_cache_shapes(const char* op, const Caches& c, int64_t T, int64_t H, int64_t D) {
  require_shape(op, "slot_mapping", c.slot_mapping, {T});
  require_rank(op, "key_cache", c.key_cache, 4);
  const int64_t N = c.key_cache.dim(0), B = c.key_cache.dim(2);
  require_shape(op, "key_cache", c.key_cache, {N, H, B, D});
  require_shape(op, "value_cache", c.value_cache, {N, H, D, B});
  require_shape(op, "key_scale", c.key_scale, {N, H, B});
  require_shape(op, "value_scale", c.value_scale, {N, H, B});
  return Dims{T, H, D, N, B};
}

Dims validate_inputs(const Inputs& in, const DeviceChecks& device) {
  require_dtype(kOp, "key", in.key, {F32, F16});
  require_dtype(kOp, "value", in.value, {F32, F16});
  if (device.key_value_dtypes) device.key_value_dtypes(in.key, in.value);
  check_cache_dtypes(kOp, in.caches());
  require_rank(kOp, "key", in.key, 3);
  const int64_t T = in.key.dim(0), H = in.key.dim(1), D = in.key.dim(2);
  require_shape(kOp, "value", in.value, in.key.shape);
  return check_cache_shapes(kOp, in.caches(), T, H, D);
}

int64_t check_slots(const char* op, const int64_t* slot, const Dims& d) {
  // Live slots distinct: parallel writers (CPU tasks, CUDA threads) must not collide.
  const int64_t num_slots = d.N * d.B;
  std::vector<int64_t> live;
  live.reserve(static_cast<size_t>(d.T));
  for (int64_t t = 0; t < d.T; ++t) {
    if (slot[t] < 0) continue;
    if (slot[t] >= num_slots)
      fail_invalid(op, "input 'slot_mapping' must hold slots < ", num_slots,
                   " (num_blocks * block_size), got slot_mapping[", t, "] = ", slot[t]);
    live.push_back(slot[t]);
  }
  std::sort(live.begin(), live.end());
  const auto dup = std::adjacent_find(live.begin(), live.end());
  if (dup != live.end())
    fail_invalid(op, "input 'slot_mapping' must not repeat a slot, got slot ", *dup, " twice");
  return static_cast<int64_t>(live.size());
}

// Every output has a fixed dtype, so key and value may both be dynamically typed (the kernels report a
// wrong float dtype themselves); the caches have fixed dtypes.
const OpSignature& signature() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  static const OpSignature sig{kOp, {{ANY}, {ANY}, {I64}, {I8}, {I8}, {F32}, {F32}}, {{I8}, {I8}, {F32}, {F32}}};
  return sig;
}

}  // namespace ort_ops::quantize_kv_cache
