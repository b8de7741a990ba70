// SPDX-License-Identifier: MIT
// RotaryQuantizeKVCache (DESIGN.md "RotaryQuantizeKVCache"): qkv [T, (Hq + 2 Hkv) D], cos/sin
// [T, R/2] float32/float16, slot_mapping and the four caches as QuantizeKVCache -> query
// [T, Hq, D] (the rotated Q) and the four caches, updated. Spec:
// ort_ops/ops/rotary_quantize_kv_cache.py.
//
// The cache update is QuantizeKVCache's (ops/quantize_kv_cache/cpu_write.h): every live token's
// rotated K (rounded to qkv's dtype) and V are quantized into scratch before any output byte is
// written, then the caches are copied unless bound in place and the rows scattered to the slots.
// The query output is rotated per token afterwards (every token: negative slots too).
//
// The rotation rounds every product and every sum to float32: this file is compiled with
// -ffp-contract=off (CMakeLists.txt, ORT_OPS_CXX_FLAGS) and without -mfma, so no multiply-add
// is fused and the results equal the numpy reference's bit for bit.
#include "ops/rotary_quantize_kv_cache/op.h"

#include <algorithm>
#include <vector>

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/dynamic_quant/cpu.h"
#include "ops/quantize_kv_cache/cpu_write.h"
#include "ops/rotary_quantize_kv_cache/validate.h"

namespace ort_ops {
namespace {

namespace kvc = quantize_kv_cache;
namespace rqk = rotary_quantize_kv_cache;

using rqk::kOp;

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;

// y[0..D) = the contract's rotation of head x[0..D) by c, s [half] (R = 2 * half <= D).
void rotate_head(const float* x, const float* c, const float* s, int64_t half, int64_t D, bool interleaved,
                 float* y) {
  if (interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      y[2 * i] = a * c[i] - b * s[i];
      y[2 * i + 1] = b * c[i] + a * s[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      y[i] = a * c[i] - b * s[i];
      y[i + half] = b * c[i] + a * s[i];
    }
  }
  std::copy(x + 2 * half, x + D, y + 2 * half);
}

class RotaryQuantizeKVCacheCpu final : public KernelImpl {
 public:
  explicit RotaryQuantizeKVCacheCpu(const OrtKernelInfo* info) : attrs_(rqk::read_attrs(info)) {
    const CpuIsa isa = selected_isa(kOp);
    quantize_row_ = dynamic_quant::quantize_row_fn(isa);
    half_to_float_ = half_to_float_fn(isa);
    float_to_half_ = float_to_half_fn(isa);
  }

  void compute(Ort::KernelContext& ctx) override {
    const rqk::Inputs in = rqk::read_inputs(ctx);
    const rqk::Dims d = rqk::validate_inputs(in, attrs_);
    const int64_t* slot = in.caches.slot_mapping.ptr<int64_t>();
    kvc::check_slots(kOp, slot, d.cache);  // in range, live ones distinct: tasks never collide
    const bool f32 = in.qkv.dtype == F32;
    const int64_t D = d.D, kv_row = d.Hkv * D;

    // Phase 1: each live token's K heads rotated and rounded to qkv's dtype, V as given.
    auto token_rows = [&](int64_t t, float* kbuf, float* vbuf) -> kvc::TokenRows {
      Token tok(*this, in, d, t);
      for (int64_t h = 0; h < d.Hkv; ++h)
        rotate_head(tok.x + (d.Hq + h) * D, tok.c, tok.s, d.half, D, attrs_.interleaved, kbuf + h * D);
      if (!f32) {  // K is stored as the float16 the un-fused graph's RotaryEmbedding gives
        std::vector<uint16_t> k16(static_cast<size_t>(kv_row));
        float_to_half_(kbuf, k16.data(), kv_row);
        half_to_float_(k16.data(), kbuf, kv_row);
      }
      std::copy(tok.x + (d.Hq + d.Hkv) * D, tok.x + (d.Hq + 2 * d.Hkv) * D, vbuf);
      return {kbuf, vbuf};
    };
    const kvc::QuantizedRows rows = kvc::quantize_live_rows(
        ctx, kOp, d.cache, slot, quantize_row_, token_rows,
        {"input 'qkv' must be finite in the K (after rotation) of a live token",
         "input 'qkv' must be finite in the V of a live token"});

    // Phase 2: the caches, then the query of every token.
    void* query = make_output_raw(ctx, 0, {d.T, d.Hq, D});
    kvc::write_caches(ctx, in.caches, 1, d.cache, slot, rows);
    const int64_t q_row = d.Hq * D;
    parallel_for(ctx, static_cast<size_t>(d.T), [&](size_t ti) {
      const int64_t t = static_cast<int64_t>(ti);
      Token tok(*this, in, d, t);
      std::vector<float> ybuf(f32 ? 0 : static_cast<size_t>(q_row));
      float* y = f32 ? static_cast<float*>(query) + t * q_row : ybuf.data();
      for (int64_t h = 0; h < d.Hq; ++h)
        rotate_head(tok.x + h * D, tok.c, tok.s, d.half, D, attrs_.interleaved, y + h * D);
      if (!f32) float_to_half_(y, static_cast<uint16_t*>(query) + t * q_row, q_row);
    });
  }

 private:
  // Token t's qkv row and cos/sin rows as float32: pointers into the inputs (float32) or into
  // this object's buffers after widening (float16).
  struct Token {
    std::vector<float> buf;
    const float *x, *c, *s;
    Token(const RotaryQuantizeKVCacheCpu& op, const rqk::Inputs& in, const rqk::Dims& d, int64_t t) {
      const int64_t width = (d.Hq + 2 * d.Hkv) * d.D;
      if (in.qkv.dtype == F32) {
        x = in.qkv.ptr<float>() + t * width;
        c = in.cos.ptr<float>() + t * d.half;
        s = in.sin.ptr<float>() + t * d.half;
        return;
      }
      buf.resize(static_cast<size_t>(width + 2 * d.half));
      op.half_to_float_(in.qkv.ptr<uint16_t>() + t * width, buf.data(), width);
      op.half_to_float_(in.cos.ptr<uint16_t>() + t * d.half, buf.data() + width, d.half);
      op.half_to_float_(in.sin.ptr<uint16_t>() + t * d.half, buf.data() + width + d.half, d.half);
      x = buf.data();
      c = x + width;
      s = c + d.half;
    }
  };

  rqk::Attrs attrs_;
  dynamic_quant::QuantizeRowFn quantize_row_;
  HalfToFloatFn half_to_float_;
  FloatToHalfFn float_to_half_;
};

}  // namespace

const CustomOp& rotary_quantize_kv_cache_cpu_op() {
  static const CustomOp op(rotary_quantize_kv_cache::signature(), kCpuEp, make_kernel<RotaryQuantizeKVCacheCpu>);
  return op;
}

}  // namespace ort_ops
