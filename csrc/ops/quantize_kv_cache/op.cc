// SPDX-License-Identifier: MIT
// QuantizeKVCache (DESIGN.md "KV cache"): key/value [T, Hkv, D] float32/float16, slot_mapping
// int64 [T], key_cache int8 [N, Hkv, B, D], value_cache int8 [N, Hkv, D, B], key_scale /
// value_scale float32 [N, Hkv, B] -> the four caches, updated. Spec:
// ort_ops/ops/quantize_kv_cache.py.
//
// Design:
// - Phase 1 (parallel over tokens): quantize every (token, kv head) K and V row into scratch
//   with the contract's row rule (DynamicQuant's row kernels: same rule, same bits).
//   Everything is validated and quantized before any output byte is written, so a failing Run
//   (bad slot, non-finite value) leaves a cache bound in place untouched.
// - Phase 2: when an output is the very buffer of its input (IOBinding of one OrtValue to both)
//   nothing is copied; otherwise the input cache is copied to the output first. Then each task
//   (one token) scatters its rows: K rows are contiguous D bytes, V codes go to
//   value_cache[blk, h, d, off] with stride B (token innermost), scales to [blk, h, off].
//   Distinct slots (checked) mean tasks never write the same bytes.
#include "ops/quantize_kv_cache/op.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/dynamic_quant/cpu.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "QuantizeKVCache";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;

class QuantizeKVCacheCpu final : public KernelImpl {
 public:
  explicit QuantizeKVCacheCpu(const OrtKernelInfo*) : isa_(selected_isa(kOp)) {
    quantize_row_ = dynamic_quant::quantize_row_fn(isa_);
    half_to_float_ = half_to_float_fn(isa_);
  }

  void compute(Ort::KernelContext& ctx) override {
    const InputView key = read_input(ctx, 0), value = read_input(ctx, 1);
    const InputView slots = read_input(ctx, 2);
    const InputView kc = read_input(ctx, 3), vc = read_input(ctx, 4);
    const InputView ks = read_input(ctx, 5), vs = read_input(ctx, 6);
    require_dtype(kOp, "key", key, {F32, F16});
    require_dtype(kOp, "value", value, {F32, F16});
    require_dtype(kOp, "slot_mapping", slots, {I64});
    require_dtype(kOp, "key_cache", kc, {I8});
    require_dtype(kOp, "value_cache", vc, {I8});
    require_dtype(kOp, "key_scale", ks, {F32});
    require_dtype(kOp, "value_scale", vs, {F32});
    require_rank(kOp, "key", key, 3);
    const int64_t T = key.dim(0), H = key.dim(1), D = key.dim(2);
    require_shape(kOp, "value", value, key.shape);
    require_shape(kOp, "slot_mapping", slots, {T});
    require_rank(kOp, "key_cache", kc, 4);
    const int64_t N = kc.dim(0), B = kc.dim(2);
    require_shape(kOp, "key_cache", kc, {N, H, B, D});
    require_shape(kOp, "value_cache", vc, {N, H, D, B});
    require_shape(kOp, "key_scale", ks, {N, H, B});
    require_shape(kOp, "value_scale", vs, {N, H, B});

    // Slots: in range, and the live ones distinct (parallel writers must not collide).
    const int64_t* slot = slots.ptr<int64_t>();
    const int64_t num_slots = N * B;
    std::vector<int64_t> live;
    live.reserve(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      if (slot[t] < 0) continue;
      if (slot[t] >= num_slots)
        fail_invalid(kOp, "input 'slot_mapping' must hold slots < ", num_slots,
                     " (num_blocks * block_size), got slot_mapping[", t, "] = ", slot[t]);
      live.push_back(slot[t]);
    }
    std::sort(live.begin(), live.end());
    const auto dup = std::adjacent_find(live.begin(), live.end());
    if (dup != live.end())
      fail_invalid(kOp, "input 'slot_mapping' must not repeat a slot, got slot ", *dup, " twice");

    // Phase 1: quantize into scratch (rows of the skipped tokens stay unused).
    const int64_t rows = T * H;
    std::vector<int8_t> kq(static_cast<size_t>(rows * D)), vq(static_cast<size_t>(rows * D));
    std::vector<float> ksc(static_cast<size_t>(rows)), vsc(static_cast<size_t>(rows));
    parallel_for(ctx, static_cast<size_t>(T), [&](size_t ti) {
      const int64_t t = static_cast<int64_t>(ti);
      if (slot[t] < 0) return;
      std::vector<float> buf(static_cast<size_t>(D));
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = t * H + h;
        if (!quantize(key, r, D, buf.data(), kq.data() + r * D, &ksc[r]))
          fail_invalid(kOp, "input 'key' must be finite, got NaN or Inf in token ", t, ", kv head ", h);
        if (!quantize(value, r, D, buf.data(), vq.data() + r * D, &vsc[r]))
          fail_invalid(kOp, "input 'value' must be finite, got NaN or Inf in token ", t, ", kv head ", h);
      }
    });

