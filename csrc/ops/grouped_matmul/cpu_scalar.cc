// SPDX-License-Identifier: MIT
// Portable grouped GEMM tile (the C++ oracle for the SIMD variants), the x-row preparation the
// SIMD tiles read, and the ISA choice.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/grouped_matmul/cpu.h"
#include "ops/grouped_matmul/exp_f32.h"

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cstdlib>

namespace ort_ops::grouped_matmul {

float swiglu_scalar(float a, float g) {
  const float e = exp_f32_scalar(-a);
  const float d = 1.0f + e;
  const float s = a / d;
  return s * g;
}

float swiglu_oai_scalar(float a, float g, float alpha, float limit) {
  a = std::fmin(a, limit);
  g = std::fmin(std::fmax(g, -limit), limit);
  const float e = exp_f32_scalar(-(alpha * a));
  const float d = 1.0f + e;
  const float s = a / d;
  return (g + 1.0f) * s;
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
    if (a.bias != nullptr)
      for (int s = 0; s < nseg; ++s)
        for (int64_t j = 0; j < a.width; ++j) c[s][j] = c[s][j] + a.bias[seg_cols[s] + j];
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
      out[j] = activation_scalar(a.act, c[0][j], c[1][j]);
    }
  }
  return true;
}

int64_t prep_stride_int16(int64_t k) { return ((k + 1) / 2) * 4; }
int64_t prep_stride_quads(int64_t k) { return ((k + 3) / 4) * 4; }
int64_t prep_stride_quads64(int64_t k) { return ((k + 63) / 64) * 64; }

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

bool amx_usable() {
  static const bool usable = [] {
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
    if (!cpu_features().avx512_vnni || __get_cpuid_max(0, nullptr) < 7) return false;
    unsigned a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    const bool tile = d & (1u << 24), int8 = d & (1u << 25);
    if (!tile || !int8) return false;
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA state
    // Linux hands out the 8 KB tile state only on request, once for the whole process.
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

Kernels kernels_for(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Vnni:
      if (amx_usable()) {
        const char* env = std::getenv("ORT_OPS_CPU_AMX");
        if (env == nullptr || std::strcmp(env, "0") != 0) {
          Kernels k{tile_amx, prep_u8_quads, prep_stride_quads64, gemv_partial_avx512vnni, gemv_finish_avx512vnni, 64};
          k.prep_pad_rows = kAmxPadRows;
          // With AMX the tiles' arithmetic is nearly free and only their packing reads remain:
          // they beat the few-row path from 3 rows an expert (1 thread, 2 MB weight pages).
          k.gemv_rows = 2;
          k.panel = panel_amx;
          k.panel_rows = kAmxPanelRows;
          return k;
        }
      }
      return {tile_avx512vnni, prep_u8_quads, prep_stride_quads, gemv_partial_avx512vnni, gemv_finish_avx512vnni, 64};
    case CpuIsa::kAvxVnni:
      return {tile_avxvnni, prep_u8_quads, prep_stride_quads, gemv_partial_avxvnni, gemv_finish_avxvnni, 32};
    case CpuIsa::kAvx2:
      return {tile_avx2, prep_int16_pairs, prep_stride_int16, gemv_partial_avx2, gemv_finish_avx2, 32};
    default: return {tile_scalar, nullptr, nullptr};
  }
}

}  // namespace ort_ops::grouped_matmul
