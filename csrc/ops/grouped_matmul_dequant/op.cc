// SPDX-License-Identifier: MIT
// GroupedMatmulDequant on the CPU EP (DESIGN.md "The other MoE ops"; spec:
// ort_ops/ops/grouped_matmul_dequant.py). Inputs and attributes as GroupedMatmulSwigluQuant's
// (weight_layout "EKN" / "ENK" / "EN16K4", the same shared reading: grouped_matmul::read_problem_layout;
// N may be odd); output y float32 [M, N] = (float(x . W_e) * x_scale[m]) * weight_scale[e, n],
// zeros past the last group end. "EN16K4" with AMX: the panels read the weight as it is, for
// every expert (with "EKN" an expert of up to kGemvRows rows takes the few-row path, one of more
// the panels, which pack [K, N] into tile order on every Run: at a few tokens the layer is bound
// by these weight reads, so the pre-packed layout is the faster one there; benchmarks/bench_moe.py
// measures both, benchmarks/RESULTS_cpu.md); without AMX each used expert is unpacked to [K, N]
// per Run.
#include "ops/grouped_matmul_dequant/op.h"

#include <algorithm>

#include "common/cpu_features.h"
#include "common/tensor.h"
#include "ops/grouped_matmul/driver.h"
#include "ops/grouped_matmul/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "GroupedMatmulDequant";

class GroupedMatmulDequantCpu final : public KernelImpl {
 public:
  explicit GroupedMatmulDequantCpu(const OrtKernelInfo* info) : cfg_(kOp, info) {}

  void compute(Ort::KernelContext& ctx) override {
    grouped_matmul::WeightScratch weight_ekn;  // "ENK" / "EN16K4" without panels: the used experts in [K, N]
    const grouped_matmul::Problem p = cfg_.read_problem(kOp, ctx, false, weight_ekn);
    float* y = make_output<float>(ctx, 0, {p.m, p.n});
    std::fill(y + p.rows_used * p.n, y + p.m * p.n, 0.0f);
    grouped_matmul::run_tiles(kOp, ctx, p, grouped_matmul::Mode::kDequant, cfg_.kernels, y, p.n);
  }

 private:
  grouped_matmul::CpuOpConfig cfg_;
};

}  // namespace

const CustomOp& grouped_matmul_dequant_cpu_op() {
  static const CustomOp op(grouped_matmul::dequant_signature(), kCpuEp, make_kernel<GroupedMatmulDequantCpu>);
  return op;
}

}  // namespace ort_ops
