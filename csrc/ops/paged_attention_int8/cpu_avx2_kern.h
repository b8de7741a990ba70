// SPDX-License-Identifier: MIT
// AVX2 primitives of the PagedAttentionInt8 driver (struct Avx2Kern). Included only by files
// compiled with the AVX2 flags (cpu_avx2.cc, and the VNNI files, which override the two integer
// dot-product primitives).
//
// Integer exactness:
// - Q.K: _mm256_maddubs_epi16(|k|, sign(q, k)) = pairs of q*k with |q| <= 127 (our own codes)
//   and |k| <= 128: pair sums <= 2 * 128 * 127 = 32512 < 32767, no int16 saturation, for any
//   int8 in the cache. Then _mm256_madd_epi16 by 1 widens to int32.
// - P.V s8: W codes 0..127 are the unsigned operand of maddubs: pair sums <= 2 * 127 * 128.
// - P.V u8: W codes 0..255 must NOT go through maddubs whole (2 * 255 * 127 = 64770 saturates
//   int16, the bug of ORT's own MatMulInteger on AVX2): each code is split into c >> 1 and
//   c & 1 (both <= 127) and the two exact products are combined in int32 (x2 and x1).
// - P.V needs no horizontal sums: 8 output dims' 32-token V slices are transposed as 32-bit
//   lanes (4 tokens each), so lane j of a product accumulates dim j, and each row's 4-code
//   word is broadcast.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "ops/paged_attention_int8/cpu.h"

// Internal linkage: each ISA file gets its own copy compiled with its own flags (a shared
// inline definition could be merged by the linker into the copy built with wider ISA flags).
namespace ort_ops::paged_attention_int8 {
namespace {

// Lane k of the result = sum of the 8 int32 lanes of a[k].
inline __m256i reduce8_epi32(const __m256i* a) {
  const __m256i s01 = _mm256_hadd_epi32(a[0], a[1]), s23 = _mm256_hadd_epi32(a[2], a[3]);
  const __m256i s45 = _mm256_hadd_epi32(a[4], a[5]), s67 = _mm256_hadd_epi32(a[6], a[7]);
  const __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                          _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

inline __m256 reduce8_ps(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax_ps(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8x8 transpose of 32-bit lanes: on return r[k] holds lane k of the 8 inputs. Used on V
// slices: rows = 8 output dims x 32 tokens, so after it r[k] = tokens 4k..4k+3 of each of the 8
// dims, and a dot product over tokens needs no horizontal reduction.
inline void transpose8x8_epi32(__m256i* r) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// Loads the 32-token slices of output dims d0 .. d0 + 7 and transposes them (see above).
inline void load_v_octet(const int8_t* v, int64_t stride, int64_t d0, __m256i* c) {
  for (int j = 0; j < 8; ++j)
    c[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (d0 + j) * stride));
  transpose8x8_epi32(c);
}

// o[0..8) += a * float(acc): a group's int32 sums scaled by its max W / L into the float output.
inline void add_scaled(float* o, float a, __m256i acc) {
  _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_mul_ps(_mm256_set1_ps(a), _mm256_cvtepi32_ps(acc))));
}

// Four W codes (tokens 4k..4k+3) of one row, broadcast to every lane.
inline __m256i bcast_codes(const uint8_t* codes, int k) {
  int32_t x;
  std::memcpy(&x, codes + 4 * k, 4);
  return _mm256_set1_epi32(x);
}

// 32 bytes of a K row from byte 32c; a 16-byte tail (head_dim 80) is zero extended, so a row is
// never read past its end.
inline __m256i load_k32(const int8_t* row, int64_t c, bool half) {
  const int8_t* p = row + 32 * c;
  return half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
              : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// e^x for x <= 0 (and -inf): range reduction x = n ln2 + r, a degree-6 polynomial for e^r
// (relative error ~1 ulp), 2^n through the exponent bits; below -87 (e^x < 2e-38, nothing next
// to the tile maximum's e^0 = 1) the result is 0.
inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(xc, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

// tanh(x) for |x| <= FLT_MAX: odd, so computed on a = |x| and the sign put back. For a >= 0.25,
// (1 - e) / (1 + e) with e = exp(-2a) (exp_nonpos: ~1 ulp; e is 0 past a = 43.5, giving 1); below
// it, where 1 - e would cancel, the Taylor series a - a^3/3 + 2a^5/15 - 17a^7/315 + 62a^9/2835
// (first omitted term < 1.4e-8 a there). Both are within a few ulp of libm's tanhf: float
// rounding of the scores, which the tests' tolerance model allows as it does the kernels' exp.
inline __m256 tanh_ps(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 e = exp_nonpos(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
  const __m256 big = _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  const __m256 a2 = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(62.0f / 2835.0f);
  p = _mm256_add_ps(_mm256_mul_ps(p, a2), _mm256_set1_ps(-17.0f / 315.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, a2), _mm256_set1_ps(2.0f / 15.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, a2), _mm256_set1_ps(-1.0f / 3.0f));
  const __m256 small = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, a2), a), a);
  const __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.25f), _CMP_LT_OQ));
  return _mm256_or_ps(t, sign);
}

