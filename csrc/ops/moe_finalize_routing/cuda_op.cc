// SPDX-License-Identifier: MIT
// MoeFinalizeRouting on ORT's CUDA EP (kernels: cuda.cu): expert_out [M*K, H], sorted_to_flat
// int32 [M*K], topk_weights [M, K], residual [M, H] optional (float32/float16 each) -> out
// float32 [M, H]. Same checks and messages as the CPU op; a sorted_to_flat that is not a
// permutation is found by the kernel and reported through the node's status word
// (cuda/device_status.h: at its next Compute, or by ort_ops_take_device_error() after the Run),
// so the host never waits for the GPU.
#include "ops/moe_finalize_routing/cuda_op.h"

#include <atomic>
#include <memory>
#include <string>

#include "common/tensor.h"
#include "cuda/device_status.h"
#include "cuda/ort_cuda.h"
#include "ops/moe_finalize_routing/cuda.cuh"
#include "ops/moe_finalize_routing/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "MoeFinalizeRouting";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
using cuda_util::check_cuda;

class MoeFinalizeRoutingCuda final : public KernelImpl {
 public:
  explicit MoeFinalizeRoutingCuda(const OrtKernelInfo*)
      : status_([this](int) {
          return str_cat(kOp, ": input 'sorted_to_flat' must be a permutation of [0, ", total_.load(),
                         "), got a repeated or out-of-range index");
        }) {}

  void compute(Ort::KernelContext& ctx) override {
    status_.raise_pending();
    const moe_finalize_routing::Inputs in = moe_finalize_routing::read_inputs(ctx);
    const InputView &eo = in.expert_out, &s2f = in.sorted_to_flat, &tw = in.topk_weights,
                    &res = in.residual;
    const moe_finalize_routing::Dims d = moe_finalize_routing::validate_inputs(in);
    const int64_t m = d.M, k = d.K, h = d.H, total = d.total;
    float* out = make_output<float>(ctx, 0, {m, h});
    total_.store(total);
    if (m == 0) return;
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    cuda_util::OrtCudaScratch scratch(kOp, ctx, moe_finalize_cuda::moe_finalize_workspace_bytes(total));
    check_cuda(kOp,
               moe_finalize_cuda::launch_moe_finalize(
                   eo.data, eo.dtype == F16, s2f.ptr<int32_t>(), tw.data, tw.dtype == F16,
                   res.present ? res.data : nullptr, res.present && res.dtype == F16, out,
                   scratch.get(), status_.word(kOp), m, k, h, stream),
               "kernel launch");
  }

 private:
  std::atomic<int64_t> total_{0};  // M * K of the latest Run, for the message
  cuda_util::DeviceStatus status_;
};

}  // namespace

const CustomOp& moe_finalize_routing_cuda_op() {
  static const CustomOp op(moe_finalize_routing::signature(), kCudaEp, make_kernel<MoeFinalizeRoutingCuda>);
  return op;
}

}  // namespace ort_ops
