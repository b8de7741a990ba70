// SPDX-License-Identifier: MIT
// GroupedMatmulDequant on ORT's CUDA EP: the grouped INT8 GEMM kernel of
// ops/grouped_matmul_swiglu_quant/cuda.cu in its dequantizing mode (host side:
// cuda_op_common.h there). Inputs as GroupedMatmulSwigluQuant; output y float32 [M, N].
// weight_layout: "EKN" only; "EN16K4" (a CPU layout) and "ENK" (the CUDA kernel reads K-major
// weights in its SwiGLU mode only) fail by name.
#include "ops/grouped_matmul_dequant/cuda_op.h"

#include <memory>

#include "ops/grouped_matmul_swiglu_quant/cuda_op_common.h"
#include "ops/grouped_matmul/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "GroupedMatmulDequant";

class GroupedMatmulDequantCuda final : public KernelImpl {
 public:
  explicit GroupedMatmulDequantCuda(const OrtKernelInfo* info)
      : group_list_type_(attr_int(info, "group_list_type", 0)),
        layout_(gmsq_layout::read_weight_layout(kOp, info)) {
    if (group_list_type_ != 0 && group_list_type_ != 1)
      fail_invalid(kOp, "attribute 'group_list_type' must be 0 (cumulative) or 1 (counts), got ",
                   group_list_type_);
  }

  void compute(Ort::KernelContext& ctx) override {
    if (layout_ == gmsq_layout::WeightLayout::kEN16K4)
      fail_unsupported(kOp, "weight_layout 'EN16K4' is a CPU layout; use 'EKN' on CUDA");
    if (layout_ == gmsq_layout::WeightLayout::kENK)
      fail_unsupported(kOp, "weight_layout 'ENK' is not supported on CUDA (the kernel reads K-major weights "
                            "only in GroupedMatmulSwigluQuant); use 'EKN'");
    gmsq_cuda::run_grouped_op(kOp, ctx, group_list_type_, /*swiglu=*/false);
  }

 private:
  int64_t group_list_type_;
  gmsq_layout::WeightLayout layout_;
};

}  // namespace

const CustomOp& grouped_matmul_dequant_cuda_op() {
  static const CustomOp op(grouped_matmul::dequant_signature(), kCudaEp, make_kernel<GroupedMatmulDequantCuda>);
  return op;
}

}  // namespace ort_ops
