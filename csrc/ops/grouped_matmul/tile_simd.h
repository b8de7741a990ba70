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
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/grouped_matmul/cpu.h"
#include "ops/grouped_matmul/exp_f32.h"

namespace ort_ops::grouped_matmul {
namespace {

constexpr int64_t kStepBytes = kTileCols * 4;
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kGemvPrefetch = 512;  // bytes ahead in each weight row (few-row path)

// Packing: each Traits::pack_group turns G columns of KPER weight rows into G * 4 bytes with
// in-lane unpacks only (no cross-lane fix-ups), so packed columns come out in a fixed permuted
// order, Traits::perm(p) giving the column of packed position p. The micro-kernel does not care
// about column order; weight scales and column sums are laid out in packed order too, and each
// finished row is put back in natural order once (finish_row), 128 moves per row and tile.

// Bytes [0, count) of p (count <= N), zeros after: never reads past a segment's last column.
template <int N>
inline const int8_t* safe_cols(const int8_t* p, int64_t count, int8_t* tmp) {
  if (count >= N) return p;
  std::memset(tmp, 0, N);
  if (count > 0) std::memcpy(tmp, p, static_cast<size_t>(count));
  return tmp;
}

// Packs the tile's columns; for VNNI also returns corr[p] = 128 * sum_k W[k, col(p)], the term
// the unsigned x + 128 trick adds (int32 arithmetic wraps modulo 2^32: exact, see cpu.h), and
// colmap[p] = the natural tile position of packed position p.
template <class T>
void pack_tile(const TileArgs& a, int64_t steps, uint8_t* pk, int32_t* corr, int32_t* colmap) {
  constexpr int64_t G = T::PACK_G;
  const bool swiglu = a.mode == Mode::kSwiglu;
  const int64_t seg_pitch = swiglu ? kHalfCols : kTileCols;
  const int64_t seg_col[2] = {a.col0, a.n / 2 + a.col0};
  const int nseg = swiglu ? 2 : 1;
  for (int64_t p = 0; p < kTileCols; ++p) colmap[p] = static_cast<int32_t>((p / G) * G + T::perm(p % G));
  typename T::Vec colsum[kTileCols / T::VW];
  for (auto& v : colsum) v = T::zero();
  alignas(64) int8_t tmp[T::KPER][G];
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k0 = s * T::KPER;
    uint8_t* dst = pk + s * kStepBytes;
    for (int sg = 0; sg < nseg; ++sg) {
      // Every weight row of the step ahead (rows kPrefetchRows further on): the segments are
      // short strided pieces the hardware prefetchers do not follow far enough.
      for (int i = 0; i < T::KPER; ++i)
        if (k0 + kPrefetchRows + i < a.k)
          for (int64_t c = 0; c < a.width; c += 64)
            _mm_prefetch(reinterpret_cast<const char*>(a.w + (k0 + kPrefetchRows + i) * a.n + seg_col[sg] + c),
                         _MM_HINT_T0);
      for (int64_t g = 0; g < seg_pitch; g += G) {
        const int64_t pc = sg * seg_pitch + g;  // first packed column of the group
        const int8_t* rows[T::KPER];
        for (int i = 0; i < T::KPER; ++i) {
          if (k0 + i < a.k) {
            rows[i] = safe_cols<G>(a.w + (k0 + i) * a.n + seg_col[sg] + g, a.width - g, tmp[i]);
          } else {
            std::memset(tmp[i], 0, G);
            rows[i] = tmp[i];
          }
        }
        typename T::Vec v[4];
        T::pack_regs(rows, v);
        for (int j = 0; j < 4; ++j) {
          T::store(dst + pc * 4 + j * T::VW * 4, v[j]);
          if constexpr (T::kUnsignedX) colsum[pc / T::VW + j] = T::colsum_add(colsum[pc / T::VW + j], v[j]);
        }
      }
    }
  }
  if constexpr (T::kUnsignedX)
    for (int64_t i = 0; i < kTileCols / T::VW; ++i) T::store(corr + i * T::VW, T::times128(colsum[i]));
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

// swiglu_oai_scalar's operations on 8 lanes (min/max of finite values equal fmin/fmax; a NaN
// lane is refused by the caller's finiteness check).
inline __m256 swiglu_oai8(__m256 a, __m256 g, float alpha, float limit) {
  const __m256 lim = _mm256_set1_ps(limit);
  a = _mm256_min_ps(a, lim);
  g = _mm256_min_ps(_mm256_max_ps(g, _mm256_set1_ps(-limit)), lim);
  const __m256 neg = _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(alpha), a), _mm256_set1_ps(-0.0f));
  const __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(neg));
  return _mm256_mul_ps(_mm256_add_ps(g, _mm256_set1_ps(1.0f)), _mm256_div_ps(a, d));
}