struct Avx2Kern {
  // s[i] = cap * tanh(s[i] / cap) (DESIGN.md's order: one division, tanh, one multiply).
  static void softcap(float* s, int64_t n, float cap) {
    const __m256 c = _mm256_set1_ps(cap);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(s + i, _mm256_mul_ps(c, tanh_ps(_mm256_div_ps(_mm256_loadu_ps(s + i), c))));
    for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
  }

  static void qk_s8(const int8_t* const* q, int64_t rows, const int8_t* const* k, int64_t n, int64_t d,
                    int32_t* out, int64_t ldo) {
    const int64_t nc = (d + 31) / 32;
    const bool half = d % 32 != 0;
    const __m256i ones = _mm256_set1_epi16(1);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (int64_t r = 0; r < rows; ++r) {
        __m256i acc[8];
        for (auto& a : acc) a = _mm256_setzero_si256();
        for (int64_t c = 0; c < nc; ++c) {
          const bool h = half && c == nc - 1;
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + 32 * c));
          for (int j = 0; j < 8; ++j) {
            const __m256i kv = load_k32(k[i + j], c, h);
            const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(kv), _mm256_sign_epi8(qv, kv));
            acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(prod, ones));
          }
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + i), reduce8_epi32(acc));
      }
    }
    for (; i < n; ++i) {
      for (int64_t r = 0; r < rows; ++r) {
        __m256i acc = _mm256_setzero_si256();
        for (int64_t c = 0; c < nc; ++c) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + 32 * c));
          const __m256i kv = load_k32(k[i], c, half && c == nc - 1);
          const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(kv), _mm256_sign_epi8(qv, kv));
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(prod, ones));
        }
        out[r * ldo + i] = hsum_epi32(acc);
      }
    }
  }

  // 8 int8 -> 8 float32.
  static __m256 cvt8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }

  static void qk_f32(const float* const* q, int64_t rows, const int8_t* const* k, int64_t n, int64_t d,
                     float* out, int64_t ldo) {
    alignas(32) float kf[8 * 256];
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j)
        for (int64_t c = 0; c < d; c += 8) _mm256_store_ps(kf + j * d + c, cvt8(k[i + j] + c));
      for (int64_t r = 0; r < rows; ++r) {
        __m256 acc[8];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8) {
          const __m256 qv = _mm256_loadu_ps(q[r] + c);
          for (int j = 0; j < 8; ++j)
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(qv, _mm256_load_ps(kf + j * d + c)));
        }
        _mm256_storeu_ps(out + r * ldo + i, reduce8_ps(acc));
      }
    }
    for (; i < n; ++i)
      for (int64_t r = 0; r < rows; ++r) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8)
          acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q[r] + c), cvt8(k[i] + c)));
        out[r * ldo + i] = hsum_ps(acc);
      }
  }

  static float row_max(const float* s, int64_t n) {
    float mx = s[0];
    int64_t i = 0;
    if (n >= 8) {
      __m256 v = _mm256_loadu_ps(s);
      for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + i));
      mx = hmax_ps(v);
    }
    for (; i < n; ++i) mx = mx < s[i] ? s[i] : mx;
    return mx;
  }

  static float exp_sub(float* s, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
      _mm256_storeu_ps(s + i, e);
      acc = _mm256_add_ps(acc, e);
    }
    if (i < n) {  // tail through a padded lane buffer (-inf lanes give 0)
      alignas(32) float tmp[8];
      for (int j = 0; j < 8; ++j) tmp[j] = i + j < n ? s[i + j] - m : -__builtin_inff();
      const __m256 e = exp_nonpos(_mm256_load_ps(tmp));
      _mm256_store_ps(tmp, e);
      for (int64_t j = 0; i + j < n; ++j) s[i + j] = tmp[j];
      acc = _mm256_add_ps(acc, e);
    }
    return hsum_ps(acc);
  }

  static void mul(const float* a, const float* b, float* out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (; i < n; ++i) out[i] = a[i] * b[i];
  }

  static void scale(float* y, int64_t n, float a) {
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), av));
    for (; i < n; ++i) y[i] *= a;
  }

  static float max32(const float* w) {
    const __m256 a = _mm256_max_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(w + 8));
    const __m256 b = _mm256_max_ps(_mm256_loadu_ps(w + 16), _mm256_loadu_ps(w + 24));
    return hmax_ps(_mm256_max_ps(a, b));
  }

  static void quant32(const float* w, float inv, float levels, uint8_t* codes) {
    const __m256 iv = _mm256_set1_ps(inv), lv = _mm256_set1_ps(levels);
    __m256i c[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 x = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(w + 8 * j), iv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[j] = _mm256_cvtps_epi32(_mm256_min_ps(x, lv));
    }
    // packus works per 128-bit lane; the permute restores element order.
    const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }

  // o[r][d] += gscale[r] * (int32 sum over the group of codes[r] * v[d]); rows with gscale 0
  // are skipped.
  static void pv_int(const uint8_t* codes, int64_t rows, const int8_t* v, int64_t stride, int64_t d, bool u8,
                     const float* gscale, float* o, int64_t ldo) {
    if (!u8) {  // codes 0..127: maddubs is exact
      const __m256i ones = _mm256_set1_epi16(1);
      for (int64_t d0 = 0; d0 < d; d0 += 8) {
        __m256i c[8];
        load_v_octet(v, stride, d0, c);
        for (int64_t r = 0; r < rows; ++r) {
          if (!(gscale[r] > 0.0f)) continue;
          const uint8_t* cr = codes + r * kGroup;
          __m256i acc = _mm256_setzero_si256();
          for (int k = 0; k < 8; ++k)
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(bcast_codes(cr, k), c[k]), ones));
          add_scaled(o + r * ldo + d0, gscale[r], acc);
        }
      }
      return;
    }
    // codes 0..255 must not meet maddubs whole (2 * 255 * 127 saturates int16). Split each code
    // as c = 2 * (c >> 1) + (c & 1): both halves are <= 127, so two exact maddubs passes give
    // sum c * v = 2 * sum (c >> 1) * v + sum (c & 1) * v.
    alignas(32) uint8_t split[2 * kMaxRows * kGroup];  // per row: 32 codes >> 1, then 32 codes & 1
    const int64_t nr = rows < kMaxRows ? rows : kMaxRows;
    for (int64_t r0 = 0; r0 < rows; r0 += nr) {
      const int64_t rn = rows - r0 < nr ? rows - r0 : nr;
      for (int64_t r = 0; r < rn; ++r) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (r0 + r) * kGroup));
        _mm256_store_si256(reinterpret_cast<__m256i*>(split + 2 * r * kGroup),
                           _mm256_and_si256(_mm256_srli_epi16(w, 1), _mm256_set1_epi8(0x7f)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(split + (2 * r + 1) * kGroup),
                           _mm256_and_si256(w, _mm256_set1_epi8(1)));
      }
      const __m256i ones = _mm256_set1_epi16(1), twos = _mm256_set1_epi16(2);
      for (int64_t d0 = 0; d0 < d; d0 += 8) {
        __m256i c[8];
        load_v_octet(v, stride, d0, c);
        for (int64_t r = 0; r < rn; ++r) {
          if (!(gscale[r0 + r] > 0.0f)) continue;
          const uint8_t* hi = split + 2 * r * kGroup;
          const uint8_t* lo = hi + kGroup;
          __m256i acc = _mm256_setzero_si256();
          for (int k = 0; k < 8; ++k) {
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(bcast_codes(hi, k), c[k]), twos));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(bcast_codes(lo, k), c[k]), ones));
          }
          add_scaled(o + (r0 + r) * ldo + d0, gscale[r0 + r], acc);
        }
      }
    }
  }

  static void pv_f32(const float* w, int64_t ldw, int64_t rows, const int8_t* v, int64_t stride, int64_t d,
                     float* o, int64_t ldo) {
    alignas(32) float vf[256 * kGroup];
    for (int64_t dd = 0; dd < d; ++dd)
      for (int j = 0; j < 4; ++j) _mm256_store_ps(vf + dd * kGroup + 8 * j, cvt8(v + dd * stride + 8 * j));
    for (int64_t r = 0; r < rows; ++r) {
      const float* wr = w + r * ldw;
      const __m256 w0 = _mm256_loadu_ps(wr), w1 = _mm256_loadu_ps(wr + 8);
      const __m256 w2 = _mm256_loadu_ps(wr + 16), w3 = _mm256_loadu_ps(wr + 24);
      for (int64_t d0 = 0; d0 < d; d0 += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) {
          const float* row = vf + (d0 + j) * kGroup;
          acc[j] = _mm256_add_ps(
              _mm256_add_ps(_mm256_mul_ps(w0, _mm256_load_ps(row)), _mm256_mul_ps(w1, _mm256_load_ps(row + 8))),
              _mm256_add_ps(_mm256_mul_ps(w2, _mm256_load_ps(row + 16)), _mm256_mul_ps(w3, _mm256_load_ps(row + 24))));
        }
        float* od = o + r * ldo + d0;
        _mm256_storeu_ps(od, _mm256_add_ps(_mm256_loadu_ps(od), reduce8_ps(acc)));
      }
    }
  }
};

}  // namespace
}  // namespace ort_ops::paged_attention_int8
