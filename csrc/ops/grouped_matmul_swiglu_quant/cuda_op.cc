// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant on ORT's CUDA EP (kernel: cuda.cu; host side: cuda_op_common.h).
// Inputs x int8 [M, K], weight int8 [E, K, N], weight_scale [E, N], x_scale [M] (float32 or
// float16), group_list int64 [E], optional bias float32 [E, N]; outputs y int8 [M, N/2], y_scale,
// y_offset float32 [M]. Attributes activation ("swiglu", "swiglu_oai"), alpha, limit: as on the
// CPU.
// weight_layout "ENK" (weight [E, N, K]) runs the Hopper wgmma kernel (sm_90 only).
#include "ops/grouped_matmul_swiglu_quant/cuda_op.h"

#include <memory>

#include "ops/grouped_matmul/validate.h"
#include "ops/grouped_matmul_swiglu_quant/cuda_op_common.h"

namespace ort_ops {
namespace {

std::unique_ptr<KernelImpl> make(const OrtKernelInfo* info) {
  return std::make_unique<gmsq_cuda::GroupedOpCuda>(info, "GroupedMatmulSwigluQuant", /*swiglu=*/true);
}

}  // namespace

const CustomOp& grouped_matmul_swiglu_quant_cuda_op() {
  static const CustomOp op(grouped_matmul::swiglu_quant_signature(), kCudaEp, make);
  return op;
}

}  // namespace ort_ops
