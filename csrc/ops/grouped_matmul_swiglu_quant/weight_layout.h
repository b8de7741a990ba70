// SPDX-License-Identifier: MIT
// The attribute weight_layout of GroupedMatmulSwigluQuant and GroupedMatmulDequant, shared by the
// CPU ops (grouped_matmul/driver.cc read_problem_layout) and the CUDA-EP ops (cuda_op_common.h):
// "EKN" (default) takes weight int8 [E, K, N], the contract's layout; "ENK" takes [E, N, K] (weight[e, n, k] = W_e[k, n], K-major: the Hopper wgmma kernel's B
// operand, GmsqParams::weight_layout 2); "EN16K4" (CPU only) takes [E, ceil(N/16), K/4, 16, 4]
// (weight[e, n / 16, k / 4, n % 16, k % 4] = W_e[k, n], zeros for n >= N; K a multiple of 4):
// per 16-column tile, the k quads of all K in order, so every 1 KB run is an AMX B tile and the
// AMX panels stream it without packing. Same result every way; spec:
// ort_ops/ops/_moe.py (weight_ekn, pack_en16k4). GroupedMatmulDequant on the CUDA EP takes "EKN" only.
#pragma once

#include <string>
#include <utility>

#include "common/op_base.h"
#include "common/tensor.h"
#include "ops/grouped_matmul/validate.h"

namespace ort_ops::gmsq_layout {

enum class WeightLayout { kEKN, kENK, kEN16K4 };

// Reads the attribute at kernel creation; an unknown value, or one that is not a string (an int
// 2 would otherwise read as absent: a silent "EKN" on a square [E, N, K] weight), fails naming
// the allowed ones.
inline WeightLayout read_weight_layout(const char* op, const OrtKernelInfo* info) {
  const std::string s = attr_string(info, "weight_layout", "");
  if (s == "EKN" || (s.empty() && !has_attr(info, "weight_layout"))) return WeightLayout::kEKN;
  if (s == "ENK") return WeightLayout::kENK;
  if (s == "EN16K4") return WeightLayout::kEN16K4;
  if (s.empty())
    fail_invalid(op, "attribute 'weight_layout' must be 'EKN' (weight [E, K, N]), 'ENK' (weight [E, N, K]) or "
                     "'EN16K4' (weight [E, N/16, K/4, 16, 4]), got a non-string value");
  fail_invalid(op, "attribute 'weight_layout' must be 'EKN' (weight [E, K, N]), 'ENK' (weight [E, N, K]) or "
                   "'EN16K4' (weight [E, N/16, K/4, 16, 4]), got '", s, "'");
}

// For "EN16K4": checks K of x a multiple of 4 and the weight [E, ceil(N/16), K/4, 16, 4] with N
// of weight_scale [E, N], then gives in.weight the logical shape [E, K, N].
// For "ENK": checks that the weight's K (last dim) is x's and N (dim 1) is even, then gives
// in.weight the logical shape [E, K, N] so that grouped_matmul::validate_inputs' checks (and
// their messages for every other input) apply unchanged. Presence, dtype and rank errors are
// left to validate_inputs, which reports them first for either layout.
inline void to_logical_weight(const char* op, grouped_matmul::Inputs& in, WeightLayout layout,
                              bool even_n) {
  if (layout == WeightLayout::kEKN) return;
  constexpr auto I8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  const InputView& x = in.x;
  InputView& w = in.weight;
  if (layout == WeightLayout::kEN16K4) {
    if (!x.present || !w.present || !in.weight_scale.present || !in.x_scale.present ||
        !in.group_list.present || x.dtype != I8 || x.rank() != 2 || w.dtype != I8)
      return;
    const int64_t k = x.dim(1);
    if (k % 4 != 0)
      fail_unsupported(op, "weight_layout 'EN16K4' needs K (dim 1 of 'x') to be a multiple of 4, got ", k);
    const InputView& ws = in.weight_scale;
    const int64_t n = ws.rank() == 2 ? ws.dim(1) : (w.rank() == 5 ? w.dim(1) * 16 : 0);
    if (w.rank() != 5 || w.dim(1) != (n + 15) / 16 || w.dim(2) != k / 4 || w.dim(3) != 16 || w.dim(4) != 4)
      fail_invalid(op, "input 'weight' must be [E, ceil(N/16), K/4, 16, 4] = [E, ", (n + 15) / 16, ", ", k / 4,
                   ", 16, 4] for weight_layout 'EN16K4' (K of 'x', N of 'weight_scale'), got ", shape_str(w.shape));
    w.shape = {w.dim(0), k, n};
    return;
  }
  if (!x.present || !w.present || !in.weight_scale.present || !in.x_scale.present ||
      !in.group_list.present || x.dtype != I8 || x.rank() != 2 || w.dtype != I8 || w.rank() != 3)
    return;
  if (w.dim(2) != x.dim(1))
    fail_invalid(op, "input 'weight' must be [E, N, K] = [E, N, ", x.dim(1),
                 "] for weight_layout 'ENK' (K of 'x'), got ", shape_str(w.shape));
  if (even_n && w.dim(1) % 2 != 0)
    fail_invalid(op, "input 'weight' must have an even N (dim 1 for weight_layout 'ENK'), got ",
                 w.dim(1));
  std::swap(w.shape[1], w.shape[2]);
}

}  // namespace ort_ops::gmsq_layout
