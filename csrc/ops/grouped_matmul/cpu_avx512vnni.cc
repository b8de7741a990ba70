// SPDX-License-Identifier: MIT
// AVX-512 VNNI grouped-GEMM tile (EVEX VPDPBUSD on zmm: 64 u8 x s8 products per instruction).
// Same x + 128 / column-sum correction as cpu_avxvnni.cc; 6 rows x 64 columns per micro-kernel
// (24 of the 32 zmm registers hold accumulators). Only this file gets AVX-512 flags.
#include <cstring>

#include "ops/grouped_matmul/tile_simd.h"

// GCC 12 warns inside its own _mm512_cvtepi32_ps (the header's `__m512 __Y = __Y` placeholder),
// not about our code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace ort_ops::grouped_matmul {
namespace {

struct Avx512VnniTraits {
  using Vec = __m512i;
  static constexpr int KPER = 4;
  static constexpr int VW = 16;
  static constexpr int NV = 4;
  static constexpr int MR = 6;
  static constexpr bool kUnsignedX = true;
  static Vec zero() { return _mm512_setzero_si512(); }
  static Vec load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Vec bcast(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static Vec dot(Vec c, Vec x, Vec w) { return _mm512_dpbusd_epi32(c, x, w); }
  static __m128i dot128(__m128i c, __m128i u, __m128i s) { return _mm_dpbusd_epi32(c, u, s); }
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

}  // namespace ort_ops::grouped_matmul
