// SPDX-License-Identifier: MIT
// AVX-512 VNNI grouped-GEMM tile (EVEX VPDPBUSD on zmm: 64 u8 x s8 products per instruction).
// Same x + 128 / column-sum correction as cpu_avxvnni.cc; 6 rows x 64 columns per micro-kernel
// (24 of the 32 zmm registers hold accumulators). Only this file gets AVX-512 flags.
#include <cstring>

#include "ops/grouped_matmul/tile_simd.h"

// GCC 12 warns inside its own _mm512_cvtepi32_ps / _mm512_slli_epi32 (the header's
// `__m512 __Y = __Y` undefined-value placeholder), not about our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace ort_ops::grouped_matmul {
namespace {

struct Avx512VnniTraits {
  using Vec = __m512i;
  static constexpr int KPER = 4;
  static constexpr int VW = 16;
  static constexpr int NV = 4;
  static constexpr int MR = 6;
  static constexpr int GEMV_KU = 4;  // packed k steps held in registers by the few-row path
  static constexpr bool kUnsignedX = true;
  static Vec zero() { return _mm512_setzero_si512(); }
  static Vec load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Vec bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static Vec dot(Vec c, Vec x, Vec w) { return _mm512_dpbusd_epi32(c, x, w); }
  // 64 columns per group: 4 k-rows interleaved into quads by in-lane unpacks (lanes 16 apart).
  static constexpr int64_t PACK_G = 64;
  static constexpr int64_t perm(int64_t p) { return ((p % 16) / 4) * 16 + (p / 16) * 4 + p % 4; }
  static void pack_regs(const int8_t* const rows[4], Vec v[4]) {
    __m512i r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_si512(rows[i]);
    const __m512i lo01 = _mm512_unpacklo_epi8(r[0], r[1]), hi01 = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(r[2], r[3]), hi23 = _mm512_unpackhi_epi8(r[2], r[3]);
    v[0] = _mm512_unpacklo_epi16(lo01, lo23);
    v[1] = _mm512_unpackhi_epi16(lo01, lo23);
    v[2] = _mm512_unpacklo_epi16(hi01, hi23);
    v[3] = _mm512_unpackhi_epi16(hi01, hi23);
  }
  static void store(void* p, Vec v) { _mm512_storeu_si512(p, v); }
  // Column sums ride on the same instruction: 1 (unsigned) times each packed weight (signed).
  static Vec colsum_add(Vec c, Vec v) { return _mm512_dpbusd_epi32(c, _mm512_set1_epi8(1), v); }
  static Vec times128(Vec v) { return _mm512_slli_epi32(v, 7); }
  static void store_c(Vec acc, const int32_t* corr, float xs, const float* ws, float* out) {
    acc = _mm512_sub_epi32(acc, _mm512_load_si512(corr));
    __m512 f = _mm512_cvtepi32_ps(acc);
    f = _mm512_mul_ps(f, _mm512_set1_ps(xs));
    f = _mm512_mul_ps(f, _mm512_load_ps(ws));
    _mm512_store_ps(out, f);
  }
};

}  // namespace

bool tile_avx512vnni(const TileArgs& a, int64_t* bad_row) {
  return tile_simd<Avx512VnniTraits>(a, bad_row);
}

void gemv_partial_avx512vnni(const GemvArgs& g) { gemv_partial_simd<Avx512VnniTraits>(g); }
bool gemv_finish_avx512vnni(const GemvFinishArgs& f, int64_t* bad_row) {
  return gemv_finish_simd<Avx512VnniTraits>(f, bad_row);
}

}  // namespace ort_ops::grouped_matmul
