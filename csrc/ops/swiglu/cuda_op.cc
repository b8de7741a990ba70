// SPDX-License-Identifier: MIT
// SwiGLU on ORT's CUDA EP (kernel: cuda.cu): x [..., 2I] float32/float16 -> y [..., I] of x's
// dtype. Same validation and messages as the CPU op (validate.cc). No value is checked on the
// device (non-finite values propagate, as on the CPU), so Compute only enqueues the kernel.
#include "ops/swiglu/cuda_op.h"

#include "common/tensor.h"
#include "cuda/ort_cuda.h"
#include "ops/swiglu/cuda.cuh"
#include "ops/swiglu/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "SwiGLU";
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
using cuda_util::check_cuda;

class SwigluCuda final : public KernelImpl {
 public:
  explicit SwigluCuda(const OrtKernelInfo*) {}

  void compute(Ort::KernelContext& ctx) override {
    const swiglu::Inputs in = swiglu::read_inputs(ctx);
    const swiglu::Dims d = swiglu::validate_inputs(in);
    void* y = make_output_raw(ctx, 0, d.y_shape);
    if (d.rows == 0 || d.I == 0) return;
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    check_cuda(kOp,
               swiglu_cuda::launch_swiglu(in.x.data, in.x.dtype == F16, y, d.rows, d.I, stream),
               "kernel launch");
  }
};

}  // namespace

const CustomOp& swiglu_cuda_op() {
  static const CustomOp op(swiglu::signature(), kCudaEp, make_kernel<SwigluCuda>);
  return op;
}

}  // namespace ort_ops
