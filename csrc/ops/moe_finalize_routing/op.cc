// SPDX-License-Identifier: MIT
// MoeFinalizeRouting on the CPU EP (spec: ort_ops/ops/moe_finalize_routing.py).
// expert_out [M*K, H], sorted_to_flat int32 [M*K], topk_weights [M, K], residual [M, H]
// optional (float32/float16 each) -> out float32 [M, H]:
//   acc = residual[m] (or 0); for j in 0..K-1: acc = acc + topk_weights[m, j] * expert_out[row(m, j)]
// in float32 in that order (no FMA), so it matches the reference bit for bit.
#include "ops/moe_finalize_routing/op.h"

#include <algorithm>
#include <vector>

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/moe_finalize_routing/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "MoeFinalizeRouting";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

// Row r of a float32/float16 tensor as float32 (a pointer into t, or converted into tmp).
inline const float* row_f32(const InputView& t, int64_t r, int64_t h, float* tmp, HalfToFloatFn cvt) {
  if (t.dtype == F32) return t.ptr<float>() + r * h;
  cvt(t.ptr<uint16_t>() + r * h, tmp, h);
  return tmp;
}

class MoeFinalizeRoutingCpu final : public KernelImpl {
 public:
  explicit MoeFinalizeRoutingCpu(const OrtKernelInfo*) : half_to_float_(half_to_float_fn(selected_isa(kOp))) {}

  void compute(Ort::KernelContext& ctx) override {
    const moe_finalize_routing::Inputs in = moe_finalize_routing::read_inputs(ctx);
    const InputView &eo = in.expert_out, &s2f = in.sorted_to_flat, &tw = in.topk_weights,
                    &res = in.residual;
    const moe_finalize_routing::Dims d = moe_finalize_routing::validate_inputs(in);
    const int64_t m = d.M, k = d.K, h = d.H, total = d.total;
    // Inverse permutation; a repeated or out-of-range entry would read a wrong row.
    const int32_t* perm = s2f.ptr<int32_t>();
    std::vector<int64_t> row_of(static_cast<size_t>(total), -1);
    for (int64_t i = 0; i < total; ++i) {
      const int64_t f = perm[i];
      if (f < 0 || f >= total || row_of[static_cast<size_t>(f)] >= 0)
        fail_invalid(kOp, "input 'sorted_to_flat' must be a permutation of [0, ", total, "), got ", f,
                     " at index ", i);
      row_of[static_cast<size_t>(f)] = i;
    }
    std::vector<float> w(static_cast<size_t>(total));
    if (tw.dtype == F32)
      std::copy(tw.ptr<float>(), tw.ptr<float>() + total, w.begin());
    else
      half_to_float_(tw.ptr<uint16_t>(), w.data(), total);

    float* out = make_output<float>(ctx, 0, {m, h});
    if (m == 0 || h == 0) return;
    // ~256K values a task: a decode step stays on one thread (a parallel_for is a barrier).
    const int64_t rows_per = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(h * (k + 1), 1));
    const int64_t chunks = (m + rows_per - 1) / rows_per;
    parallel_for(ctx, static_cast<size_t>(chunks), [&](size_t c) {
      std::vector<float> tmp(eo.dtype == F16 || (res.present && res.dtype == F16) ? h : 0);
      const int64_t t0 = static_cast<int64_t>(c) * rows_per, t1 = std::min(m, t0 + rows_per);
      for (int64_t t = t0; t < t1; ++t) {
        float* acc = out + t * h;
        if (res.present) {
          const float* r = row_f32(res, t, h, tmp.data(), half_to_float_);
          std::copy(r, r + h, acc);
        } else {
          std::fill(acc, acc + h, 0.0f);
        }
        for (int64_t j = 0; j < k; ++j) {
          const float wj = w[static_cast<size_t>(t * k + j)];
          const float* e = row_f32(eo, row_of[static_cast<size_t>(t * k + j)], h, tmp.data(), half_to_float_);
          for (int64_t i = 0; i < h; ++i) acc[i] = acc[i] + wj * e[i];  // -ffp-contract=off: no FMA
        }
      }
    });
  }

 private:
  HalfToFloatFn half_to_float_;
};

}  // namespace

const CustomOp& moe_finalize_routing_cpu_op() {
  static const CustomOp op(moe_finalize_routing::signature(), kCpuEp, make_kernel<MoeFinalizeRoutingCpu>);
  return op;
}

}  // namespace ort_ops
