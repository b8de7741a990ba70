// SPDX-License-Identifier: MIT
// SwiGLU (DESIGN.md "SwiGLU"): x [..., 2I] float32/float16 -> y [..., I] of x's dtype,
// y = silu(x[..., :I]) * x[..., I:] in float32. Spec: ort_ops/ops/swiglu.py.
// Non-finite values propagate (no error): the op replaces QuickGelu + Mul, which never fail.
#include "ops/swiglu/op.h"

#include <algorithm>
#include <vector>

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/swiglu/cpu.h"
#include "ops/swiglu/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "SwiGLU";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;

class SwigluCpu final : public KernelImpl {
 public:
  explicit SwigluCpu(const OrtKernelInfo*) {
    const CpuIsa isa = selected_isa(kOp);
    half_to_float_ = half_to_float_fn(isa);
    float_to_half_ = float_to_half_fn(isa);
    row_ = isa >= CpuIsa::kAvx2 ? swiglu::swiglu_row_avx2 : swiglu::swiglu_row_scalar;
  }

  void compute(Ort::KernelContext& ctx) override {
    const swiglu::Inputs in = swiglu::read_inputs(ctx);
    const InputView& x = in.x;
    const swiglu::Dims d = swiglu::validate_inputs(in);
    const int64_t n = d.I, rows = d.rows;
    void* y = make_output_raw(ctx, 0, d.y_shape);
    if (rows == 0 || n == 0) return;

    // Tasks of about 64K output elements: enough work per task to amortise the pool's dispatch.
    const int64_t rows_per_task = std::max<int64_t>(1, (int64_t{1} << 16) / n);
    const int64_t tasks = (rows + rows_per_task - 1) / rows_per_task;
    const bool f32 = x.dtype == F32;
    parallel_for(ctx, static_cast<size_t>(tasks), [&](size_t t) {
      const int64_t r0 = static_cast<int64_t>(t) * rows_per_task;
      const int64_t r1 = std::min(rows, r0 + rows_per_task);
      std::vector<float> in_row, out_row;  // float16 rows widened to float32 and back
      if (!f32) {
        in_row.resize(2 * n);
        out_row.resize(n);
      }
      for (int64_t r = r0; r < r1; ++r) {
        if (f32) {
          const float* xr = x.ptr<float>() + r * 2 * n;
          row_(xr, xr + n, static_cast<float*>(y) + r * n, n);
        } else {
          half_to_float_(x.ptr<uint16_t>() + r * 2 * n, in_row.data(), 2 * n);
          row_(in_row.data(), in_row.data() + n, out_row.data(), n);
          float_to_half_(out_row.data(), static_cast<uint16_t*>(y) + r * n, n);
        }
      }
    });
  }

 private:
  HalfToFloatFn half_to_float_;
  FloatToHalfFn float_to_half_;
  void (*row_)(const float*, const float*, float*, int64_t) = nullptr;
};

}  // namespace

const CustomOp& swiglu_cpu_op() {
  static const CustomOp op(swiglu::signature(), kCpuEp, make_kernel<SwigluCpu>);
  return op;
}

}  // namespace ort_ops
