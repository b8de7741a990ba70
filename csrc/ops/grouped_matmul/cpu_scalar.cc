// SPDX-License-Identifier: MIT
// Portable grouped GEMM tile (the C++ oracle for the SIMD variants), the x-row preparation the
// SIMD tiles read, and the ISA choice.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/grouped_matmul/cpu.h"
#include "ops/grouped_matmul/exp_f32.h"

namespace ort_ops::grouped_matmul {

float swiglu_scalar(float a, float g) {
  const float e = exp_f32_scalar(-a);
  const float d = 1.0f + e;
  const float s = a / d;
  return s * g;
}

bool tile_scalar(const TileArgs& a, int64_t* bad_row) {
  const bool swiglu = a.mode == Mode::kSwiglu;
  const int64_t seg_cols[2] = {a.col0, a.n / 2 + a.col0};
  const int nseg = swiglu ? 2 : 1;
  int32_t acc[2][kTileCols];
  float c[2][kTileCols];
  for (int64_t r = 0; r < a.rows; ++r) {
    std::memset(acc, 0, sizeof(acc));
    const int8_t* xr = a.x + r * a.k;
    for (int64_t k = 0; k < a.k; ++k) {
      const int32_t xv = xr[k];
      if (xv == 0) continue;
      const int8_t* wrow = a.w + k * a.n;
      for (int s = 0; s < nseg; ++s)
        for (int64_t j = 0; j < a.width; ++j) acc[s][j] += xv * int32_t{wrow[seg_cols[s] + j]};
    }
    const float xs = a.x_scale[r];
    for (int s = 0; s < nseg; ++s)
      for (int64_t j = 0; j < a.width; ++j)
        c[s][j] = (static_cast<float>(acc[s][j]) * xs) * a.w_scale[seg_cols[s] + j];
    float* out = a.out + r * a.ldo;
    if (!swiglu) {
      std::copy(c[0], c[0] + a.width, out);
      continue;
    }
    for (int64_t j = 0; j < a.width; ++j) {
      if (!std::isfinite(c[0][j]) || !std::isfinite(c[1][j])) {
        *bad_row = r;
        return false;
      }
      out[j] = swiglu_scalar(c[0][j], c[1][j]);
    }
  }
  return true;
}

int64_t prep_stride_int16(int64_t k) { return ((k + 1) / 2) * 4; }
int64_t prep_stride_quads(int64_t k) { return ((k + 3) / 4) * 4; }

// AVX2 rows: int16 values, zero-padded to an even count (a 4-byte broadcast is one k pair).
void prep_int16_pairs(const int8_t* x, int64_t rows, int64_t k, uint8_t* out, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* o = reinterpret_cast<int16_t*>(out + r * stride);
    const int8_t* xr = x + r * k;
    for (int64_t i = 0; i < k; ++i) o[i] = xr[i];
    for (int64_t i = k; i < stride / 2; ++i) o[i] = 0;
  }
}

// VNNI rows: x + 128 as uint8 (VPDPBUSD multiplies unsigned by signed bytes; the tile subtracts
// 128 * column sum), padded with 128 (x = 0) to a multiple of 4. The padded weights are zero,
// so the pad contributes nothing either way.
void prep_u8_quads(const int8_t* x, int64_t rows, int64_t k, uint8_t* out, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* o = out + r * stride;
    const int8_t* xr = x + r * k;
    for (int64_t i = 0; i < k; ++i) o[i] = static_cast<uint8_t>(xr[i]) ^ 0x80u;
    for (int64_t i = k; i < stride; ++i) o[i] = 0x80u;
  }
}

Kernels kernels_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Vnni:
      return {tile_avx512vnni, prep_u8_quads, prep_stride_quads, gemv_partial_avx512vnni, gemv_finish_avx512vnni, 64};
    case CpuIsa::kAvxVnni:
      return {tile_avxvnni, prep_u8_quads, prep_stride_quads, gemv_partial_avxvnni, gemv_finish_avxvnni, 32};
    case CpuIsa::kAvx2:
      return {tile_avx2, prep_int16_pairs, prep_stride_int16, gemv_partial_avx2, gemv_finish_avx2, 32};
    default: return {tile_scalar, nullptr, nullptr};
  }
}

}  // namespace ort_ops::grouped_matmul
