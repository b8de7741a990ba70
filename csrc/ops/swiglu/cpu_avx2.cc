// SPDX-License-Identifier: MIT
// AVX2 SwiGLU row kernel: GroupedMatmulSwigluQuant's 8-lane "swiglu" (grouped_matmul::swiglu8,
// the scalar recipe's float32 operations lane by lane, no FMA), so the result equals
// swiglu_row_scalar bit for bit; the contract's a = -Inf rule as a blend; the row's last
// n % 8 values on the scalar kernel. Compiled with the AVX2 flags, called only where the CPU
// has AVX2 (the op's ISA selection).
#include <immintrin.h>

#include <limits>

#include "ops/grouped_matmul/tile_simd.h"
#include "ops/swiglu/cpu.h"

namespace ort_ops::swiglu {

void swiglu_row_avx2(const float* a, const float* b, float* y, int64_t n) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 nan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 va = _mm256_loadu_ps(a + i);
    const __m256 s = grouped_matmul::swiglu8(va, _mm256_loadu_ps(b + i));
    // exp_f32 clamps, so a / d alone gives -Inf at a = -Inf; the replaced graph gives -Inf * 0.
    _mm256_storeu_ps(y + i, _mm256_blendv_ps(s, nan, _mm256_cmp_ps(va, neg_inf, _CMP_EQ_OQ)));
  }
  if (i < n) swiglu_row_scalar(a + i, b + i, y + i, n - i);
}

}  // namespace ort_ops::swiglu
