// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant on ORT's CUDA EP (kernel: cuda.cu; host side: cuda_op_common.h).
// Inputs x int8 [M, K], weight int8 [E, K, N], weight_scale [E, N], x_scale [M] (float32 or
// float16), group_list int64 [E]; outputs y int8 [M, N/2], y_scale, y_offset float32 [M].
// weight_layout "ENK" (weight [E, N, K]) runs the Hopper wgmma kernel (sm_90 only).
#include "ops/grouped_matmul_swiglu_quant/cuda_op.h"

#include <memory>

#include "ops/grouped_matmul_swiglu_quant/cuda_op_common.h"
#include "ops/grouped_matmul/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "GroupedMatmulSwigluQuant";

class GroupedMatmulSwigluQuantCuda final : public KernelImpl {
 public:
  explicit GroupedMatmulSwigluQuantCuda(const OrtKernelInfo* info)
      : group_list_type_(attr_int(info, "group_list_type", 0)),
        layout_(gmsq_layout::read_weight_layout(kOp, info)) {
    if (group_list_type_ != 0 && group_list_type_ != 1)
      fail_invalid(kOp, "attribute 'group_list_type' must be 0 (cumulative) or 1 (counts), got ",
                   group_list_type_);
  }

  void compute(Ort::KernelContext& ctx) override {
    gmsq_cuda::run_grouped_op(kOp, ctx, group_list_type_, /*swiglu=*/true, layout_);
  }

 private:
  int64_t group_list_type_;
  gmsq_layout::WeightLayout layout_;
};

}  // namespace

const CustomOp& grouped_matmul_swiglu_quant_cuda_op() {
  static const CustomOp op(grouped_matmul::swiglu_quant_signature(), kCudaEp, make_kernel<GroupedMatmulSwigluQuantCuda>);
  return op;
}

}  // namespace ort_ops
