// SPDX-License-Identifier: MIT
// Portable SwiGLU row kernel. The arithmetic is GroupedMatmulSwigluQuant's "swiglu" activation
// (grouped_matmul::swiglu_scalar, the same exp_f32), plus the contract's rule for a = -Inf.
#include <cmath>
#include <limits>

#include "ops/grouped_matmul/cpu.h"
#include "ops/swiglu/cpu.h"

namespace ort_ops::swiglu {

void swiglu_row_scalar(const float* a, const float* b, float* y, int64_t n) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    // exp_f32 clamps, so a / d alone gives -Inf at a = -Inf; the replaced graph gives -Inf * 0.
    y[i] = a[i] == kNegInf ? kNaN : grouped_matmul::swiglu_scalar(a[i], b[i]);
  }
}

}  // namespace ort_ops::swiglu
