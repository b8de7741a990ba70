// SPDX-License-Identifier: MIT
// Shared by the CUDA-EP ops GroupedMatmulSwigluQuant and GroupedMatmulDequant (both run the
// grouped INT8 GEMM of cuda.cu): host-side validation with the CPU ops' messages, float16
// scales converted on the device, scratch from ORT's CUDA allocator, and the device error word
// read back after the kernel.
//
// group_list lives on the device (MoeInitRouting writes it there) and the host never reads it:
// the kernel checks its values itself (it never reads out of bounds on a bad list) and reports it,
// or a non-finite C / S, through the node's status word (cuda/device_status.h): at the node's
// next Compute, or by ort_ops_take_device_error() after the Run. The host never waits for the GPU.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <string>

#include "common/tensor.h"
#include "cuda/device_status.h"
#include "cuda/ort_cuda.h"
#include "ops/grouped_matmul/validate.h"
#include "ops/grouped_matmul_swiglu_quant/cuda.cuh"
#include "ops/grouped_matmul_swiglu_quant/cuda_wgmma.cuh"
#include "ops/grouped_matmul_swiglu_quant/weight_layout.h"

namespace ort_ops::gmsq_cuda {

using cuda_util::check_cuda;
using cuda_util::OrtCudaScratch;

// Validates inputs 0..5, allocates the outputs and runs the op (bias: the optional input 5, its
// values unchecked on the host: DESIGN.md; act: GroupedMatmulSwigluQuant's activation).
// swiglu: GroupedMatmulSwigluQuant (outputs y int8 [M, N/2], y_scale, y_offset), else
// GroupedMatmulDequant (y float32 [M, N]).
// layout: GroupedMatmulSwigluQuant's weight_layout; "ENK" is GmsqParams::weight_layout 2 (the
// Hopper wgmma kernel for many rows an expert on sm_90, else the mma.sync kernel's K-major path).
inline void run_grouped_op(const char* op, Ort::KernelContext& ctx, int64_t group_list_type,
                           bool swiglu, gmsq_layout::WeightLayout layout,
                           const grouped_matmul::Act& act, int* status_word) {
  constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
  if (layout == gmsq_layout::WeightLayout::kEN16K4)
    fail_unsupported(op, "weight_layout 'EN16K4' is a CPU layout; use ", swiglu ? "'EKN' or 'ENK'" : "'EKN'",
                     " on CUDA");
  grouped_matmul::Inputs in = grouped_matmul::read_inputs(ctx);
  gmsq_layout::to_logical_weight(op, in, layout, swiglu);
  const InputView &x = in.x, &w = in.weight, &ws = in.weight_scale, &xs = in.x_scale,
                  &gl = in.group_list;
  const grouped_matmul::Dims d = grouped_matmul::validate_inputs(op, in, swiglu, {});
  const int64_t m = d.m, k = d.k, e = d.e, n = d.n;
  // The kernel's needs: exact int32 sums, 16-byte rows of x and weight, the second column half
  // starting at N/2 on a 16-byte boundary.
  if (k > 131071)
    fail_unsupported(op, "K must be <= 131071 so the int32 accumulator cannot overflow, got ", k);
  if (k % 16 != 0) fail_unsupported(op, "K must be a multiple of 16 on the CUDA EP, got ", k);
  if (n % 32 != 0) fail_unsupported(op, "N must be a multiple of 32 on the CUDA EP, got ", n);
  if (e > kGmsqMaxExperts)
    fail_unsupported(op, "at most ", kGmsqMaxExperts, " experts on the CUDA EP, got ", e);
  if (m >= (int64_t{1} << 31)) fail_unsupported(op, "M must be < 2^31 on the CUDA EP, got ", m);
  const bool enk = layout == gmsq_layout::WeightLayout::kENK;
  if (enk && e * n >= (int64_t{1} << 31))  // the wgmma kernel's weight tensor map
    fail_unsupported(op, "weight_layout 'ENK' needs E * N < 2^31 on the CUDA EP, got ", e * n);

  GmsqParams p{};
  if (swiglu) {
    p.y = make_output<int8_t>(ctx, 0, {m, n / 2});
    p.y_scale = make_output<float>(ctx, 1, {m});
    p.y_offset = make_output<float>(ctx, 2, {m});
  } else {
    p.y_float = make_output<float>(ctx, 0, {m, n});
  }
  if (m == 0) return;
  auto stream = static_cast<cudaStream_t>(ctx.GetGPUComputeStream());

  const size_t ws_bytes = gmsq_workspace_bytes(m, n, e);
  const size_t wsc_bytes = ws.dtype == F16 ? 4 * static_cast<size_t>(e * n + 4) : 0;
  const size_t xsc_bytes = xs.dtype == F16 ? 4 * static_cast<size_t>(m + 4) : 0;
  OrtCudaScratch scratch(op, ctx, ws_bytes + wsc_bytes + xsc_bytes);
  p.w_scale = ws.ptr<float>();
  p.x_scale = xs.ptr<float>();
  if (wsc_bytes) {
    float* dst = reinterpret_cast<float*>(scratch.get() + ws_bytes);
    check_cuda(op, launch_half_to_float(ws.ptr<uint16_t>(), dst, e * n, stream),
               "weight_scale conversion");
    p.w_scale = dst;
  }
  if (xsc_bytes) {
    float* dst = reinterpret_cast<float*>(scratch.get() + ws_bytes + wsc_bytes);
    check_cuda(op, launch_half_to_float(xs.ptr<uint16_t>(), dst, m, stream), "x_scale conversion");
    p.x_scale = dst;
  }
  p.x = x.ptr<int8_t>();
  p.weight = w.ptr<int8_t>();
  p.group_list = gl.ptr<int64_t>();
  p.workspace = scratch.get();
  p.m = m;
  p.k = k;
  p.n = n;
  p.e = e;
  p.group_list_type = static_cast<int>(group_list_type);
  p.config = kGmsqAuto;
  p.weight_layout = enk ? kGmsqLayoutKMajor : 0;
  p.err = status_word;
  p.bias = in.bias.present ? in.bias.ptr<float>() : nullptr;
  p.activation =
      act.kind == grouped_matmul::Activation::kSwigluOai ? kGmsqActSwigluOai : kGmsqActSwiglu;
  p.alpha = act.alpha;
  p.limit = act.limit;
  const cudaError_t launched = swiglu ? launch_gmsq(p, stream) : launch_gmd(p, stream);
  check_cuda(op, launched, "kernel launch");
}

// The message for the bits a launch set, with the row count of the latest Run.
inline std::string describe_error(const char* op, int bits, int64_t group_list_type, int64_t rows) {
  if (bits & kErrGroupList)
    return group_list_type == 1
               ? str_cat(op, ": input 'group_list' must hold counts >= 0 summing to <= ", rows, " (rows of 'x')")
               : str_cat(op, ": input 'group_list' must be non-decreasing and >= 0 and end at <= ", rows,
                         " (rows of 'x')");
  return str_cat(op, ": a row's dequantized product or SwiGLU output is not finite; check inputs 'x_scale' and "
                     "'weight_scale'");
}

// One GroupedMatmulSwigluQuant (swiglu) or GroupedMatmulDequant node on the CUDA EP.
class GroupedOpCuda final : public KernelImpl {
 public:
  GroupedOpCuda(const OrtKernelInfo* info, const char* op, bool swiglu)
      : op_(op),
        swiglu_(swiglu),
        group_list_type_(grouped_matmul::read_group_list_type(op, info)),
        layout_(gmsq_layout::read_weight_layout(op, info)),
        act_(swiglu ? grouped_matmul::read_activation(op, info) : grouped_matmul::Act{}),
        status_([this](int bits) { return describe_error(op_, bits, group_list_type_, rows_.load()); }) {}

  void compute(Ort::KernelContext& ctx) override {
    status_.raise_pending();
    if (!swiglu_ && layout_ == gmsq_layout::WeightLayout::kENK)
      fail_unsupported(op_, "weight_layout 'ENK' is not supported on CUDA (the kernel reads K-major weights "
                            "only in GroupedMatmulSwigluQuant); use 'EKN'");
    rows_.store(ctx.GetInput(0).GetTensorTypeAndShapeInfo().GetShape().at(0));
    run_grouped_op(op_, ctx, group_list_type_, swiglu_, layout_, act_, status_.word(op_));
  }

 private:
  const char* op_;
  bool swiglu_;
  int64_t group_list_type_;
  gmsq_layout::WeightLayout layout_;
  grouped_matmul::Act act_;
  std::atomic<int64_t> rows_{0};
  cuda_util::DeviceStatus status_;
};

}  // namespace ort_ops::gmsq_cuda
