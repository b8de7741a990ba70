// SPDX-License-Identifier: MIT
// The SIMD grouped-GEMM tile, generic over a Traits struct (vector type, dot-product step,
// bytes of k per 4-byte column slot), included by the ISA files only (cpu_avx2.cc,
// cpu_avxvnni.cc, cpu_avx512vnni.cc), each compiled with its own ISA flags; everything here
// is in an anonymous namespace so the copies never meet at link time.
//
// Packed tile layout: [steps][kTileCols][4 bytes]; one step is KPER values of k per column
// (AVX2: 2 int16, VNNI: 4 int8), so one vector load gives VW columns of one step and one
// 4-byte broadcast of a prepared x row gives the matching k values.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops/grouped_matmul/cpu.h"
#include "ops/grouped_matmul/exp_f32.h"

namespace ort_ops::grouped_matmul {
namespace {

constexpr int64_t kStepBytes = kTileCols * 4;
constexpr int64_t kPrefetchRows = 16;

// Bytes [0, count) of p (count <= 16), zeros after: never reads past a segment's last column.
inline __m128i load_cols(const int8_t* p, int64_t count) {
  if (count >= 16) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(16) int8_t tmp[16] = {};
  if (count > 0) std::memcpy(tmp, p, static_cast<size_t>(count));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}

// Packs 16 columns (W columns c .. c + count) of the KPER rows k0 .. into 64 bytes at dst.
// KPER 4: int8 quads (VNNI). KPER 2: int16 pairs (AVX2 VPMADDWD).
template <int KPER>
inline void pack16(const int8_t* w, int64_t ldw, int64_t k, int64_t k0, int64_t c, int64_t count,
                   uint8_t* dst, __m128i out[4]) {
  __m128i r[4];
  for (int i = 0; i < KPER; ++i)
    r[i] = (k0 + i < k) ? load_cols(w + (k0 + i) * ldw + c, count) : _mm_setzero_si128();
  if constexpr (KPER == 4) {
    const __m128i lo01 = _mm_unpacklo_epi8(r[0], r[1]), hi01 = _mm_unpackhi_epi8(r[0], r[1]);
    const __m128i lo23 = _mm_unpacklo_epi8(r[2], r[3]), hi23 = _mm_unpackhi_epi8(r[2], r[3]);
    out[0] = _mm_unpacklo_epi16(lo01, lo23);  // columns 0-3, 4 k each
    out[1] = _mm_unpackhi_epi16(lo01, lo23);  // 4-7
    out[2] = _mm_unpacklo_epi16(hi01, hi23);  // 8-11
    out[3] = _mm_unpackhi_epi16(hi01, hi23);  // 12-15
  } else {
    const __m128i a0 = _mm_cvtepi8_epi16(r[0]), a1 = _mm_cvtepi8_epi16(_mm_srli_si128(r[0], 8));
    const __m128i b0 = _mm_cvtepi8_epi16(r[1]), b1 = _mm_cvtepi8_epi16(_mm_srli_si128(r[1], 8));
    out[0] = _mm_unpacklo_epi16(a0, b0);  // columns 0-3, 2 k each
    out[1] = _mm_unpackhi_epi16(a0, b0);
    out[2] = _mm_unpacklo_epi16(a1, b1);
    out[3] = _mm_unpackhi_epi16(a1, b1);
  }
  for (int i = 0; i < 4; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * i), out[i]);
}

// Packs the tile's columns; for VNNI also returns corr[j] = 128 * sum_k W[k, col j], the term
// the unsigned x + 128 trick adds (int32 arithmetic wraps modulo 2^32: exact, see cpu.h).
template <class T>
void pack_tile(const TileArgs& a, int64_t steps, uint8_t* pk, int32_t* corr) {
  const bool swiglu = a.mode == Mode::kSwiglu;
  const int64_t seg_pitch = swiglu ? kHalfCols : kTileCols;
  const int64_t seg_col[2] = {a.col0, a.n / 2 + a.col0};
  const int nseg = swiglu ? 2 : 1;
  __m128i colsum[kTileCols / 4];
  for (auto& v : colsum) v = _mm_setzero_si128();
  const __m128i ones = _mm_set1_epi8(1);
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k0 = s * T::KPER;
    uint8_t* dst = pk + s * kStepBytes;
    for (int sg = 0; sg < nseg; ++sg) {
      if (k0 + kPrefetchRows < a.k)
        for (int64_t c = 0; c < a.width; c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(a.w + (k0 + kPrefetchRows) * a.n + seg_col[sg] + c),
                       _MM_HINT_T0);
      for (int64_t g = 0; g < seg_pitch; g += 16) {
        const int64_t pc = sg * seg_pitch + g;  // packed column
        __m128i v[4];
        pack16<T::KPER>(a.w, a.n, a.k, k0, seg_col[sg] + g, a.width - g, dst + pc * 4, v);
        if constexpr (T::kUnsignedX)
          for (int i = 0; i < 4; ++i) colsum[pc / 4 + i] = T::dot128(colsum[pc / 4 + i], ones, v[i]);
      }
    }
  }
  if constexpr (T::kUnsignedX)
    for (int64_t i = 0; i < kTileCols / 4; ++i)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(corr + 4 * i), _mm_slli_epi32(colsum[i], 7));
}