    // Phase 2: outputs; a copy of the cache unless the output is the input's own buffer.
    auto* kc_out = make_output<int8_t>(ctx, 0, kc.shape);
    auto* vc_out = make_output<int8_t>(ctx, 1, vc.shape);
    auto* ks_out = make_output<float>(ctx, 2, ks.shape);
    auto* vs_out = make_output<float>(ctx, 3, vs.shape);
    copy_unless_same(kc, kc_out, kc.numel * sizeof(int8_t));
    copy_unless_same(vc, vc_out, vc.numel * sizeof(int8_t));
    copy_unless_same(ks, ks_out, ks.numel * sizeof(float));
    copy_unless_same(vs, vs_out, vs.numel * sizeof(float));
    parallel_for(ctx, static_cast<size_t>(T), [&](size_t ti) {
      const int64_t t = static_cast<int64_t>(ti);
      if (slot[t] < 0) return;
      const int64_t blk = slot[t] / B, off = slot[t] % B;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = t * H + h;
        const int64_t bh = blk * H + h;
        std::memcpy(kc_out + (bh * B + off) * D, kq.data() + r * D, static_cast<size_t>(D));
        int8_t* vdst = vc_out + bh * D * B + off;
        for (int64_t d = 0; d < D; ++d) vdst[d * B] = vq[r * D + d];
        ks_out[bh * B + off] = ksc[r];
        vs_out[bh * B + off] = vsc[r];
      }
    });
  }

 private:
  // Quantizes row r ([D] values) of a float32/float16 input; false for a non-finite value.
  bool quantize(const InputView& x, int64_t r, int64_t D, float* buf, int8_t* q, float* s) const {
    const float* src;
    if (x.dtype == F32) {
      src = x.ptr<float>() + r * D;
    } else {
      half_to_float_(x.ptr<uint16_t>() + r * D, buf, D);
      src = buf;
    }
    if (D == 0) {
      *s = 0.0f;
      return true;
    }
    return quantize_row_(src, nullptr, D, q, s);
  }

  static void copy_unless_same(const InputView& in, void* out, size_t bytes) {
    if (out != in.data && bytes) std::memcpy(out, in.data, bytes);
  }

  CpuIsa isa_;
  dynamic_quant::QuantizeRowFn quantize_row_;
  HalfToFloatFn half_to_float_;
};

}  // namespace

const CustomOp& quantize_kv_cache_cpu_op() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  // Every output has a fixed dtype, so key and value may both be dynamically typed (the kernel
  // reports a wrong float dtype itself); the caches have fixed dtypes.
  static const CustomOp op(
      OpSpec{kOp,
             "CPUExecutionProvider",
             {{ANY}, {ANY}, {I64}, {I8}, {I8}, {F32}, {F32}},
             {{I8}, {I8}, {F32}, {F32}}},
      [](const OrtKernelInfo* info) -> std::unique_ptr<KernelImpl> {
        return std::make_unique<QuantizeKVCacheCpu>(info);
      });
  return op;
}

}  // namespace ort_ops
