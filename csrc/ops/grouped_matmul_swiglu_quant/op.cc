// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant on the CPU EP (DESIGN.md "MoE"; spec: ort_ops/ops/_moe.py and
// ort_ops/ops/grouped_matmul_swiglu_quant.py). Inputs x int8 [M, K], weight int8 [E, K, N],
// weight_scale [E, N], x_scale [M] (float32/float16), group_list int64 [E]; outputs y int8
// [M, N/2], y_scale float32 [M], y_offset float32 [M] (zeros). Attributes group_list_type and
// weight_layout ("EKN": weight [E, K, N]; "ENK": [E, N, K]; "EN16K4": [E, N/16, K/4, 16, 4], weight_layout.h).
//
// Two phases: (1) grouped GEMM tasks write S = SwiGLU(C) as float32 [rows_used, N/2];
// (2) each finished row is quantized by the contract's rule (the DynamicQuant row kernel). A
// row needs every tile of its columns before its amax is known, hence the float buffer.
//
// "ENK" weights: the GEMM core (grouped_matmul/driver.h) reads [E, K, N], so each expert that has
// rows in this Run is transposed into a scratch [E, K, N] first (one task per expert; unused
// experts are neither read nor written). Same codes bit for bit; it costs a pass over the used
// weights per Run, so "EKN" is the CPU's fast layout ("ENK" is the Hopper wgmma kernel's; the
// measurements are in benchmarks/RESULTS_cpu.md, from benchmarks/bench_moe.py).
// "EN16K4" weights: with AMX the panels read them as they are (every expert, any row count, in
// chunks of kAmxPanelRows rows); other ISAs unpack each used expert into the scratch first.
#include "ops/grouped_matmul_swiglu_quant/op.h"

#include <algorithm>
#include <memory>

#include "common/cpu_features.h"
#include "common/tensor.h"
#include "ops/dynamic_quant/cpu.h"
#include "ops/grouped_matmul/driver.h"
#include "ops/grouped_matmul/validate.h"
#include "ops/grouped_matmul_swiglu_quant/weight_layout.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "GroupedMatmulSwigluQuant";

class GroupedMatmulSwigluQuantCpu final : public KernelImpl {
 public:
  explicit GroupedMatmulSwigluQuantCpu(const OrtKernelInfo* info)
      : cfg_(kOp, info),
        act_(grouped_matmul::read_activation(kOp, info)),
        quantize_row_(dynamic_quant::quantize_row_fn(cfg_.isa)) {}

  void compute(Ort::KernelContext& ctx) override {
    grouped_matmul::WeightScratch weight_ekn;  // "ENK" / "EN16K4" without panels: the used experts in [K, N]
    const grouped_matmul::Problem p = cfg_.read_problem(kOp, ctx, true, weight_ekn);
    const int64_t h = p.n / 2;
    int8_t* y = make_output<int8_t>(ctx, 0, {p.m, h});
    float* y_scale = make_output<float>(ctx, 1, {p.m});
    float* y_offset = make_output<float>(ctx, 2, {p.m});
    std::fill(y_offset, y_offset + p.m, 0.0f);
    // Rows past the last group end: zeros and scale 0 (DESIGN.md; Ascend leaves them unwritten).
    std::fill(y + p.rows_used * h, y + p.m * h, int8_t{0});
    std::fill(y_scale + p.rows_used, y_scale + p.m, 0.0f);
    if (p.rows_used == 0) return;
    if (h == 0) {
      std::fill(y_scale, y_scale + p.rows_used, 0.0f);
      return;
    }

    std::unique_ptr<float[]> s(new float[static_cast<size_t>(p.rows_used * h)]);
    // Rows are quantized as soon as they are complete, in the GEMM's second phase.
    auto quantize_rows = [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        if (!quantize_row_(s.get() + r * h, nullptr, h, y + r * h, y_scale + r))
          fail_invalid(kOp, "row ", r,
                       ": the SwiGLU output overflows float32; check inputs 'x_scale' and 'weight_scale'");
    };
    grouped_matmul::run_tiles(kOp, ctx, p, grouped_matmul::Mode::kSwiglu, cfg_.kernels, s.get(), h,
                              quantize_rows, act_);
  }

 private:
  grouped_matmul::CpuOpConfig cfg_;
  grouped_matmul::Act act_;
  dynamic_quant::QuantizeRowFn quantize_row_;
};

}  // namespace

const CustomOp& grouped_matmul_swiglu_quant_cpu_op() {
  static const CustomOp op(grouped_matmul::swiglu_quant_signature(), kCpuEp, make_kernel<GroupedMatmulSwigluQuantCpu>);
  return op;
}

}  // namespace ort_ops
