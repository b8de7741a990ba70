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
  static constexpr bool kUnsignedX = true;
  static Vec zero() { return _mm256_setzero_si256(); }
  static Vec load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Vec bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  static Vec dot(Vec c, Vec x, Vec w) { return _mm256_dpbusd_avx_epi32(c, x, w); }
  static __m128i dot128(__m128i c, __m128i u, __m128i s) { return _mm_dpbusd_avx_epi32(c, u, s); }
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

}  // namespace ort_ops::grouped_matmul