inline __m256 activation8(const Act& act, __m256 a, __m256 g) {
  return act.kind == Activation::kSwigluOai ? swiglu_oai8(a, g, act.alpha, act.limit)
                                            : swiglu8(a, g);
}

// Non-finite lanes (NaN or +-Inf) as a mask.
inline __m256 not_finite8(__m256 v) {
  const __m256 abs = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  return _mm256_cmp_ps(abs, _mm256_set1_ps(__builtin_inff()), _CMP_NLT_UQ);
}

// One row's epilogue from its dequantized C [cols] in packed order (padding columns are 0):
// colmap[p] is the natural position of packed column p, the G segment (SwiGLU) starts at
// natural position `pitch`; c is scratch of cols floats.
inline bool finish_row_n(const TileArgs& a, const float* packed, const int32_t* colmap, float* out,
                         int64_t cols, int64_t pitch, float* c) {
  for (int64_t p = 0; p < cols; ++p) c[colmap[p]] = packed[p];
  if (a.bias != nullptr) {  // one float32 add per live column, in natural order
    for (int64_t j = 0; j < a.width; ++j) c[j] = c[j] + a.bias[a.col0 + j];
    if (a.mode == Mode::kSwiglu)
      for (int64_t j = 0; j < a.width; ++j)
        c[pitch + j] = c[pitch + j] + a.bias[a.n / 2 + a.col0 + j];
  }
  if (a.mode == Mode::kDequant) {
    std::memcpy(out, c, static_cast<size_t>(a.width) * sizeof(float));
    return true;
  }
  __m256 bad = _mm256_setzero_ps();
  for (int64_t j = 0; j < a.width; j += 8) {
    const __m256 av = _mm256_loadu_ps(c + j), gv = _mm256_loadu_ps(c + pitch + j);
    bad = _mm256_or_ps(bad, _mm256_or_ps(not_finite8(av), not_finite8(gv)));
    const __m256 s = activation8(a.act, av, gv);
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

// The same for a tile's kTileCols packed columns (G at kHalfCols).
inline bool finish_row(const TileArgs& a, const float* packed, const int32_t* colmap, float* out) {
  alignas(32) float c[kTileCols];
  return finish_row_n(a, packed, colmap, out, kTileCols, kHalfCols, c);
}

inline uint8_t* thread_buffer(size_t bytes) {
  thread_local std::vector<uint8_t> buf;
  if (buf.size() < bytes + 64) buf.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

// Per packed column: its weight scale (0 for padding, so padding C is exactly 0).
inline void packed_wscale(const TileArgs& a, const int32_t* colmap, float* wsp) {
  const bool swiglu = a.mode == Mode::kSwiglu;
  for (int64_t p = 0; p < kTileCols; ++p) {
    const int64_t nat = colmap[p];  // natural tile position
    const int64_t seg = swiglu ? nat / kHalfCols : 0;
    const int64_t j = swiglu ? nat % kHalfCols : nat;
    wsp[p] = j < a.width ? a.w_scale[(seg ? a.n / 2 : 0) + a.col0 + j] : 0.0f;
  }
}

// Whether the packed column chunk [ch * cw, (ch + 1) * cw) holds real columns (SwiGLU tiles of
// narrow width skip the empty ones). cw divides kHalfCols.
inline bool chunk_live(const TileArgs& a, int64_t ch, int64_t cw) {
  const int64_t first = ch * cw;
  return (a.mode == Mode::kSwiglu ? first % kHalfCols : first) < a.width;
}

// A tile's columns packed for the micro-kernels (in the thread's buffer), with the per-packed-
// column VNNI correction, natural position and weight scale.
struct PackedTile {
  uint8_t* pk;
  alignas(64) int32_t corr[kTileCols];
  alignas(64) int32_t colmap[kTileCols];
  alignas(64) float wsp[kTileCols];
};

template <class T>
void prepare_tile(const TileArgs& a, int64_t steps, PackedTile& t) {
  t.pk = thread_buffer(static_cast<size_t>(steps * kStepBytes));
  std::fill(t.corr, t.corr + kTileCols, 0);
  pack_tile<T>(a, steps, t.pk, t.corr, t.colmap);
  packed_wscale(a, t.colmap, t.wsp);
}

template <class T>
bool tile_simd(const TileArgs& a, int64_t* bad_row) {
  const int64_t steps = (a.k + T::KPER - 1) / T::KPER;
  PackedTile t;
  prepare_tile<T>(a, steps, t);
  const uint8_t* pk = t.pk;
  const int32_t* corr = t.corr;
  const int32_t* colmap = t.colmap;
  const float* wsp = t.wsp;

  constexpr int64_t CW = T::NV * T::VW;  // columns per micro-kernel call
  alignas(64) float cbuf[T::MR][kTileCols];
  typename T::Vec acc[T::MR][T::NV];
  bool live[kTileCols / CW];
  for (int64_t ch = 0; ch < kTileCols / CW; ++ch) live[ch] = chunk_live(a, ch, CW);
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
      if (!finish_row(a, cbuf[i], colmap, a.out + (r0 + i) * a.ldo)) {
        *bad_row = r0 + i;
        return false;
      }
    }
  }
  return true;
}

// ---- few-row experts: K-split partial sums over whole weight rows ----
// An expert with few rows is memory-bound: what matters is reading W_e once, in order. Each
// task takes a block of k rows and sweeps them left to right over all N columns (KPER sequential
// streams the hardware prefetchers follow), keeping the int32 sums of its rows in a buffer;
// gemv_finish adds the blocks' sums (integer adds: any order is exact) and runs the epilogue.
template <class T>
void gemv_partial_simd(const GemvArgs& g) {
  constexpr int64_t G = T::PACK_G;
  constexpr int KU = T::GEMV_KU;  // k steps packed per read-modify-write of the sums
  const int64_t n_pad = (g.n + G - 1) / G * G;
  std::fill(g.acc, g.acc + g.rows * n_pad, 0);
  if (T::kUnsignedX) std::fill(g.colsum, g.colsum + n_pad, 0);
  alignas(64) int8_t tmp[KU][T::KPER][G];
  // Column chunks small enough that the rows' sums (rows * chunk * 4 bytes <= 16 KB) stay in L1
  // while the chunk's weight rows stream through: one row alone sweeps whole weight rows.
  const int64_t chunk = std::max<int64_t>(G, (4096 / std::max<int64_t>(g.rows, 1)) / G * G);
  for (int64_t c0 = 0; c0 < n_pad; c0 += chunk) {
    for (int64_t k = g.k0; k < g.k1; k += KU * T::KPER) {
      const int64_t step = k / T::KPER;
      // Steps past k1 are left out entirely: their x bytes may lie past the prepared row.
      const int nu = static_cast<int>(std::min<int64_t>(KU, (g.k1 - k + T::KPER - 1) / T::KPER));
      for (int64_t c = c0; c < std::min(n_pad, c0 + chunk); c += G) {
        // KU * KPER short streams (one per weight row) are too many and too short for the
        // hardware prefetchers to ramp up on: fetch each a few groups ahead (rows are
        // contiguous, so running past a row's end prefetches the start of the next).
        for (int i = 0; i < nu * T::KPER; ++i)
          if (k + i < g.k1) _mm_prefetch(reinterpret_cast<const char*>(g.w + (k + i) * g.n + c + kGemvPrefetch), _MM_HINT_T0);
        typename T::Vec v[KU][4];
        for (int u = 0; u < nu; ++u) {
          const int8_t* rows[T::KPER];
          for (int i = 0; i < T::KPER; ++i) {
            const int64_t kk = k + u * T::KPER + i;
            if (kk < g.k1) {
              rows[i] = safe_cols<G>(g.w + kk * g.n + c, g.n - c, tmp[u][i]);
            } else {
              std::memset(tmp[u][i], 0, G);
              rows[i] = tmp[u][i];
            }
          }
          T::pack_regs(rows, v[u]);
        }
        if constexpr (T::kUnsignedX) {
          int32_t* cs = g.colsum + c;
          for (int j = 0; j < 4; ++j) {
            typename T::Vec a = T::load(reinterpret_cast<const uint8_t*>(cs + j * T::VW));
            for (int u = 0; u < nu; ++u) a = T::colsum_add(a, v[u][j]);
            T::store(cs + j * T::VW, a);
          }
        }
        for (int64_t r = 0; r < g.rows; ++r) {
          const uint8_t* xr = g.xprep + r * g.xprep_stride + step * 4;
          int32_t* acc = g.acc + r * n_pad + c;
          typename T::Vec a[4];
          for (int j = 0; j < 4; ++j) a[j] = T::load(reinterpret_cast<const uint8_t*>(acc + j * T::VW));
          for (int u = 0; u < nu; ++u) {
            const typename T::Vec xb = T::bcast(xr + u * 4);
            for (int j = 0; j < 4; ++j) a[j] = T::dot(a[j], xb, v[u][j]);
          }
          for (int j = 0; j < 4; ++j) T::store(acc + j * T::VW, a[j]);
        }
      }
    }
  }
}

template <class T>
bool gemv_finish_simd(const GemvFinishArgs& f, int64_t* bad_row) {
  constexpr int64_t G = T::PACK_G;
  const int64_t n_pad = (f.n + G - 1) / G * G;
  thread_local std::vector<int32_t> sum_buf, corr_buf;
  thread_local std::vector<float> c_buf;
  sum_buf.resize(static_cast<size_t>(n_pad));
  corr_buf.assign(static_cast<size_t>(n_pad), 0);
  c_buf.resize(static_cast<size_t>(n_pad));
  if (T::kUnsignedX)
    for (int64_t b = 0; b < f.nparts; ++b) {
      const int32_t* cs = f.colsums + b * f.part_stride;
      for (int64_t p = 0; p < n_pad; ++p)  // unsigned: int32 sums wrap modulo 2^32 (exact, cpu.h)
        corr_buf[p] = static_cast<int32_t>(static_cast<uint32_t>(corr_buf[p]) + static_cast<uint32_t>(cs[p]));
    }
  for (int64_t r = 0; r < f.rows; ++r) {
    std::fill(sum_buf.begin(), sum_buf.end(), 0);
    for (int64_t b = 0; b < f.nparts; ++b) {
      const int32_t* a = f.partials + b * f.part_stride + r * n_pad;
      for (int64_t p = 0; p < n_pad; ++p)
        sum_buf[p] = static_cast<int32_t>(static_cast<uint32_t>(sum_buf[p]) + static_cast<uint32_t>(a[p]));
    }
    const float xs = f.x_scale[r];
    float* c = c_buf.data();
    for (int64_t p = 0; p < n_pad; ++p) {
      const int64_t col = (p / G) * G + T::perm(p % G);
      if (col >= f.n) continue;
      const int32_t acc = static_cast<int32_t>(static_cast<uint32_t>(sum_buf[p]) -
                                               (static_cast<uint32_t>(corr_buf[p]) << 7));
      c[col] = (static_cast<float>(acc) * xs) * f.w_scale[col];
    }
    if (f.bias != nullptr)
      for (int64_t col = 0; col < f.n; ++col) c[col] = c[col] + f.bias[col];
    float* out = f.out + r * f.ldo;
    if (f.mode == Mode::kDequant) {
      std::memcpy(out, c, static_cast<size_t>(f.n) * sizeof(float));
      continue;
    }
    const int64_t h = f.n / 2;
    __m256 bad = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= h; j += 8) {
      const __m256 av = _mm256_loadu_ps(c + j), gv = _mm256_loadu_ps(c + h + j);
      bad = _mm256_or_ps(bad, _mm256_or_ps(not_finite8(av), not_finite8(gv)));
      _mm256_storeu_ps(out + j, activation8(f.act, av, gv));
    }
    bool ok = _mm256_movemask_ps(bad) == 0;
    for (; j < h; ++j) {
      if (!std::isfinite(c[j]) || !std::isfinite(c[h + j])) ok = false;
      out[j] = activation_scalar(f.act, c[j], c[h + j]);
    }
    if (!ok) {
      *bad_row = r;
      return false;
    }
  }
  return true;
}

}  // namespace
}  // namespace ort_ops::grouped_matmul
