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

#include <cstring>
#include <vector>

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/dynamic_quant/cpu.h"
#include "ops/quantize_kv_cache/validate.h"

namespace ort_ops {
namespace {

namespace kvc = quantize_kv_cache;

using kvc::kOp;

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;

class QuantizeKVCacheCpu final : public KernelImpl {
 public:
  explicit QuantizeKVCacheCpu(const OrtKernelInfo*) : isa_(selected_isa(kOp)) {
    quantize_row_ = dynamic_quant::quantize_row_fn(isa_);
    half_to_float_ = half_to_float_fn(isa_);
  }

  void compute(Ort::KernelContext& ctx) override {
    const kvc::Inputs in = kvc::read_inputs(ctx);
    const kvc::Dims dims = kvc::validate_inputs(in, {});
    const InputView &key = in.key, &value = in.value, &kc = in.key_cache, &vc = in.value_cache,
                    &ks = in.key_scale, &vs = in.value_scale;
    const int64_t T = dims.T, H = dims.H, D = dims.D, B = dims.B;
    const int64_t* slot = in.slot_mapping.ptr<int64_t>();
    kvc::check_slots(slot, dims);  // in range, live ones distinct: tasks never collide

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
  static const CustomOp op(quantize_kv_cache::signature(), kCpuEp, make_kernel<QuantizeKVCacheCpu>);
  return op;
}

}  // namespace ort_ops
