// SPDX-License-Identifier: MIT
// Portable DynamicQuant row kernel: the C++ oracle for the SIMD variants.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "ops/dynamic_quant/cpu.h"

namespace ort_ops::dynamic_quant {

bool quantize_row_scalar(const float* x, const float* smooth, int64_t k, int8_t* y, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    const float v = smooth ? x[i] * smooth[i] : x[i];
    const float a = std::fabs(v);
    if (!(a <= FLT_MAX)) return false;  // NaN or Inf
    amax = std::max(amax, a);
  }
  if (amax == 0.0f) {
    *scale = 0.0f;
    std::fill(y, y + k, int8_t{0});
    return true;
  }
  *scale = amax / 127.0f;
  // The factor saturates at FLT_MAX: for amax below 127 / FLT_MAX (~3.7e-37) 127 / amax is +Inf,
  // and 0 * Inf would make the row's zeros NaN codes (DESIGN.md, Conventions).
  const float inv = std::min(127.0f / amax, FLT_MAX);
  for (int64_t i = 0; i < k; ++i) {
    const float v = smooth ? x[i] * smooth[i] : x[i];
    // std::nearbyint rounds half to even in the default rounding mode, as np.rint does.
    const float r = std::nearbyint(v * inv);
    y[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return true;
}

}  // namespace ort_ops::dynamic_quant
