// SPDX-License-Identifier: MIT
// Portable primitives of the PagedAttentionInt8 driver: the readable C++ oracle of the SIMD
// variants (same integer results; float results equal up to rounding).
#include <algorithm>
#include <cmath>

#include "ops/paged_attention_int8/cpu_driver.h"

namespace ort_ops::paged_attention_int8 {
namespace {

struct ScalarKern {
  // out[r * ldo + i] = sum_d q[r][d] * k[i][d]  (int32; |sum| <= 256 * 127 * 127)
  static void qk_s8(const int8_t* const* q, int64_t rows, const int8_t* const* k, int64_t n, int64_t d,
                    int32_t* out, int64_t ldo) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) {
        int32_t acc = 0;
        for (int64_t j = 0; j < d; ++j) acc += int32_t{q[r][j]} * int32_t{k[i][j]};
        out[r * ldo + i] = acc;
      }
  }
  static void qk_f32(const float* const* q, int64_t rows, const int8_t* const* k, int64_t n, int64_t d,
                     float* out, int64_t ldo) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) {
        float acc = 0.0f;
        for (int64_t j = 0; j < d; ++j) acc += q[r][j] * static_cast<float>(k[i][j]);
        out[r * ldo + i] = acc;
      }
  }
  // s[i] = cap * tanh(s[i] / cap) (DESIGN.md's order: one division, tanh, one multiply).
  static void softcap(float* s, int64_t n, float cap) {
    for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
  }
  static float row_max(const float* s, int64_t n) {
    float mx = s[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, s[i]);
    return mx;
  }
  // s[i] = exp(s[i] - m); returns the sum.
  static float exp_sub(float* s, int64_t n, float m) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - m);
      sum += s[i];
    }
    return sum;
  }
  static void mul(const float* a, const float* b, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
  }
  static void scale(float* y, int64_t n, float a) {
    for (int64_t i = 0; i < n; ++i) y[i] *= a;
  }
  static float max32(const float* w) { return *std::max_element(w, w + kGroup); }
  // codes = min(rint(w * inv), levels); w >= 0, so codes are 0 .. levels.
  static void quant32(const float* w, float inv, float levels, uint8_t* codes) {
    for (int64_t i = 0; i < kGroup; ++i)
      codes[i] = static_cast<uint8_t>(std::min(std::nearbyint(w[i] * inv), levels));
  }
  // o[r * ldo + dd] += gscale[r] * isum, isum = sum_i codes[r][i] * v[dd * stride + i] (int32)
  // over the 32 tokens of a group; rows with gscale 0 (no visible key in the group) are skipped.
  static void pv_int(const uint8_t* codes, int64_t rows, const int8_t* v, int64_t stride, int64_t d,
                     bool /*u8*/, const float* gscale, float* o, int64_t ldo) {
    for (int64_t r = 0; r < rows; ++r) {
      if (!(gscale[r] > 0.0f)) continue;
      for (int64_t dd = 0; dd < d; ++dd) {
        int32_t acc = 0;
        for (int64_t i = 0; i < kGroup; ++i)
          acc += int32_t{codes[r * kGroup + i]} * int32_t{v[dd * stride + i]};
        o[r * ldo + dd] += gscale[r] * static_cast<float>(acc);
      }
    }
  }
  // o[r * ldo + dd] += sum_i w[r * ldw + i] * v[dd * stride + i].
  static void pv_f32(const float* w, int64_t ldw, int64_t rows, const int8_t* v, int64_t stride, int64_t d,
                     float* o, int64_t ldo) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t dd = 0; dd < d; ++dd) {
        float acc = 0.0f;
        for (int64_t i = 0; i < kGroup; ++i) acc += w[r * ldw + i] * static_cast<float>(v[dd * stride + i]);
        o[r * ldo + dd] += acc;
      }
  }
};

}  // namespace

void run_task_scalar(const Params& p, const Task& t, const Scratch& s) {
  run_task_impl<ScalarKern>(p, t, s);
}

}  // namespace ort_ops::paged_attention_int8
