// SPDX-License-Identifier: MIT
// MoeInitRouting on ORT's CUDA EP (kernels: cuda.cu): x [M, H] float32/float16, expert_ids
// int32 [M, K], attribute num_experts -> sorted_x [M*K, H] (dtype of x), sorted_to_flat int32
// [M*K], group_list int64 [E]. Same checks and messages as the CPU op; an expert id out of
// range is found by the kernel and fails the Run after one stream sync.
#include "ops/moe_init_routing/cuda_op.h"

#include <climits>
#include <memory>
#include <vector>

#include "common/tensor.h"
#include "cuda/ort_cuda.h"
#include "ops/moe_init_routing/cuda.cuh"

namespace ort_ops {
namespace {

constexpr const char* kOp = "MoeInitRouting";
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
using cuda_util::check_cuda;

class MoeInitRoutingCuda final : public KernelImpl {
 public:
  explicit MoeInitRoutingCuda(const OrtKernelInfo* info)
      : num_experts_(attr_int(info, "num_experts", -1)) {
    if (num_experts_ < 1)
      fail_invalid(kOp, "attribute 'num_experts' must be given and >= 1, got ", num_experts_);
    if (num_experts_ > INT32_MAX)
      fail_unsupported(kOp, "attribute 'num_experts' must be <= ", INT32_MAX, " on the CUDA EP, got ",
                       num_experts_);
  }

  void compute(Ort::KernelContext& ctx) override {
    const InputView x = read_input(ctx, 0), ids = read_input(ctx, 1);
    require_present(kOp, "x", x);
    require_present(kOp, "expert_ids", ids);
    require_dtype(kOp, "x", x, {F32, F16});
    require_rank(kOp, "x", x, 2);
    require_dtype(kOp, "expert_ids", ids, {I32});
    require_rank(kOp, "expert_ids", ids, 2);
    const int64_t m = x.dim(0), h = x.dim(1), k = ids.dim(1);
    if (ids.dim(0) != m)
      fail_invalid(kOp, "input 'expert_ids' must have shape [", m, ", K] (rows of 'x'), got ",
                   shape_str(ids.shape));
    const int64_t total = m * k;
    if (total > INT32_MAX)
      fail_unsupported(kOp, "M * K must be <= ", INT32_MAX, " (sorted_to_flat is int32), got ", total);
    void* sorted_x = make_output_raw(ctx, 0, {total, h});
    int32_t* s2f = make_output<int32_t>(ctx, 1, {total});
    int64_t* group_list = make_output<int64_t>(ctx, 2, {num_experts_});
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());
    cuda_util::OrtCudaScratch scratch(kOp, ctx,
                                      moe_init_cuda::moe_init_workspace_bytes(total, num_experts_));
    check_cuda(kOp,
               moe_init_cuda::launch_moe_init(x.data, x.dtype == F16 ? 2 : 4, ids.ptr<int32_t>(),
                                              sorted_x, s2f, group_list, scratch.get(), m, k, h,
                                              num_experts_, stream),
               "kernel launch");
    int err = 0;
    check_cuda(kOp, cudaMemcpyAsync(&err, scratch.get(), sizeof(int), cudaMemcpyDeviceToHost, stream),
               "error word copy");
    check_cuda(kOp, cudaStreamSynchronize(stream), "stream synchronize");
    if (err & moe_init_cuda::kErrBadExpert) {
      std::vector<int32_t> id(static_cast<size_t>(total));
      check_cuda(kOp, cudaMemcpy(id.data(), ids.data, 4 * id.size(), cudaMemcpyDeviceToHost),
                 "expert_ids copy");
      for (int64_t f = 0; f < total; ++f)
        if (id[f] < 0 || id[f] >= num_experts_)
          fail_invalid(kOp, "input 'expert_ids' must be in [0, ", num_experts_, "), got ", id[f],
                       " at token ", f / k, ", slot ", f % k);
    }
  }

 private:
  int64_t num_experts_;
};

}  // namespace

const CustomOp& moe_init_routing_cuda_op() {
  static const CustomOp op(
      OpSpec{kOp,
             "CUDAExecutionProvider",
             {{ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED}, {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32}},
             {{ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED},
              {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32},
              {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64}}},
      [](const OrtKernelInfo* info) -> std::unique_ptr<KernelImpl> {
        return std::make_unique<MoeInitRoutingCuda>(info);
      });
  return op;
}

}  // namespace ort_ops
