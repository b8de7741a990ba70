// SPDX-License-Identifier: MIT
// The grouped INT8 GEMM core that GroupedMatmulSwigluQuant and GroupedMatmulDequant share on the
// CPU. Spec: ort_ops/ops/_moe.py (the exact float32 recipe) and the two ops' references.
//
// Alphabet: M rows, K reduction dim, N weight columns, E experts.
// Work unit ("tile"): the rows [0, rows) of one expert times 512 packed weight columns. A tile
// packs its columns of W_e [K, N] (the contract's layout, no pre-packed weights) into a
// thread-local buffer laid out for the ISA's dot-product instruction, then runs every row of
// the expert over it, so W is read from memory once per Run whatever the row count.
//   dequant mode: one segment of up to 512 columns [n0, n0 + width) -> y[r, n0 ...]
//   SwiGLU mode:  two segments of up to 256 columns, A = [h0, h0 + width) and
//                 G = [N/2 + h0, ...) -> S[r, h0 ...] = swiglu(A, G) (float32, quantized later)
// Experts of at most kGemvRows rows are memory-bound and take another route (GemvArgs): tasks
// over blocks of kGemvBlockK weight rows sweep whole rows in order (sequential reads, no tile
// buffer) into int32 partial sums, and gemv_finish adds the blocks and runs the same epilogue.
//
// Exactness: int32 accumulation is exact for K <= kMaxK even with -128 codes in x and W (every
// product is <= 2^14 in size; SIMD paths that wrap modulo 2^32 mid-way still end exact because
// the true sum fits). float32 epilogue: C = (float(acc) * x_scale[r]) * w_scale[n], then
// + bias[n] when there is a bias (in natural column order, after packed columns are put back),
// then the activation (activation.h) by _moe.py's recipe; every variant does the same
// operations, so results match bit for bit.
#pragma once

#include <cstdint>

#include "common/cpu_features.h"
#include "ops/grouped_matmul/activation.h"