// acc[i][j] = dot products of MR prepared x rows with CW = NV * VW packed columns at wp.
template <class T, int MR>
inline void micro(const uint8_t* xp, int64_t xstride, const uint8_t* wp, int64_t steps,
                  typename T::Vec acc[][T::NV]) {
  typename T::Vec c[MR][T::NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < T::NV; ++j) c[i][j] = T::zero();
  for (int64_t s = 0; s < steps; ++s, wp += kStepBytes, xp += 4) {
    typename T::Vec w[T::NV];
    for (int j = 0; j < T::NV; ++j) w[j] = T::load(wp + j * T::VW * 4);
    for (int i = 0; i < MR; ++i) {
      const typename T::Vec xb = T::bcast(xp + i * xstride);
      for (int j = 0; j < T::NV; ++j) c[i][j] = T::dot(c[i][j], xb, w[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < T::NV; ++j) acc[i][j] = c[i][j];
}

template <class T>
inline void micro_n(int mr, const uint8_t* xp, int64_t xstride, const uint8_t* wp, int64_t steps,
                    typename T::Vec acc[][T::NV]) {
  static_assert(T::MR <= 6, "extend the switch");
  switch (mr) {
    case 1: micro<T, 1>(xp, xstride, wp, steps, acc); break;
    case 2: micro<T, 2>(xp, xstride, wp, steps, acc); break;
    case 3: if constexpr (T::MR >= 3) micro<T, 3>(xp, xstride, wp, steps, acc); break;
    case 4: if constexpr (T::MR >= 4) micro<T, 4>(xp, xstride, wp, steps, acc); break;
    case 5: if constexpr (T::MR >= 5) micro<T, 5>(xp, xstride, wp, steps, acc); break;
    case 6: if constexpr (T::MR >= 6) micro<T, 6>(xp, xstride, wp, steps, acc); break;
  }
}

// ---- float32 epilogue, 8 lanes (the same operations as the scalar recipe) ----

inline __m256 exp8(__m256 v) {
  __m256 t = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(t, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Hi)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP1));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP2));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP3));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP4));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP5));
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 y = _mm256_mul_ps(p, z);
  y = _mm256_add_ps(y, r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline __m256 swiglu8(__m256 a, __m256 g) {
  const __m256 neg_a = _mm256_xor_ps(a, _mm256_set1_ps(-0.0f));
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(neg_a));
  return _mm256_mul_ps(_mm256_div_ps(a, d), g);
}

// Non-finite lanes (NaN or +-Inf) as a mask.
inline __m256 not_finite8(__m256 v) {
  const __m256 abs = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return _mm256_cmp_ps(abs, _mm256_set1_ps(__builtin_inff()), _CMP_NLT_UQ);
}

