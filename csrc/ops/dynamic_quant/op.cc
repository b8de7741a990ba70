// SPDX-License-Identifier: MIT
// DynamicQuant (DESIGN.md "The other MoE ops"): x [..., K] float32/float16, smooth_scale [K]
// optional -> y int8 [..., K], scale float32 [...]. Spec: ort_ops/ops/dynamic_quant.py.
// Non-finite input fails the Run (no INT8 code represents it).
#include "ops/dynamic_quant/op.h"

#include <algorithm>
#include <vector>

#include "common/convert.h"
#include "common/cpu_features.h"
#include "common/parallel.h"
#include "common/tensor.h"
#include "ops/dynamic_quant/cpu.h"
#include "ops/dynamic_quant/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "DynamicQuant";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

class DynamicQuantCpu final : public KernelImpl {
 public:
  explicit DynamicQuantCpu(const OrtKernelInfo*) : isa_(selected_isa(kOp)) {
    quantize_row_ = dynamic_quant::quantize_row_fn(isa_);
    half_to_float_ = half_to_float_fn(isa_);
  }

  void compute(Ort::KernelContext& ctx) override {
    const dynamic_quant::Inputs in = dynamic_quant::read_inputs(ctx);
    const InputView &x = in.x, &smooth = in.smooth_scale;
    const dynamic_quant::Dims d = dynamic_quant::validate_inputs(in);
    const int64_t k = d.K, rows = d.rows;
    const std::vector<int64_t>& scale_shape = d.scale_shape;
    std::vector<float> smooth_f32;
    if (smooth.present) {
      smooth_f32.resize(k);
      if (smooth.dtype == F32)
        std::copy(smooth.ptr<float>(), smooth.ptr<float>() + k, smooth_f32.begin());
      else
        half_to_float_(smooth.ptr<uint16_t>(), smooth_f32.data(), k);
    }
    int8_t* y = make_output<int8_t>(ctx, 0, x.shape);
    float* scale = make_output<float>(ctx, 1, scale_shape);
    if (rows == 0) return;
    if (k == 0) {  // empty rows: amax 0 by the contract
      std::fill(scale, scale + rows, 0.0f);
      return;
    }

    // Tasks of about 64K elements: enough work per task to amortise the pool's dispatch.
    const int64_t rows_per_task = std::max<int64_t>(1, (int64_t{1} << 16) / k);
    const int64_t tasks = (rows + rows_per_task - 1) / rows_per_task;
    const float* smooth_ptr = smooth.present ? smooth_f32.data() : nullptr;
    parallel_for(ctx, static_cast<size_t>(tasks), [&](size_t t) {
      const int64_t r0 = static_cast<int64_t>(t) * rows_per_task;
      const int64_t r1 = std::min(rows, r0 + rows_per_task);
      std::vector<float> row;
      if (x.dtype == F16) row.resize(k);
      for (int64_t r = r0; r < r1; ++r) {
        const float* src;
        if (x.dtype == F32) {
          src = x.ptr<float>() + r * k;
        } else {
          half_to_float_(x.ptr<uint16_t>() + r * k, row.data(), k);
          src = row.data();
        }
        if (!quantize_row_(src, smooth_ptr, k, y + r * k, scale + r))
          fail_invalid(kOp, "row ", r, " of input 'x'", smooth_ptr ? " (times 'smooth_scale')" : "",
                       " has a non-finite value (NaN or Inf); no INT8 code represents it");
      }
    });
  }

 private:
  CpuIsa isa_;
  dynamic_quant::QuantizeRowFn quantize_row_;
  HalfToFloatFn half_to_float_;
};

}  // namespace

const CustomOp& dynamic_quant_cpu_op() {
  static const CustomOp op(dynamic_quant::signature(), kCpuEp, make_kernel<DynamicQuantCpu>);
  return op;
}

}  // namespace ort_ops
