// SPDX-License-Identifier: MIT
// AVX-VNNI grouped-GEMM tile (VEX VPDPBUSD on ymm: 4 u8 x s8 products per int32 lane, no
// intermediate saturation). x enters as x + 128 (prepared rows) and the tile subtracts
// 128 * column sum, so -128 codes in x or W stay exact. Only this file gets AVX-VNNI flags.
#include <cstring>

#include "ops/grouped_matmul/tile_simd.h"

namespace ort_ops::grouped_matmul {
namespace {

struct AvxVnniTraits {
  using Vec = __m256i;
  static constexpr int KPER = 4;
  static constexpr int VW = 8;
  static constexpr int NV = 4;
  static constexpr int MR = 3;
  static constexpr int GEMV_KU = 2;  // packed k steps held in registers by the few-row path
  static constexpr bool kUnsignedX = true;
  static Vec zero() { return _mm256_setzero_si256(); }
  static Vec load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Vec bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static Vec dot(Vec c, Vec x, Vec w) { return _mm256_dpbusd_avx_epi32(c, x, w); }
  // 32 columns per group: 4 k-rows interleaved into quads by in-lane unpacks (lanes 16 apart).
  static constexpr int64_t PACK_G = 32;
  static constexpr int64_t perm(int64_t p) { return ((p % 8) / 4) * 16 + (p / 8) * 4 + p % 4; }
  static void pack_regs(const int8_t* const rows[4], Vec v[4]) {
    __m256i r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i]));
    const __m256i lo01 = _mm256_unpacklo_epi8(r[0], r[1]), hi01 = _mm256_unpackhi_epi8(r[0], r[1]);
    const __m256i lo23 = _mm256_unpacklo_epi8(r[2], r[3]), hi23 = _mm256_unpackhi_epi8(r[2], r[3]);
    v[0] = _mm256_unpacklo_epi16(lo01, lo23);
    v[1] = _mm256_unpackhi_epi16(lo01, lo23);
    v[2] = _mm256_unpacklo_epi16(hi01, hi23);
    v[3] = _mm256_unpackhi_epi16(hi01, hi23);
  }
  static void store(void* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  // Column sums ride on the same instruction: 1 (unsigned) times each packed weight (signed).
  static Vec colsum_add(Vec c, Vec v) { return _mm256_dpbusd_avx_epi32(c, _mm256_set1_epi8(1), v); }
  static Vec times128(Vec v) { return _mm256_slli_epi32(v, 7); }

  static void store_c(Vec acc, const int32_t* corr, float xs, const float* ws, float* out) {
    acc = _mm256_sub_epi32(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(corr)));
    __m256 f = _mm256_cvtepi32_ps(acc);
    f = _mm256_mul_ps(f, _mm256_set1_ps(xs));
    f = _mm256_mul_ps(f, _mm256_load_ps(ws));
    _mm256_store_ps(out, f);
  }
};

}  // namespace

bool tile_avxvnni(const TileArgs& a, int64_t* bad_row) { return tile_simd<AvxVnniTraits>(a, bad_row); }

void gemv_partial_avxvnni(const GemvArgs& g) { gemv_partial_simd<AvxVnniTraits>(g); }
bool gemv_finish_avxvnni(const GemvFinishArgs& f, int64_t* bad_row) {
  return gemv_finish_simd<AvxVnniTraits>(f, bad_row);
}

}  // namespace ort_ops::grouped_matmul