// One row's epilogue from its dequantized C [kTileCols] (padding columns are 0).
inline bool finish_row(const TileArgs& a, const float* c, float* out) {
  if (a.mode == Mode::kDequant) {
    std::memcpy(out, c, static_cast<size_t>(a.width) * sizeof(float));
    return true;
  }
  __m256 bad = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.width; j += 8) {
    const __m256 av = _mm256_loadu_ps(c + j), gv = _mm256_loadu_ps(c + kHalfCols + j);
    bad = _mm256_or_ps(bad, _mm256_or_ps(not_finite8(av), not_finite8(gv)));
    const __m256 s = swiglu8(av, gv);
    if (a.width - j >= 8) {
      _mm256_storeu_ps(out + j, s);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, s);
      std::memcpy(out + j, tmp, static_cast<size_t>(a.width - j) * sizeof(float));
    }
  }
  return _mm256_movemask_ps(bad) == 0;  // padding lanes hold 0: never flagged
}

inline uint8_t* thread_buffer(size_t bytes) {
  thread_local std::vector<uint8_t> buf;
  if (buf.size() < bytes + 64) buf.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

template <class T>
bool tile_simd(const TileArgs& a, int64_t* bad_row) {
  const int64_t steps = (a.k + T::KPER - 1) / T::KPER;
  uint8_t* pk = thread_buffer(static_cast<size_t>(steps * kStepBytes));
  alignas(64) int32_t corr[kTileCols] = {};
  pack_tile<T>(a, steps, pk, corr);

  // Per packed column: its weight scale (0 for padding, so padding C is exactly 0).
  alignas(64) float wsp[kTileCols] = {};
  const bool swiglu = a.mode == Mode::kSwiglu;
  if (swiglu) {
    for (int64_t j = 0; j < a.width; ++j) {
      wsp[j] = a.w_scale[a.col0 + j];
      wsp[kHalfCols + j] = a.w_scale[a.n / 2 + a.col0 + j];
    }
  } else {
    for (int64_t j = 0; j < a.width; ++j) wsp[j] = a.w_scale[a.col0 + j];
  }

  constexpr int64_t CW = T::NV * T::VW;  // columns per micro-kernel call
  alignas(64) float cbuf[T::MR][kTileCols];
  typename T::Vec acc[T::MR][T::NV];
  // Column chunks that hold real columns (SwiGLU tiles of narrow width skip the empty ones).
  bool live[kTileCols / CW];
  for (int64_t ch = 0; ch < kTileCols / CW; ++ch) {
    const int64_t first = ch * CW;
    const int64_t seg_first = swiglu ? first % kHalfCols : first;
    live[ch] = seg_first < a.width;
  }
  for (int64_t r0 = 0; r0 < a.rows; r0 += T::MR) {
    const int mr = static_cast<int>(std::min<int64_t>(T::MR, a.rows - r0));
    const uint8_t* xp = a.xprep + r0 * a.xprep_stride;
    for (int64_t ch = 0; ch < kTileCols / CW; ++ch) {
      if (!live[ch]) {
        for (int i = 0; i < mr; ++i) std::fill(cbuf[i] + ch * CW, cbuf[i] + (ch + 1) * CW, 0.0f);
        continue;
      }
      micro_n<T>(mr, xp, a.xprep_stride, pk + ch * CW * 4, steps, acc);
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < T::NV; ++j) {
          const int64_t col = ch * CW + j * T::VW;
          T::store_c(acc[i][j], corr + col, a.x_scale[r0 + i], wsp + col, cbuf[i] + col);
        }
    }
    for (int i = 0; i < mr; ++i) {
      if (!finish_row(a, cbuf[i], a.out + (r0 + i) * a.ldo)) {
        *bad_row = r0 + i;
        return false;
      }
    }
  }
  return true;
}

}  // namespace
}  // namespace ort_ops::grouped_matmul
