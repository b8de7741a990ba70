// SPDX-License-Identifier: MIT
// AVX2 DynamicQuant row kernel, 32 values per step; same float32 operations in the same order
// as cpu_scalar.cc, so the codes are identical. Only this file gets the AVX2 flags.
#include <immintrin.h>

#include <algorithm>

#include "ops/dynamic_quant/cpu.h"

namespace ort_ops::dynamic_quant {

namespace {

inline __m256 load_product(const float* x, const float* smooth, int64_t i) {
  __m256 v = _mm256_loadu_ps(x + i);
  return smooth ? _mm256_mul_ps(v, _mm256_loadu_ps(smooth + i)) : v;
}

// Round half to even, clamp to [-127, 127], convert to int32 (exact: the values are integral).
inline __m256i to_codes(__m256 v, __m256 inv) {
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256 r = _mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
}

}  // namespace

bool quantize_row_avx2(const float* x, const float* smooth, int64_t k, int8_t* y, float* scale) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  __m256 vmax = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 a = _mm256_and_ps(load_product(x, smooth, i), abs_mask);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or Inf
    vmax = _mm256_max_ps(vmax, a);
  }
  if (_mm256_movemask_ps(bad)) return false;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.0f;
  for (float l : lanes) amax = std::max(amax, l);
  for (int64_t j = i; j < k; ++j) {
    const float v = smooth ? x[j] * smooth[j] : x[j];
    const float a = v < 0 ? -v : v;
    if (!(a <= 3.402823466e+38f)) return false;
    amax = std::max(amax, a);
  }
  if (amax == 0.0f) {
    *scale = 0.0f;
    std::fill(y, y + k, int8_t{0});
    return true;
  }
  *scale = amax / 127.0f;
  const float inv_s = std::min(127.0f / amax, 3.402823466e+38f);  // saturates: cpu_scalar.cc
  const __m256 inv = _mm256_set1_ps(inv_s);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  i = 0;
  for (; i + 32 <= k; i += 32) {
    __m256i c0 = to_codes(load_product(x, smooth, i), inv);
    __m256i c1 = to_codes(load_product(x, smooth, i + 8), inv);
    __m256i c2 = to_codes(load_product(x, smooth, i + 16), inv);
    __m256i c3 = to_codes(load_product(x, smooth, i + 24), inv);
    // packs work per 128-bit lane; the permute restores element order.
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm256_permutevar8x32_epi32(p, order));
  }
  for (; i < k; ++i) {
    const float v = smooth ? x[i] * smooth[i] : x[i];
    const float r = __builtin_nearbyintf(v * inv_s);
    y[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return true;
}

}  // namespace ort_ops::dynamic_quant
