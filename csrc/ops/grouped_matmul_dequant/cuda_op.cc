// SPDX-License-Identifier: MIT
// GroupedMatmulDequant on ORT's CUDA EP: the grouped INT8 GEMM kernel of
// ops/grouped_matmul_swiglu_quant/cuda.cu in its dequantizing mode (host side:
// cuda_op_common.h there). Inputs as GroupedMatmulSwigluQuant (optional bias float32 [E, N]);
// output y float32 [M, N].
// weight_layout: "EKN" only; "EN16K4" (a CPU layout) and "ENK" (the CUDA kernel reads K-major
// weights in its SwiGLU mode only) fail by name.
#include "ops/grouped_matmul_dequant/cuda_op.h"

#include <memory>

#include "ops/grouped_matmul/validate.h"
#include "ops/grouped_matmul_swiglu_quant/cuda_op_common.h"

namespace ort_ops {
namespace {

std::unique_ptr<KernelImpl> make(const OrtKernelInfo* info) {
  return std::make_unique<gmsq_cuda::GroupedOpCuda>(info, "GroupedMatmulDequant", /*swiglu=*/false);
}

}  // namespace

const CustomOp& grouped_matmul_dequant_cuda_op() {
  static const CustomOp op(grouped_matmul::dequant_signature(), kCudaEp, make);
  return op;
}

}  // namespace ort_ops
