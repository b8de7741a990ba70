// SPDX-License-Identifier: MIT
// VNNI primitives: Avx2Kern with the two integer dot products on VPDPBUSD (u8 x s8 -> int32,
// four products summed straight into int32: no 16-bit intermediate, so nothing can saturate).
// Included by cpu_avxvnni.cc (VEX encoding) and cpu_avx512vnni.cc (EVEX, 256-bit), each
// defining ORT_OPS_DPBUSD(acc, u8, s8) first.
//
// Q.K: VPDPBUSD wants one unsigned operand; q + 128 (q ^ 0x80) is, and
//   sum (q + 128) * k = q . k + 128 * sum k,
// where sum k comes from one more VPDPBUSD by ones per K chunk, shared by all rows of the task.
// P.V: W codes (0..127 or 0..255) are already unsigned.
#pragma once

#include "ops/paged_attention_int8/cpu_avx2_kern.h"

#ifndef ORT_OPS_DPBUSD
#error "define ORT_OPS_DPBUSD before including cpu_vnni_kern.h"
#endif

namespace ort_ops::paged_attention_int8 {
namespace {

struct VnniKern : Avx2Kern {
  static void qk_s8(const int8_t* const* q, int64_t rows, const int8_t* const* k, int64_t n, int64_t d,
                    int32_t* out, int64_t ldo) {
    const int64_t nc = (d + 31) / 32;
    const bool half = d % 32 != 0;
    const __m256i ones = _mm256_set1_epi8(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256i kv[8][8];  // up to 8 chunks of 8 tokens (head_dim 256)
      __m256i ks[8];
      for (int j = 0; j < 8; ++j) {
        ks[j] = _mm256_setzero_si256();
        for (int64_t c = 0; c < nc; ++c) {
          kv[c][j] = load_k32(k[i + j], c, half && c == nc - 1);
          ks[j] = ORT_OPS_DPBUSD(ks[j], ones, kv[c][j]);
        }
      }
      const __m256i corr = _mm256_slli_epi32(reduce8_epi32(ks), 7);  // 128 * sum k per token
      for (int64_t r = 0; r < rows; ++r) {
        __m256i acc[8];
        for (auto& a : acc) a = _mm256_setzero_si256();
        for (int64_t c = 0; c < nc; ++c) {
          const __m256i qu =
              _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + 32 * c)), flip);
          for (int j = 0; j < 8; ++j) acc[j] = ORT_OPS_DPBUSD(acc[j], qu, kv[c][j]);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + i),
                            _mm256_sub_epi32(reduce8_epi32(acc), corr));
      }
    }
    if (i < n) Avx2Kern::qk_s8(q, rows, k + i, n - i, d, out + i, ldo);
  }

  static void pv_int(const uint8_t* codes, int64_t rows, const int8_t* v, int64_t stride, int64_t d, bool /*u8*/,
                     const float* gscale, float* o, int64_t ldo) {
    for (int64_t d0 = 0; d0 < d; d0 += 8) {
      __m256i c[8];
      load_v_octet(v, stride, d0, c);
      for (int64_t r = 0; r < rows; ++r) {
        if (!(gscale[r] > 0.0f)) continue;
        const uint8_t* cr = codes + r * kGroup;
        __m256i acc = _mm256_setzero_si256();
        for (int k = 0; k < 8; ++k) acc = ORT_OPS_DPBUSD(acc, bcast_codes(cr, k), c[k]);
        add_scaled(o + r * ldo + d0, gscale[r], acc);
      }
    }
  }
};

}  // namespace
}  // namespace ort_ops::paged_attention_int8
