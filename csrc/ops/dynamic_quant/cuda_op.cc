// SPDX-License-Identifier: MIT
// DynamicQuant on ORT's CUDA EP (kernel: cuda.cu): x [..., K] float32/float16, smooth_scale [K]
// optional -> y int8 [..., K], scale float32 [...]. Same validation and messages as the CPU
// op; a non-finite value is found by the kernel and reported through the node's status word
// (cuda/device_status.h: at its next Compute, or by ort_ops_take_device_error() after the Run),
// so the host never waits for the GPU.
#include "ops/dynamic_quant/cuda_op.h"

#include <memory>
#include <string>

#include "common/tensor.h"
#include "cuda/device_status.h"
#include "cuda/ort_cuda.h"
#include "ops/dynamic_quant/cuda.cuh"
#include "ops/dynamic_quant/validate.h"
#include "ops/grouped_matmul_swiglu_quant/cuda.cuh"

namespace ort_ops {
namespace {

constexpr const char* kOp = "DynamicQuant";
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
using cuda_util::check_cuda;

class DynamicQuantCuda final : public KernelImpl {
 public:
  explicit DynamicQuantCuda(const OrtKernelInfo*)
      : status_([](int) {
          return std::string(kOp) + ": input 'x' (times 'smooth_scale' where given) has a non-finite value "
                                    "(NaN or Inf); no INT8 code represents it";
        }) {}

  void compute(Ort::KernelContext& ctx) override {
    status_.raise_pending();
    const dynamic_quant::Inputs in = dynamic_quant::read_inputs(ctx);
    const InputView &x = in.x, &smooth = in.smooth_scale;
    const dynamic_quant::Dims d = dynamic_quant::validate_inputs(in);
    const int64_t k = d.K, rows = d.rows;
    const std::vector<int64_t>& scale_shape = d.scale_shape;
    int8_t* y = make_output<int8_t>(ctx, 0, x.shape);
    float* scale = make_output<float>(ctx, 1, scale_shape);
    if (rows == 0) return;
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    const bool half_smooth = smooth.present && smooth.dtype == F16;
    cuda_util::OrtCudaScratch scratch(kOp, ctx, 16 + (half_smooth ? 4 * static_cast<size_t>(k) : 0));
    int* err = status_.word(kOp);
    const float* sm = smooth.present ? smooth.ptr<float>() : nullptr;
    if (half_smooth) {
      float* dst = reinterpret_cast<float*>(scratch.get() + 16);
      check_cuda(kOp, gmsq_cuda::launch_half_to_float(smooth.ptr<uint16_t>(), dst, k, stream),
                 "smooth_scale conversion");
      sm = dst;
    }
    check_cuda(kOp,
               dynamic_quant_cuda::launch_dynamic_quant(x.data, x.dtype == F16, sm, y, scale, err,
                                                        rows, k, stream),
               "kernel launch");
  }

 private:
  cuda_util::DeviceStatus status_;
};

}  // namespace

const CustomOp& dynamic_quant_cuda_op() {
  static const CustomOp op(dynamic_quant::signature(), kCudaEp, make_kernel<DynamicQuantCuda>);
  return op;
}

}  // namespace ort_ops
