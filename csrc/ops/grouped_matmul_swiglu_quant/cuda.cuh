// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant on NVIDIA INT8 tensor cores (mma.sync m16n8k32 s8.s8.s32, sm_80+):
// the launcher prototype on raw device pointers (no ORT headers). Spec: ort_ops/ops/_moe.py
// and ort_ops/ops/grouped_matmul_swiglu_quant.py (reference).
//
// Alphabet: M rows, K reduction, N GEMM columns (N/2 outputs), E experts.
//   x        int8    [M, K]          row-major
//   weight   int8    [E, K, N]       row-major (the contract's layout; transposed in registers),
//                                    or [E, N, K] with weight_layout 2 (launch_gmsq only)
//   w_scale  float32 [E, N]
//   x_scale  float32 [M]
//   group_list int64 [E]             device memory; cumulative ends (type 0) or counts (type 1)
//   bias     float32 [E, N]          optional (nullptr: none): C = ((acc * xs) * ws) + bias
//   y        int8    [M, N/2], y_scale float32 [M], y_offset float32 [M] (zeros)
// activation (GroupedMatmulSwigluQuant): kGmsqActSwiglu S = (A / (1 + exp_f32(-A))) * G, or
// kGmsqActSwigluOai (gpt-oss): a = min(A, limit), g = min(max(G, -limit), limit),
// S = (g + 1) * (a / (1 + exp_f32(-(alpha * a)))); the host checks alpha finite, limit > 0.
//
// Requirements (checked by the launcher, cudaErrorInvalidValue otherwise; op.cc refuses them
// first with a message): K % 16 == 0 and N % 32 == 0 (16-byte cp.async rows; the SwiGLU up
// half starts at N/2), K <= 131071 (exact int32), M < 2^31, E <= kGmsqMaxExperts.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ort_ops::gmsq_cuda {

constexpr int kGmsqMaxExperts = 1024;

// Bits of the error word (GmsqParams::err): the kernel never reads or writes out of bounds;
// it clamps, finishes and reports, and the caller turns a non-zero word into an error.
constexpr int kErrGroupList = 1;  // group_list decreasing, negative or ending past M
constexpr int kErrNonFinite = 2;  // a dequantized C or S was NaN or Inf (no INT8 code)

// GmsqParams::activation: grouped_matmul::Activation's values (ops/grouped_matmul/activation.h).
constexpr int kGmsqActSwiglu = 0;
constexpr int kGmsqActSwigluOai = 1;

// Tile configurations (rows per tile BM x output columns per tile); the launcher picks one
// from M / E unless `config` >= 0 forces it (benchmarks and tests).
enum GmsqConfig : int {
  kGmsqAuto = -1,
  kGmsqBm16 = 0,       // 16 x 64, k split over 2 warp sets: weight streaming (decode)
  kGmsqBm64 = 1,       // 64 x 128
  kGmsqBm128 = 2,      // 128 x 128: GEMM-bound (prefill)
  kGmsqBm16Wide = 3,   // 16 x 128, no k split
  kGmsqBm32 = 4,       // 32 x 64, k split
  kGmsqStream = 5,     // decode: balanced weight stream + epilogue kernel (cuda_stream.cuh), layouts 0 and 2
  kGmsqNumConfigs = 6
};

