// SPDX-License-Identifier: MIT
// AVX2 grouped-GEMM tile: int16 pairs and VPMADDWD (int16 x int16 -> int32 pair sums). Exact for
// every int8 code, -128 included (VPMADDUBSW would saturate or overflow its sign trick), at the
// same products per instruction pair as the VPMADDUBSW route. Only this file gets AVX2 flags.
#include <cstring>

#include "ops/grouped_matmul/tile_simd.h"

namespace ort_ops::grouped_matmul {
namespace {

struct Avx2Traits {
  using Vec = __m256i;
  static constexpr int KPER = 2;   // k values per 4-byte column slot
  static constexpr int VW = 8;     // columns per vector
  static constexpr int NV = 4;     // vectors per micro-kernel row (32 columns)
  static constexpr int MR = 3;     // rows per micro-kernel: 12 accumulators of 16 ymm registers
  static constexpr int GEMV_KU = 2;  // packed k steps held in registers by the few-row path
  static constexpr bool kUnsignedX = false;
  static Vec zero() { return _mm256_setzero_si256(); }
  static Vec load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Vec bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static Vec dot(Vec c, Vec x, Vec w) { return _mm256_add_epi32(c, _mm256_madd_epi16(x, w)); }
  // 32 columns per group: int16 pairs of 16 columns per ymm half, lanes split 8 / 8.
  static constexpr int64_t PACK_G = 32;
  static constexpr int64_t perm(int64_t p) {
    return (p / 16) * 16 + ((p % 8) / 4) * 8 + ((p / 8) % 2) * 4 + p % 4;
  }
  static void pack_regs(const int8_t* const rows[2], Vec v[4]) {
    for (int h = 0; h < 2; ++h) {
      const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[0] + 16 * h)));
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[1] + 16 * h)));
      v[2 * h] = _mm256_unpacklo_epi16(a, b);
      v[2 * h + 1] = _mm256_unpackhi_epi16(a, b);
    }
  }
  static void store(void* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static Vec colsum_add(Vec c, Vec) { return c; }  // signed x: no column sums needed
  static Vec times128(Vec v) { return _mm256_slli_epi32(v, 7); }
  static void store_c(Vec acc, const int32_t*, float xs, const float* ws, float* out) {
    __m256 f = _mm256_cvtepi32_ps(acc);
    f = _mm256_mul_ps(f, _mm256_set1_ps(xs));
    f = _mm256_mul_ps(f, _mm256_load_ps(ws));
    _mm256_store_ps(out, f);
  }
};

}  // namespace

bool tile_avx2(const TileArgs& a, int64_t* bad_row) { return tile_simd<Avx2Traits>(a, bad_row); }

void gemv_partial_avx2(const GemvArgs& g) { gemv_partial_simd<Avx2Traits>(g); }
bool gemv_finish_avx2(const GemvFinishArgs& f, int64_t* bad_row) {
  return gemv_finish_simd<Avx2Traits>(f, bad_row);
}

}  // namespace ort_ops::grouped_matmul
