// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant's attribute 'activation' and the optional bias of both grouped GEMM
// ops as plain values (no ORT or CUDA headers), shared by the CPU kernels (cpu.h), the CUDA
// launchers (grouped_matmul_swiglu_quant/*.cuh) and the attribute reader (validate.h).
// Spec: ort_ops/ops/_moe.py (the float32 recipe):
//   C = ((float32(acc) * x_scale[m]) * weight_scale[e, n]) + bias[e, n]      bias optional
//   "swiglu":     S = (A / (1 + exp_f32(-A))) * G
//   "swiglu_oai": a = min(A, limit); g = min(max(G, -limit), limit);
//                 S = (g + 1) * (a / (1 + exp_f32(-(alpha * a))))
#pragma once

namespace ort_ops::grouped_matmul {

enum class Activation : int { kSwiglu = 0, kSwigluOai = 1 };

// gpt-oss's defaults for "swiglu_oai".
constexpr float kOaiAlpha = 1.702f;
constexpr float kOaiLimit = 7.0f;

struct Act {
  Activation kind = Activation::kSwiglu;
  float alpha = kOaiAlpha;  // read by kSwigluOai only
  float limit = kOaiLimit;  // finite and > 0 (checked when the attribute is read)
};

}  // namespace ort_ops::grouped_matmul
