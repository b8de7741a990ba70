// SPDX-License-Identifier: MIT
// AVX2 + F16C conversions; only this file gets -mavx2 -mfma -mf16c (see CMakeLists.txt).
#include <immintrin.h>

#include "common/convert.h"
#include "common/half.h"

namespace ort_ops {

void half_to_float_avx2(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = half_to_float(in[i]);
}

void float_to_half_avx2(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = float_to_half(in[i]);
}

}  // namespace ort_ops