namespace ort_ops::grouped_matmul {

constexpr int64_t kMaxK = 131071;
constexpr int64_t kTileCols = 512;  // packed columns per tile (8 cache lines of a W row per visit)
constexpr int64_t kHalfCols = 256;  // SwiGLU: columns of A (and of G) per tile

enum class Mode : int { kDequant = 0, kSwiglu = 1 };

struct TileArgs {
  Mode mode;
  const int8_t* x;        // first row of the expert, [rows, k] row-major
  const uint8_t* xprep;   // the same rows prepared by prep_rows (nullptr for the scalar path)
  int64_t xprep_stride;   // bytes between prepared rows
  int64_t rows, k, n;     // n: columns of W (ldw)
  const int8_t* w;        // W_e [k, n], or [ceil(n/16), k/4, 16, 4] when quads (panels only)
  bool quads = false;     // "EN16K4": w[((col / 16 * k / 4 + k / 4) * 16 + col % 16) * 4 + k % 4]
  const float* x_scale;   // [rows]
  const float* w_scale;   // [n] of this expert
  int64_t col0;           // dequant: first column; SwiGLU: first column of A (G at n/2 + col0)
  int64_t width;          // columns of the segment (<= 512 dequant, <= 256 SwiGLU)
  float* out;             // dequant: y + col0 of the first row; SwiGLU: S + col0
  int64_t ldo;            // floats between output rows
  const float* bias = nullptr;  // [n] of this expert, or nullptr (no bias)
  Act act;                // SwiGLU mode's activation
};

// Few-row experts (rows <= kGemvRows): partial int32 sums of the rows over weight rows [k0, k1)
// (a multiple of 4 apart), all columns, in the ISA's packed column order; n_pad = n rounded up
// to the ISA's packing group (kGemvMaxGroup at most).
constexpr int64_t kGemvRows = 6;  // measured (1 thread, AVX-512 VNNI): the tiles catch up at about 8 rows
constexpr int64_t kGemvMaxGroup = 64;
constexpr int64_t kGemvBlockK = 256;  // k rows per partial-sum task
struct GemvArgs {
  const uint8_t* xprep;  // prepared rows of the expert
  int64_t xprep_stride;
  int64_t rows, k, n, k0, k1;
  const int8_t* w;       // W_e [k, n]
  int32_t* acc;          // [rows][n_pad]
  int32_t* colsum;       // [n_pad] (VNNI's x + 128 correction; untouched otherwise)
};
struct GemvFinishArgs {
  Mode mode;
  const int32_t* partials;  // nparts blocks, part_stride ints apart, each [rows][n_pad]
  const int32_t* colsums;   // nparts blocks of [n_pad], part_stride ints apart
  int64_t nparts, part_stride, rows, n;
  const float* x_scale;     // [rows]
  const float* w_scale;     // [n]
  float* out;               // dequant: y rows [n]; SwiGLU: S rows [n / 2]
  int64_t ldo;
  const float* bias = nullptr;  // [n], or nullptr
  Act act;
};
using GemvPartialFn = void (*)(const GemvArgs& g);
using GemvFinishFn = bool (*)(const GemvFinishArgs& f, int64_t* bad_row);

// Returns false if a dequantized C value of a SwiGLU tile was NaN or Inf (row in *bad_row).
using TileFn = bool (*)(const TileArgs& a, int64_t* bad_row);
// Prepares x rows for the ISA (int16 pairs for AVX2, x ^ 0x80 quads for VNNI), zero-padded.
using PrepFn = void (*)(const int8_t* x, int64_t rows, int64_t k, uint8_t* out, int64_t stride);

struct Kernels {
  TileFn tile;
  PrepFn prep;               // nullptr: the tile reads x directly
  int64_t (*prep_stride)(int64_t k);
  GemvPartialFn gemv_partial = nullptr;  // nullptr: every expert goes through tiles
  GemvFinishFn gemv_finish = nullptr;
  int64_t gemv_group = 0;
  int64_t prep_pad_rows = 0;  // rows the tile may read past the last prepared one (zeroed)
  int64_t gemv_rows = kGemvRows;  // experts of at most this many rows take the few-row path
  // Panels (nullptr: none): experts of gemv_rows < rows <= panel_rows run as one task per
  // column part over all of K: TileArgs with col0/width the part's columns (SwiGLU: of A, G
  // at n/2 + col0; col0 a multiple of 64), any width.
  TileFn panel = nullptr;
  int64_t panel_rows = 0;
};

bool tile_scalar(const TileArgs& a, int64_t* bad_row);
bool tile_avx2(const TileArgs& a, int64_t* bad_row);
bool tile_avxvnni(const TileArgs& a, int64_t* bad_row);
bool tile_avx512vnni(const TileArgs& a, int64_t* bad_row);
// AMX (TDPBUSD on 16 x 64-byte tiles) over the AVX-512 VNNI packed tile; needs prep_u8_quads64
// rows (k padded to 64) and kAmxPadRows readable rows past the last one.
bool tile_amx(const TileArgs& a, int64_t* bad_row);
constexpr int64_t kAmxPadRows = 32;
// AMX panel: the weight rows of an expert are read in order, kPanelK at a time, every column of
// the part packed from 4 rows swept left to right (sequential streams the hardware prefetchers
// follow, unlike a tile's short strided segments); the int32 sums of all the rows stay in a
// thread buffer ([rows][columns], rows <= kAmxPanelRows) between slabs.
bool panel_amx(const TileArgs& a, int64_t* bad_row);
constexpr int64_t kAmxPanelRows = 128;  // measured: panels beat the tiles up to 128 rows (1 thread)
constexpr int64_t kPanelK = 256;
// True when the CPU has AMX-TILE and AMX-INT8, the OS enables the tile state (XCR0) and lets
// this process use it (Linux arch_prctl ARCH_REQ_XCOMP_PERM); asked once per process.
// ORT_OPS_CPU_AMX=0 turns AMX off (read each time a kernel is created, like ORT_OPS_CPU_ISA).
bool amx_usable();
#define ORT_OPS_GEMV_DECL(isa)                \
  void gemv_partial_##isa(const GemvArgs& g); \
  bool gemv_finish_##isa(const GemvFinishArgs& f, int64_t* bad_row);
ORT_OPS_GEMV_DECL(avx2)
ORT_OPS_GEMV_DECL(avxvnni)
ORT_OPS_GEMV_DECL(avx512vnni)
#undef ORT_OPS_GEMV_DECL
void prep_int16_pairs(const int8_t* x, int64_t rows, int64_t k, uint8_t* out, int64_t stride);
void prep_u8_quads(const int8_t* x, int64_t rows, int64_t k, uint8_t* out, int64_t stride);
int64_t prep_stride_int16(int64_t k);
int64_t prep_stride_quads(int64_t k);
int64_t prep_stride_quads64(int64_t k);  // k rounded up to 64 (one AMX tile row per 64 k)

Kernels kernels_for(CpuIsa isa);

// The scalar float32 recipe, shared with the SIMD tails: S = (a / (1 + exp_f32(-a))) * g.
float swiglu_scalar(float a, float g);
// gpt-oss's clamped SwiGLU (activation.h), the same operations in the same order.
float swiglu_oai_scalar(float a, float g, float alpha, float limit);
// S of `act` for one (A, G) pair.
inline float activation_scalar(const Act& act, float a, float g) {
  return act.kind == Activation::kSwigluOai ? swiglu_oai_scalar(a, g, act.alpha, act.limit)
                                            : swiglu_scalar(a, g);
}

}  // namespace ort_ops::grouped_matmul
