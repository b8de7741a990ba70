// SPDX-License-Identifier: MIT
// MoeFinalizeRouting on ORT's CUDA EP (kernels: cuda.cu): expert_out [M*K, H], sorted_to_flat
// int32 [M*K], topk_weights [M, K], residual [M, H] optional (float32/float16 each) -> out
// float32 [M, H]. Same checks and messages as the CPU op; a sorted_to_flat that is not a
// permutation is found by the kernel and fails the Run after one stream sync.
#include "ops/moe_finalize_routing/cuda_op.h"

#include <memory>

#include "common/tensor.h"
#include "cuda/ort_cuda.h"
#include "ops/moe_finalize_routing/cuda.cuh"

namespace ort_ops {
namespace {

constexpr const char* kOp = "MoeFinalizeRouting";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
using cuda_util::check_cuda;

class MoeFinalizeRoutingCuda final : public KernelImpl {
 public:
  explicit MoeFinalizeRoutingCuda(const OrtKernelInfo*) {}

  void compute(Ort::KernelContext& ctx) override {
    const InputView eo = read_input(ctx, 0), s2f = read_input(ctx, 1), tw = read_input(ctx, 2),
                    res = read_input(ctx, 3);
    require_present(kOp, "expert_out", eo);
    require_present(kOp, "sorted_to_flat", s2f);
    require_present(kOp, "topk_weights", tw);
    require_dtype(kOp, "topk_weights", tw, {F32, F16});
    require_rank(kOp, "topk_weights", tw, 2);
    const int64_t m = tw.dim(0), k = tw.dim(1), total = m * k;
    require_dtype(kOp, "expert_out", eo, {F32, F16});
    require_rank(kOp, "expert_out", eo, 2);
    const int64_t h = eo.dim(1);
    require_shape(kOp, "expert_out", eo, {total, h});
    require_dtype(kOp, "sorted_to_flat", s2f, {I32});
    require_shape(kOp, "sorted_to_flat", s2f, {total});
    if (res.present) {
      require_dtype(kOp, "residual", res, {F32, F16});
      require_shape(kOp, "residual", res, {m, h});
    }
    float* out = make_output<float>(ctx, 0, {m, h});
    if (m == 0) return;
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    cuda_util::OrtCudaScratch scratch(kOp, ctx, moe_finalize_cuda::moe_finalize_workspace_bytes(total));
    check_cuda(kOp,
               moe_finalize_cuda::launch_moe_finalize(
                   eo.data, eo.dtype == F16, s2f.ptr<int32_t>(), tw.data, tw.dtype == F16,
                   res.present ? res.data : nullptr, res.present && res.dtype == F16, out,
                   scratch.get(), m, k, h, stream),
               "kernel launch");
    int err = 0;
    check_cuda(kOp, cudaMemcpyAsync(&err, scratch.get(), sizeof(int), cudaMemcpyDeviceToHost, stream),
               "error word copy");
    check_cuda(kOp, cudaStreamSynchronize(stream), "stream synchronize");
    if (err & moe_finalize_cuda::kErrNotPermutation)
      fail_invalid(kOp, "input 'sorted_to_flat' must be a permutation of [0, ", total,
                   "), got a repeated or out-of-range index");
  }
};

}  // namespace

const CustomOp& moe_finalize_routing_cuda_op() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  static const CustomOp op(
      OpSpec{kOp,
             "CUDAExecutionProvider",
             {{ANY}, {ANY}, {ANY}, {ANY, true}},
             {{ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT}}},
      [](const OrtKernelInfo* info) -> std::unique_ptr<KernelImpl> {
        return std::make_unique<MoeFinalizeRoutingCuda>(info);
      });
  return op;
}

}  // namespace ort_ops
