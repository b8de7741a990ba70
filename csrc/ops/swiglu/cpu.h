// SPDX-License-Identifier: MIT
// SwiGLU CPU row kernel: the contract's float32 recipe (DESIGN.md "SwiGLU"; spec
// ort_ops/ops/swiglu.py) on one row, a = x[0, I), b = x[I, 2I).
#pragma once

#include <cstdint>

namespace ort_ops::swiglu {

// y[i] = silu(a[i]) * b[i] for i in [0, n), in the recipe's float32 order.
void swiglu_row_scalar(const float* a, const float* b, float* y, int64_t n);
// The same on 8 lanes (AVX2), bit-exact with swiglu_row_scalar.
void swiglu_row_avx2(const float* a, const float* b, float* y, int64_t n);

}  // namespace ort_ops::swiglu
