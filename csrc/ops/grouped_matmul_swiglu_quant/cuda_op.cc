// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant on ORT's CUDA EP: validates shapes and dtypes on the host (same
// messages as the CPU op), converts float16 scales, runs the kernel of cuda.cu on the
// session's compute stream with scratch from ORT's CUDA allocator.
//
// group_list lives on the device (MoeInitRouting writes it there), so its values are checked
// by the kernel itself: it never reads out of bounds on a bad list, and reports it (or a
// non-finite C / S) in a device error word. To fail the Run as the contract requires, Compute
// copies that word back and synchronizes the stream once per Run (a few microseconds; see
// the closing note of issue 7 for the trade-off).
#include "ops/grouped_matmul_swiglu_quant/cuda_op.h"

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "common/tensor.h"
#include "ops/grouped_matmul_swiglu_quant/cuda.cuh"

namespace ort_ops {
namespace {

constexpr const char* kOp = "GroupedMatmulSwigluQuant";
constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw OpError(ORT_EP_FAIL, str_cat(kOp, " (CUDA): ", what, " failed: ", cudaGetErrorName(err),
                                       " (", cudaGetErrorString(err), ")"));
}

// Device scratch from ORT's CUDA allocator, freed when Compute returns (after the sync).
class Scratch {
 public:
  Scratch(Ort::KernelContext& ctx, size_t bytes) {
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
    alloc_ = ctx.GetAllocator(*static_cast<const OrtMemoryInfo*>(info));
    if (alloc_ == nullptr) fail_unsupported(kOp, "no CUDA allocator in this session");
    ptr_ = alloc_->Alloc(alloc_, bytes);
    if (ptr_ == nullptr) throw OpError(ORT_FAIL, str_cat(kOp, ": could not allocate ", bytes, " bytes of scratch"));
  }
  ~Scratch() {
    if (ptr_) alloc_->Free(alloc_, ptr_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  char* get() const { return static_cast<char*>(ptr_); }

 private:
  OrtAllocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
};

class GroupedMatmulSwigluQuantCuda final : public KernelImpl {
 public:
  explicit GroupedMatmulSwigluQuantCuda(const OrtKernelInfo* info)
      : group_list_type_(attr_int(info, "group_list_type", 0)) {
    if (group_list_type_ != 0 && group_list_type_ != 1)
      fail_invalid(kOp, "attribute 'group_list_type' must be 0 (cumulative) or 1 (counts), got ",
                   group_list_type_);
  }

  void compute(Ort::KernelContext& ctx) override {
    const InputView x = read_input(ctx, 0), w = read_input(ctx, 1), ws = read_input(ctx, 2),
                    xs = read_input(ctx, 3), gl = read_input(ctx, 4);
    require_present(kOp, "x", x);
    require_present(kOp, "weight", w);
    require_present(kOp, "weight_scale", ws);
    require_present(kOp, "x_scale", xs);
    require_present(kOp, "group_list", gl);
    require_dtype(kOp, "x", x, {I8});
    require_rank(kOp, "x", x, 2);
    require_dtype(kOp, "weight", w, {I8});
    require_rank(kOp, "weight", w, 3);
    const int64_t m = x.dim(0), k = x.dim(1), e = w.dim(0), n = w.dim(2);
    if (w.dim(1) != k)
      fail_invalid(kOp, "input 'weight' must have shape [E, ", k, ", N] (K of 'x'), got ",
                   shape_str(w.shape));
    if (n % 2 != 0) fail_invalid(kOp, "input 'weight' must have an even N (last dim), got ", n);
    require_dtype(kOp, "weight_scale", ws, {F32, F16});
    require_shape(kOp, "weight_scale", ws, {e, n});
    require_dtype(kOp, "x_scale", xs, {F32, F16});
    require_shape(kOp, "x_scale", xs, {m});
    require_dtype(kOp, "group_list", gl, {I64});
    require_shape(kOp, "group_list", gl, {e});
    // The kernel's alignment needs (16-byte rows of x and weight, the up half at N/2).
    if (k > 131071)
      fail_unsupported(kOp, "K must be <= 131071 so the int32 accumulator cannot overflow, got ", k);
    if (k % 16 != 0) fail_unsupported(kOp, "(CUDA) K must be a multiple of 16, got ", k);
    if (n % 32 != 0) fail_unsupported(kOp, "(CUDA) N must be a multiple of 32, got ", n);
    if (e > gmsq_cuda::kGmsqMaxExperts)
      fail_unsupported(kOp, "(CUDA) at most ", gmsq_cuda::kGmsqMaxExperts, " experts, got ", e);
    if (m >= (int64_t{1} << 31)) fail_unsupported(kOp, "(CUDA) M must be < 2^31, got ", m);

    int8_t* y = make_output<int8_t>(ctx, 0, {m, n / 2});
    float* y_scale = make_output<float>(ctx, 1, {m});
    float* y_offset = make_output<float>(ctx, 2, {m});
    if (m == 0) return;
    auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());

    const size_t ws_bytes = gmsq_cuda::gmsq_workspace_bytes(m, e);
    const size_t wsc_bytes = ws.dtype == F16 ? 4 * static_cast<size_t>(e * n + 4) : 0;
    const size_t xsc_bytes = xs.dtype == F16 ? 4 * static_cast<size_t>(m + 4) : 0;
    Scratch scratch(ctx, ws_bytes + wsc_bytes + xsc_bytes);
    const float* w_scale = ws.ptr<float>();
    const float* x_scale = xs.ptr<float>();
    if (wsc_bytes) {
      float* dst = reinterpret_cast<float*>(scratch.get() + ws_bytes);
      check_cuda(gmsq_cuda::launch_half_to_float(ws.ptr<uint16_t>(), dst, e * n, stream),
                 "weight_scale conversion");
      w_scale = dst;
    }
    if (xsc_bytes) {
      float* dst = reinterpret_cast<float*>(scratch.get() + ws_bytes + wsc_bytes);
      check_cuda(gmsq_cuda::launch_half_to_float(xs.ptr<uint16_t>(), dst, m, stream),
                 "x_scale conversion");
      x_scale = dst;
    }
    gmsq_cuda::GmsqParams p{x.ptr<int8_t>(), w.ptr<int8_t>(), w_scale, x_scale,
                            gl.ptr<int64_t>(), y, y_scale, y_offset, scratch.get(), m, k, n, e,
                            static_cast<int>(group_list_type_), gmsq_cuda::kGmsqAuto};
    check_cuda(gmsq_cuda::launch_gmsq(p, stream), "kernel launch");

    int err = 0;
    check_cuda(cudaMemcpyAsync(&err, gmsq_cuda::gmsq_error_word(scratch.get()), sizeof(int),
                               cudaMemcpyDeviceToHost, stream),
               "error word copy");
    check_cuda(cudaStreamSynchronize(stream), "stream synchronize");
    if (err & gmsq_cuda::kErrGroupList) {
      std::vector<int64_t> g(static_cast<size_t>(e));
      check_cuda(cudaMemcpy(g.data(), gl.data, 8 * static_cast<size_t>(e), cudaMemcpyDeviceToHost),
                 "group_list copy");
      std::string vals = shape_str(g);
      if (group_list_type_ == 1)
        fail_invalid(kOp, "input 'group_list' must hold counts >= 0 summing to <= ", m,
                     " (rows of 'x'), got ", vals);
      fail_invalid(kOp, "input 'group_list' must be non-decreasing and >= 0 and end at <= ", m,
                   " (rows of 'x'), got ", vals);
    }
    if (err & gmsq_cuda::kErrNonFinite)
      fail_invalid(kOp, "a row's dequantized product or SwiGLU output is not finite; check "
                        "inputs 'x_scale' and 'weight_scale'");
  }

 private:
  int64_t group_list_type_;
};

}  // namespace

const CustomOp& grouped_matmul_swiglu_quant_cuda_op() {
  constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  static const CustomOp op(
      OpSpec{kOp,
             "CUDAExecutionProvider",
             {{ANY}, {ANY}, {ANY}, {ANY}, {ANY}},
             {{ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8},
              {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT},
              {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT}}},
      [](const OrtKernelInfo* info) -> std::unique_ptr<KernelImpl> {
        return std::make_unique<GroupedMatmulSwigluQuantCuda>(info);
      });
  return op;
}

}  // namespace ort_ops