struct GmsqParams {
  const int8_t* x;
  const int8_t* weight;
  const float* w_scale;
  const float* x_scale;
  const int64_t* group_list;
  int8_t* y;
  float* y_scale;
  float* y_offset;
  void* workspace;  // gmsq_workspace_bytes(m, n, e) bytes of device memory, any content
  int64_t m, k, n, e;
  int group_list_type;
  int config;  // GmsqConfig
  float* y_float = nullptr;  // GroupedMatmulDequant's y [M, N] (launch_gmd only)
  // 0: weight [E, K, N] (the contract). 1: packed per 128-column tile, [E, C, K, 256] with
  // C = ceil(N/2 / 128) and row k of tile c = W[k, 128c .. +128) | W[k, N/2 + 128c .. +128),
  // zero-padded past N/2 (ort_ops.testing.moe_launchers.pack_weight). Configs bm16w, bm64, bm128 only.
  // 2: [E, N, K] (K-major; launch_gmsq only): config bm128 is the Hopper wgmma kernel
  // (cuda_wgmma.cuh), bm16 / bm16w / bm32 / bm64 this kernel with ldmatrix B reads, stream the
  // K-major weight stream (cuda_stream.cuh); auto picks the stream up to 4 rows an expert on
  // average, bm16w below 32, wgmma from 32 on (off Hopper: the layout-0 rule with bm64 for bm128).
  int weight_layout = 0;
  // Where the kernels OR their error bits: the op's mapped status word (cuda/device_status.h),
  // never cleared by a launch. nullptr: the workspace's first int, zeroed by each launch (the C
  // entries below, for tests that read it back with gmsq_error_word).
  int* err = nullptr;
  const float* bias = nullptr;  // [E, N] float32 device memory, or nullptr (no bias)
  int activation = kGmsqActSwiglu;  // launch_gmsq only
  float alpha = 1.702f;             // kGmsqActSwigluOai only
  float limit = 7.0f;
};
constexpr int kGmsqPackedCols = 128;
constexpr int kGmsqLayoutKMajor = 2;  // GmsqParams::weight_layout [E, N, K]

// Device scratch the launchers need: the error word, the row amax and the per-tile counters of
// the tiled kernels, or the stream kernel's int32 sums where that shape is eligible (the larger).
size_t gmsq_workspace_bytes(int64_t m, int64_t n, int64_t e);

// Enqueues the whole op on `stream` (tiled: one memset, one cooperative kernel; stream: two
// kernels). Returns the launch
// status; the error bits are in p.err (or gmsq_error_word(workspace)) once the stream reaches them.
cudaError_t launch_gmsq(const GmsqParams& p, cudaStream_t stream);
// GroupedMatmulDequant (the down projection) on the same tiles: y_float [M, N] float32 =
// (float32(acc) * x_scale) * w_scale (+ bias), zeros past the last group end; y, y_scale,
// y_offset are unused. Same requirements, workspace and error word (kErrNonFinite is never set:
// Inf is a valid float output there).
cudaError_t launch_gmd(const GmsqParams& p, cudaStream_t stream);
inline int* gmsq_error_word(void* workspace) { return static_cast<int*>(workspace); }

// float16 scales (bits) -> float32 on `stream` (exact: every float16 is a float32).
cudaError_t launch_half_to_float(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream);

}  // namespace ort_ops::gmsq_cuda

// Plain C entry for tests and benchmarks (ctypes, torch tensors): the arguments of GmsqParams in
// order (weight_layout, then bias, activation, alpha, limit), then the stream. Returns a
// cudaError_t value.
extern "C" int ort_ops_gmsq_cuda(const int8_t* x, const int8_t* weight, const float* w_scale,
                                 const float* x_scale, const int64_t* group_list, int8_t* y,
                                 float* y_scale, float* y_offset, void* workspace, int64_t m,
                                 int64_t k, int64_t n, int64_t e, int group_list_type, int config,
                                 int weight_layout, const float* bias, int activation, float alpha,
                                 float limit, void* stream);
extern "C" size_t ort_ops_gmsq_cuda_workspace_bytes(int64_t m, int64_t n, int64_t e);
// GroupedMatmulDequant: x, weight, w_scale, x_scale, group_list, y float32 [M, N], workspace,
// ..., weight_layout, bias (nullptr: none), stream.
extern "C" int ort_ops_gmd_cuda(const int8_t* x, const int8_t* weight, const float* w_scale,
                                const float* x_scale, const int64_t* group_list, float* y,
                                void* workspace, int64_t m, int64_t k, int64_t n, int64_t e,
                                int group_list_type, int config, int weight_layout,
                                const float* bias, void* stream);
