// SPDX-License-Identifier: MIT
// QuantizeKVCache (DESIGN.md "KV cache"): key/value [T, Hkv, D] float32/float16, slot_mapping
// int64 [T], key_cache int8 [N, Hkv, B, D], value_cache int8 [N, Hkv, D, B], key_scale /
// value_scale float32 [N, Hkv, B] -> the four caches, updated. Spec:
// ort_ops/ops/quantize_kv_cache.py.
//
// Design (cpu_write.h): every live row is validated and quantized into scratch, in parallel over
// tokens, before any output byte is written (a failing Run leaves a cache bound in place
// untouched); then the caches are copied unless bound in place and each token's rows are
// scattered into its slot.
#include "ops/quantize_kv_cache/op.h"

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/tensor.h"
#include "ops/dynamic_quant/cpu.h"
#include "ops/quantize_kv_cache/cpu_write.h"
#include "ops/quantize_kv_cache/validate.h"

namespace ort_ops {
namespace {

namespace kvc = quantize_kv_cache;

using kvc::kOp;

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;

class QuantizeKVCacheCpu final : public KernelImpl {
 public:
  explicit QuantizeKVCacheCpu(const OrtKernelInfo*) : isa_(selected_isa(kOp)) {
    quantize_row_ = dynamic_quant::quantize_row_fn(isa_);
    half_to_float_ = half_to_float_fn(isa_);
  }

  void compute(Ort::KernelContext& ctx) override {
    const kvc::Inputs in = kvc::read_inputs(ctx);
    const kvc::Dims dims = kvc::validate_inputs(in, {});
    const int64_t* slot = in.slot_mapping.ptr<int64_t>();
    kvc::check_slots(kOp, slot, dims);  // in range, live ones distinct: tasks never collide
    const int64_t row = dims.H * dims.D;  // one token's values of all kv heads
    // float32 inputs are read in place, float16 ones widened into the task's scratch.
    auto token_rows = [&](int64_t t, float* kbuf, float* vbuf) -> kvc::TokenRows {
      return {widen(in.key, t * row, row, kbuf), widen(in.value, t * row, row, vbuf)};
    };
    const kvc::QuantizedRows rows = kvc::quantize_live_rows(
        ctx, kOp, dims, slot, quantize_row_, token_rows,
        {"input 'key' must be finite", "input 'value' must be finite"});
    kvc::write_caches(ctx, in.caches(), 0, dims, slot, rows);
  }

 private:
  // x[offset .. offset + n) as float32: a pointer into x, or into buf after widening float16.
  const float* widen(const InputView& x, int64_t offset, int64_t n, float* buf) const {
    if (x.dtype == F32) return x.ptr<float>() + offset;
    half_to_float_(x.ptr<uint16_t>() + offset, buf, n);
    return buf;
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
