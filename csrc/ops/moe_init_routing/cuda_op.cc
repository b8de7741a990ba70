// SPDX-License-Identifier: MIT
// MoeInitRouting on ORT's CUDA EP (kernels: cuda.cu): x [M, H] float32/float16, expert_ids
// int32 [M, K], attribute num_experts -> sorted_x [M*K, H] (dtype of x), sorted_to_flat int32
// [M*K], group_list int64 [E]. Same checks and messages as the CPU op; an expert id out of
// range is found by the kernel and reported through the node's status word
// (cuda/device_status.h: at its next Compute, or by ort_ops_take_device_error() after the Run),
// so the host never waits for the GPU.
#include "ops/moe_init_routing/cuda_op.h"

#include <climits>
#include <memory>
#include <string>

#include "common/tensor.h"
#include "cuda/device_status.h"
#include "cuda/ort_cuda.h"
#include "ops/moe_init_routing/cuda.cuh"
#include "ops/moe_init_routing/validate.h"

namespace ort_ops {
namespace {

constexpr const char* kOp = "MoeInitRouting";
using cuda_util::check_cuda;

class MoeInitRoutingCuda final : public KernelImpl {
 public:
  explicit MoeInitRoutingCuda(const OrtKernelInfo* info)
      : num_experts_(moe_init_routing::read_num_experts(info)),
        status_([this](int) {
          return str_cat(kOp, ": input 'expert_ids' must be in [0, ", num_experts_, "), got an id outside");
        }) {
    if (num_experts_ > INT32_MAX)
      fail_unsupported(kOp, "attribute 'num_experts' must be <= ", INT32_MAX, " on the CUDA EP, got ",
                       num_experts_);
  }

  void compute(Ort::KernelContext& ctx) override {
    status_.raise_pending();
    const moe_init_routing::Inputs in = moe_init_routing::read_inputs(ctx);
    const InputView &x = in.x, &ids = in.expert_ids;
    const moe_init_routing::Dims d = moe_init_routing::validate_inputs(in);
    const int64_t m = d.M, h = d.H, k = d.K, total = d.total;
    void* sorted_x = make_output_raw(ctx, 0, {total, h});
    int32_t* s2f = make_output<int32_t>(ctx, 1, {total});
    int64_t* group_list = make_output<int64_t>(ctx, 2, {num_experts_});
    float* sorted_scale = nullptr;  // sorted_x_scale when the graph asks for it ([0] without x_scale)
    if (ctx.GetOutputCount() > 3) sorted_scale = make_output<float>(ctx, 3, {in.x_scale.present ? total : 0});
    // Scales are gathered only where both ends exist (int8 x, and the graph takes sorted_x_scale).
    const float* x_scale = in.x_scale.present && sorted_scale != nullptr ? in.x_scale.ptr<float>() : nullptr;
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    cuda_util::OrtCudaScratch scratch(kOp, ctx,
                                      moe_init_cuda::moe_init_workspace_bytes(total, num_experts_));
    check_cuda(kOp,
               moe_init_cuda::launch_moe_init(x.data, static_cast<int>(d.elem_bytes), ids.ptr<int32_t>(),
                                              sorted_x, s2f, group_list, scratch.get(),
                                              status_.word(kOp), m, k, h, num_experts_, stream, x_scale,
                                              x_scale != nullptr ? sorted_scale : nullptr),
               "kernel launch");
  }

 private:
  int64_t num_experts_;
  cuda_util::DeviceStatus status_;
};

}  // namespace

const CustomOp& moe_init_routing_cuda_op() {
  static const CustomOp op(moe_init_routing::signature(), kCudaEp, make_kernel<MoeInitRoutingCuda>);
  return op;
}

}  // namespace ort_ops
