// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant CUDA kernel: one fused grouped INT8 GEMM on tensor cores
// (mma.sync m16n8k32 s8.s8.s32) whose epilogue dequantizes, applies SwiGLU and quantizes each
// output row to INT8, with no float intermediate in device memory. Spec: ort_ops/ops/_moe.py.
//
// Tiling. A tile is BM rows of one expert x 128 output columns, i.e. 128 gate (A) columns and
// the matching 128 up (G) columns of the GEMM, so SwiGLU pairs sit in one thread's registers.
// The row max for the per-row quantization needs all N/2 outputs of a row, which no single
// tile holds (N/2 = 1408 would need BM x 2816 int32 accumulators). So the kernel is a
// persistent cooperative grid: the C = ceil(N/2 / 128) column tiles of one row block run at
// the same time on C co-resident CTAs; each CTA keeps its S tile in registers, publishes its
// partial row max with atomicMax (float bits, S >= 0 after fabs), arrives on the row block's
// counter and waits for the C arrivals, then reads the final max and writes its codes. Peers
// of a row block always come from the same "slot group" of C CTAs that walks the same row
// blocks in the same order, and the cooperative launch guarantees they are co-resident, so the
// wait cannot deadlock. Thread-block clusters (DSMEM) were the alternative; they cap the group
// at 8 (16 non-portable) CTAs, and 1408 / 8 columns per CTA do not fit in registers at BM 128.
//
// Row blocks are laid out expert by expert from group_list on the device (no host round
// trip): expert e owns ceil(rows_e / BM) row blocks, so an empty expert costs nothing.
//
// B operand. The contract's weight layout [E, K, N] has N innermost, but the INT8 MMA wants
// each B register to hold 4 consecutive k of one column. A lane reads four 32-bit words (k
// rows 4t..4t+3, columns 4g..4g+3) and transposes the 4x4 bytes with 8 PRMTs; the four
// results are the B registers of four n8 tiles whose "column g" is physical column 4g + i.
// Relabelling columns this way is free: in the accumulators, lane (g, t) then holds physical
// columns 8t..8t+7 of rows g and g+8, so the epilogue stores 8 contiguous codes per row.
// weight_layout 2 ([E, N, K], template flag KM) needs no transpose: B registers come from
// ldmatrix on a [column][k] tile whose rows are permuted to give the same relabelling (see
// the note above gmsq_kernel), so the epilogue is shared unchanged.
//
// Exactness: every float32 operation of the reference is done with an explicit _rn intrinsic
// in the reference's order (no FMA contraction), including the contract's polynomial exp.
#include "ops/grouped_matmul_swiglu_quant/cuda.cuh"
#include "ops/grouped_matmul_swiglu_quant/cuda_stream.cuh"
#include "ops/grouped_matmul_swiglu_quant/cuda_wgmma.cuh"
#include "ops/grouped_matmul_swiglu_quant/epilogue.cuh"
#include "ops/grouped_matmul_swiglu_quant/mma_sync.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>

#include "cuda/export.h"

namespace ort_ops::gmsq_cuda {
namespace {

constexpr int kBK = 64;                       // k per pipeline stage: two m16n8k32 steps
constexpr int kOutPerWarp = 32;               // output columns per warp (one transposed quad)
constexpr int kMaxK = 131071;                 // K * 128 * 128 < 2^31: exact int32

// The contract's exact float32 epilogue math and the tile map: epilogue.cuh, shared with the
// wgmma kernel (cuda_wgmma.cu).
using epi::quant_code;
using epi::activation_f32;
using epi::plus_bias;
using namespace mma;  // cp.async, ldmatrix, the s8 MMA, B transposes (mma_sync.cuh)

// ---- the kernel's steps ---------------------------------------------------------------------

// WARPS_M x WARPS_N warps own a BM x BNh output tile (each warp MT m16 tiles x 32 columns);
// KSPLIT = 2 doubles the warps, each pair splitting every 64-deep k step into its two k32
// halves (more warps in flight when BM is small), summed through shared memory at the end.
template <int WARPS_M, int WARPS_N, int MT, int STAGES, int KSPLIT>
struct Cfg {
  static_assert(WARPS_N >= 2, "the B swizzle (chunk ^ 2t) needs >= 8 chunks per k row");
  static_assert(KSPLIT == 1 || KSPLIT == 2, "KSPLIT is 1 or 2 (the two k32 halves of a step)");
  static constexpr int kWarpsN = WARPS_N;
  static constexpr int kMT = MT;
  static constexpr int kStages = STAGES;
  static constexpr int kKSplit = KSPLIT;
  static constexpr int kWarpsMN = WARPS_M * WARPS_N;
  static constexpr int kWarps = kWarpsMN * KSPLIT;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBM = WARPS_M * MT * 16;
  static constexpr int kBNh = WARPS_N * kOutPerWarp;  // output columns per tile
  static constexpr int kBRow = 2 * kBNh;              // bytes per k row of the B tile (gate | up)
  static constexpr int kChunks = kBRow / 16;          // 16-byte chunks per B-tile row
  static constexpr int kAPer = (kBM * 4 + kThreads - 1) / kThreads;  // A chunks per thread
  static constexpr int kBPer = kBK * kChunks / kThreads;             // B chunks per thread
  static constexpr int kAStage = kBM * kBK;      // A tile [BM][64], 16-byte chunks swizzled
  static constexpr int kBStage = kBK * kBRow;    // B tile [64][kBRow], 16-byte chunks swizzled
  static constexpr int kStage = kAStage + kBStage;
  static constexpr int kPipe = STAGES * kStage;
  static constexpr int kMapInts = 2 * (kGmsqMaxExperts + 1);   // row ends, block prefix
  static constexpr int kSmem = kPipe + 4 * kMapInts + 4 * WARPS_N * kBM;
  static_assert(KSPLIT == 1 || kPipe >= kWarpsMN * 32 * MT * 32 * 4, "k-split exchange fits");
  static_assert(kBK * kChunks % kThreads == 0, "B chunks split evenly over the threads");
};

struct Scratch {
  int* err;
  float* amax;     // [M] row max of |S| as float bits (atomicMax on int: S >= 0)
  int* counters;   // [max row blocks] arrivals per row block
};

// MODE kSwiglu: GroupedMatmulSwigluQuant. MODE kDequant: GroupedMatmulDequant (y = C as
// float32 [M, N]): the same tiles, the "gate" and "up" halves are simply columns [0, N/2) and
// [N/2, N), and the epilogue stores C with no row max and no cross-CTA wait.
enum Mode : int { kSwiglu = 0, kDequant = 1 };

// This thread's place in the tile: its warp (warp row wm, warp column wn; with KSPLIT 2 the k
// half is warp / kWarpsMN, computed where it is used: kept as a field, it changed nvcc's code
// for the KSPLIT 2 kernels) and its lane (g, t) of the mma fragment layout (lane g * 4 + t
// holds rows g and g + 8).
struct ThreadPos {
  int tid, lane, warp, wm, wn, g, t;
};

template <class C>
__device__ __forceinline__ ThreadPos thread_pos() {
  ThreadPos th;
  th.tid = threadIdx.x;
  th.lane = th.tid & 31;
  th.warp = th.tid >> 5;
  th.wm = (th.warp % C::kWarpsMN) / C::kWarpsN;
  th.wn = th.warp % C::kWarpsN;
  th.g = th.lane >> 2;
  th.t = th.lane & 3;
  return th;
}

// Per-lane shared-memory offsets of the fragments, constant for the whole kernel.
struct FragOffsets {
  // B (layouts 0 and 1): lane (g, t) reads k rows 4t..4t+3 of columns 4g..4g+3 in its warp's
  // 32-column quad; the chunk swizzle (chunk ^ 2t) makes the 4 t's hit 4 disjoint bank groups
  // (row stride 256 B maps every row to bank 0 otherwise: a 4-way conflict). The XOR may flip
  // the chunk bit that selects the gate/up half (WARPS_N = 2), so each half gets its own
  // offset rather than "+ q * kBNh".
  uint32_t b_lane_off[2];
  int a_row_in;    // ldmatrix row of this lane
  int a_chunk_hi;  // k 0-15 or 16-31 of a k32 step
  // KM: lane L gives the row of matrix L / 8 of an ldmatrix.x4: n8 tile (L / 16) (+2 per x4,
  // +4 for the up half), k half (L / 8) % 2, column n = L % 8. Offset for kb 0; kb 1 is ^ 32.
  uint32_t kb_off;
};

template <class C, bool KM>
__device__ __forceinline__ FragOffsets frag_offsets(const ThreadPos& th) {
  FragOffsets f;
#pragma unroll
  for (int q = 0; q < 2; ++q)
    f.b_lane_off[q] = 4 * th.t * C::kBRow +
                      (((q * (C::kChunks / 2) + th.wn * 2 + (th.g >> 2)) ^ (th.t << 1)) << 4) +
                      (th.g & 3) * 4;
  f.a_row_in = (th.lane & 7) + ((th.lane >> 3) & 1) * 8;
  f.a_chunk_hi = th.lane >> 4;
  f.kb_off = 0;
  if constexpr (KM) {
    const int sr = th.wn * 32 + (th.lane >> 4) * 8 + (th.lane & 7);
    f.kb_off = sr * kBK + ((((th.lane >> 3) & 1) ^ ((sr >> 1) & 3)) << 4);
  }
  return f;
}

// Row block rb of the tile map: its expert e, first row and row count (<= BM).
struct RowBlock {
  int e, row0, rows;
};

template <int BM>
__device__ __forceinline__ RowBlock row_block(const int* ends_s, const int* blk_s, int E, int rb) {
  RowBlock b;
  b.e = epi::expert_of_block(blk_s, E, rb);
  b.row0 = ends_s[b.e] + (rb - blk_s[b.e]) * BM;
  b.rows = min(BM, ends_s[b.e + 1] - b.row0);
  return b;
}

// Load plan of one row block, fixed for the whole tile: each thread always copies the same
// chunks of the A and B tiles, so their global pointers (a_src, b_src), shared offsets (a_dst,
// b_dst) and k predicates (a_k, b_k) are set up once and the pointers step by one k tile per
// stage (load_stage is called in k order). Recomputing 64-bit addresses per chunk and stage
// made the small-BM (decode) kernel issue-bound. The plan is separate arrays (kernel locals
// passed by reference), not a struct, and its B half is written in the kernel: a struct, or
// the weight_layout selects in a called function, changed nvcc's register allocation
// (cuobjdump -res-usage: up to 40 more registers per thread).
//
// A: chunk i = j * T + tid is 16 bytes (ch) of tile row r, swizzled by (r >> 1) & 3.
// a_k: k offset of the chunk within a k tile; INT_MAX: no chunk / row.
template <class C>
__device__ __forceinline__ void plan_a(const int8_t* (&a_src)[C::kAPer],
                                       uint32_t (&a_dst)[C::kAPer], int (&a_k)[C::kAPer],
                                       const int8_t* xg, int K, int rows, int tid) {
  constexpr int BM = C::kBM;
  constexpr int T = C::kThreads;
#pragma unroll
  for (int j = 0; j < C::kAPer; ++j) {
    const int i = j * T + tid;
    const int r = i >> 2, ch = i & 3;
    const bool used = (BM * 4 % T == 0 || i < BM * 4) && r < rows;
    a_src[j] = xg + static_cast<int64_t>(used ? r : 0) * K + ch * 16;
    a_dst[j] = (i < BM * 4) ? r * kBK + ((ch ^ ((r >> 1) & 3)) << 4) : 0;
    a_k[j] = used ? ch * 16 : INT_MAX;
  }
}

// Stage the A and B chunks of k tile kt into the pipeline stage at st with cp.async (chunks
// past K or past N/2 are zero-filled from a valid dummy address) and advance the pointers.
template <class C>
__device__ __forceinline__ void load_stage(const int8_t* (&a_src)[C::kAPer],
                                           const uint32_t (&a_dst)[C::kAPer],
                                           const int (&a_k)[C::kAPer],
                                           const int8_t* (&b_src)[C::kBPer],
                                           const uint32_t (&b_dst)[C::kBPer],
                                           const int (&b_k)[C::kBPer], int64_t b_step,
                                           uint32_t st, int kt, int K, const GmsqParams& p,
                                           int tid) {
  constexpr int BM = C::kBM;
  constexpr int T = C::kThreads;
  const int kleft = K - kt * kBK;  // chunk at k offset c is in range iff c < kleft
#pragma unroll
  for (int j = 0; j < C::kAPer; ++j) {
    if (BM * 4 % T == 0 || j * T + tid < BM * 4) {
      const bool ok = a_k[j] < kleft;
      cp_async16(st + a_dst[j], ok ? static_cast<const void*>(a_src[j]) : p.x, ok);
    }
    a_src[j] += kBK;
  }
#pragma unroll
  for (int j = 0; j < C::kBPer; ++j) {
    const bool ok = b_k[j] < kleft;
    cp_async16(st + b_dst[j], ok ? static_cast<const void*>(b_src[j]) : p.weight, ok);
    b_src[j] += b_step;
  }
}

// The MMAs of one 64-deep pipeline stage at as_addr: per k32 half kb (KSPLIT 2: this warp's
// half only), A fragments by ldmatrix, B fragments (transposed 32-bit reads, or ldmatrix for
// KM), then 8 n8 MMAs per m16 tile that holds a valid row.
template <class C, bool KM>
__device__ __forceinline__ void mma_stage(int (&acc)[C::kMT][8][4], uint32_t as_addr,
                                          const ThreadPos& th, const FragOffsets& f, int rows) {
  constexpr int MT = C::kMT;
  const uint32_t bs_addr = as_addr + C::kAStage;
#pragma unroll
  for (int kb = 0; kb < 2; ++kb) {
    if (C::kKSplit == 2 && kb != th.warp / C::kWarpsMN) continue;  // warp-uniform (k half)
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int r = (th.wm * MT + mt) * 16 + f.a_row_in;
      const int ch = kb * 2 + f.a_chunk_hi;
      ldmatrix_x4(a[mt], as_addr + r * kBK + ((ch ^ ((r >> 1) & 3)) << 4));
    }
    uint32_t b[8][2];
    if constexpr (KM) {
#pragma unroll
      for (int q2 = 0; q2 < 4; ++q2) {
        uint32_t r[4];
        ldmatrix_x4(r, bs_addr + (f.kb_off ^ (kb << 5)) +
                           ((q2 & 1) * 16 + (q2 >> 1) * C::kBNh) * kBK);
        b[2 * q2][0] = r[0];
        b[2 * q2][1] = r[1];
        b[2 * q2 + 1][0] = r[2];
        b[2 * q2 + 1][1] = r[3];
      }
    } else {
      load_b_transposed(bs_addr, f.b_lane_off, kb, C::kBRow, b);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if ((th.wm * MT + mt) * 16 < rows) {  // warp-uniform: skip m tiles with no valid row
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) mma_s8(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
      }
    }
  }
}

// Zero the accumulators of a row block.
template <class C>
__device__ __forceinline__ void zero_acc(int (&acc)[C::kMT][8][4]) {
#pragma unroll
  for (int mt = 0; mt < C::kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mt][nt][j] = 0;
}

// The GEMM of one row block from its load plan: zero the accumulators, fill STAGES - 1
// stages, then per k tile wait for its stage, refill the stage the previous iteration freed
// and run its MMAs. Ends with no cp.async in flight.
template <class C, bool KM>
__device__ __forceinline__ void mma_k_loop(int (&acc)[C::kMT][8][4],
                                           const int8_t* (&a_src)[C::kAPer],
                                           const uint32_t (&a_dst)[C::kAPer],
                                           const int (&a_k)[C::kAPer],
                                           const int8_t* (&b_src)[C::kBPer],
                                           const uint32_t (&b_dst)[C::kBPer],
                                           const int (&b_k)[C::kBPer], int64_t b_step,
                                           uint8_t* smem, const ThreadPos& th,
                                           const FragOffsets& f, const GmsqParams& p, int K,
                                           int KT, int rows) {
  constexpr int STAGES = C::kStages;
  const uint32_t smem_base = smem_addr(smem);
  zero_acc<C>(acc);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT)
      load_stage<C>(a_src, a_dst, a_k, b_src, b_dst, b_k, b_step, smem_base + s * C::kStage, s,
                    K, p, th.tid);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int nk = kt + STAGES - 1;
    if (nk < KT)
      load_stage<C>(a_src, a_dst, a_k, b_src, b_dst, b_k, b_step,
                    smem_base + (nk % STAGES) * C::kStage, nk, K, p, th.tid);
    cp_async_commit();
    mma_stage<C, KM>(acc, smem_addr(smem + (kt % STAGES) * C::kStage), th, f, rows);
  }
  cp_async_wait<0>();
}

// KSPLIT 2: k half 1 hands its partial sums to k half 0 through the (now idle) pipeline
// buffers; afterwards only the k-half-0 warps hold the tile's accumulators.
template <class C>
__device__ __forceinline__ void ksplit_reduce(int (&acc)[C::kMT][8][4], uint8_t* smem,
                                              const ThreadPos& th) {
  constexpr int MT = C::kMT;
  if (C::kKSplit == 2) {
    __syncthreads();
    int* xch = reinterpret_cast<int*>(smem) + (th.warp % C::kWarpsMN) * 32 * MT * 32 + th.lane;
    if (th.warp / C::kWarpsMN == 1) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) xch[((mt * 8 + nt) * 4 + j) * 32] = acc[mt][nt][j];
    }
    __syncthreads();
    if (th.warp / C::kWarpsMN == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[mt][nt][j] += xch[((mt * 8 + nt) * 4 + j) * 32];
    }
  }
}

// w_scale of this lane's 8 output columns in the gate (wsa) and up (wsg) halves; zeros when
// the columns are past N/2 (col_ok false).
__device__ __forceinline__ void load_w_scales(const GmsqParams& p, int e, int N, int half,
                                              int ocol, bool col_ok, float (&wsa)[8],
                                              float (&wsg)[8]) {
  const float* wsr = p.w_scale + static_cast<int64_t>(e) * N;
  float4 v0 = make_float4(0.f, 0.f, 0.f, 0.f), v1 = v0, v2 = v0, v3 = v0;
  if (col_ok) {
    v0 = *reinterpret_cast<const float4*>(wsr + ocol);
    v1 = *reinterpret_cast<const float4*>(wsr + ocol + 4);
    v2 = *reinterpret_cast<const float4*>(wsr + half + ocol);
    v3 = *reinterpret_cast<const float4*>(wsr + half + ocol + 4);
  }
  wsa[0] = v0.x; wsa[1] = v0.y; wsa[2] = v0.z; wsa[3] = v0.w;
  wsa[4] = v1.x; wsa[5] = v1.y; wsa[6] = v1.z; wsa[7] = v1.w;
  wsg[0] = v2.x; wsg[1] = v2.y; wsg[2] = v2.z; wsg[3] = v2.w;
  wsg[4] = v3.x; wsg[5] = v3.y; wsg[6] = v3.z; wsg[7] = v3.w;
}

// MODE kDequant epilogue: y[m, n] = ((float32(acc) * x_scale[m]) * w_scale[e, n]) + bias[e, n]
// for this lane's 8 columns of each half, stored as float4 pairs; overflow gives Inf (no error).
template <class C>
__device__ __forceinline__ void store_dequant(const int (&acc)[C::kMT][8][4], const GmsqParams& p,
                                              const ThreadPos& th, const RowBlock& rb, int N,
                                              int half, int ocol, bool col_ok, bool epi,
                                              const float (&wsa)[8], const float (&wsg)[8],
                                              const float* bias) {
  constexpr int MT = C::kMT;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = (th.wm * MT + mt) * 16 + th.g + 8 * hh;
      if (epi && r < rb.rows && col_ok) {
        const float xs = p.x_scale[rb.row0 + r];
        float* yr = p.y_float + static_cast<int64_t>(rb.row0 + r) * N + ocol;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          float v[8];
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int jj = 0; jj < 2; ++jj)
              v[4 * jj + i] = plus_bias(
                  __fmul_rn(__fmul_rn(__int2float_rn(acc[mt][4 * q + i][2 * hh + jj]), xs),
                            q ? wsg[4 * jj + i] : wsa[4 * jj + i]),
                  bias, q * half + ocol + 4 * jj + i);
          float* dst = yr + q * half;
          *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
          *reinterpret_cast<float4*>(dst + 4) = make_float4(v[4], v[5], v[6], v[7]);
        }
      }
    }
}

// MODE kSwiglu epilogue, first half: dequantize the gate and up accumulators, apply the
// activation into s and take each of the lane's rows' partial max |S| into rmax. Returns
// whether a valid row produced a non-finite C or S (the reference refuses those).
template <class C>
__device__ __forceinline__ bool swiglu_tile(const int (&acc)[C::kMT][8][4], const GmsqParams& p,
                                            const ThreadPos& th, const RowBlock& rb, int half,
                                            int ocol, const float (&wsa)[8],
                                            const float (&wsg)[8], const float* bias,
                                            float (&s)[C::kMT][2][8], float (&rmax)[C::kMT][2]) {
  constexpr int MT = C::kMT;
  bool nonfinite = false;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = (th.wm * MT + mt) * 16 + th.g + 8 * hh;
      const float xs = r < rb.rows ? p.x_scale[rb.row0 + r] : 0.0f;
      float m = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          // acc[mt][i][j] and acc[mt][4 + i][j] (j = 2 hh + jj) are the gate and up
          // products of physical column 8t + 4jj + i (see the B-operand note above).
          const int c = 4 * jj + i;
          const float ca = plus_bias(
              __fmul_rn(__fmul_rn(__int2float_rn(acc[mt][i][2 * hh + jj]), xs), wsa[c]), bias,
              ocol + c);
          const float cg = plus_bias(
              __fmul_rn(__fmul_rn(__int2float_rn(acc[mt][4 + i][2 * hh + jj]), xs), wsg[c]), bias,
              half + ocol + c);
          if (r < rb.rows && (!isfinite(ca) || !isfinite(cg))) nonfinite = true;
          const float v = activation_f32(p, ca, cg);
          // s * g overflowed: the reference refuses it (padding rows r >= rows hold the bias
          // alone and are never stored: they do not count).
          if (r < rb.rows && !isfinite(v)) nonfinite = true;
          s[mt][hh][c] = v;
          m = fmaxf(m, fabsf(v));
        }
      rmax[mt][hh] = m;
    }
  return nonfinite;
}

// The row max across CTAs: reduce the lanes' partial maxima over the quad, then over the
// WARPS_N warps through red_s, publish each row's max with atomicMax (float bits, S >= 0),
// then arrive on this row block's counter and wait for its col_tiles CTAs (all co-resident by
// the cooperative launch: see the top of the file). Afterwards ws.amax holds the final max.
template <class C>
__device__ __forceinline__ void share_row_max(const float (&rmax)[C::kMT][2], float* red_s,
                                              const Scratch& ws, const ThreadPos& th, int rb,
                                              const RowBlock& blk, int col_tiles, bool epi) {
  constexpr int MT = C::kMT;
  constexpr int BM = C::kBM;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float m = rmax[mt][hh];
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      if (th.t == 0 && epi) red_s[th.wn * BM + (th.wm * MT + mt) * 16 + th.g + 8 * hh] = m;
    }
  __syncthreads();
  for (int r = th.tid; r < blk.rows; r += C::kThreads) {
    float m = red_s[r];
#pragma unroll
    for (int w = 1; w < C::kWarpsN; ++w) m = fmaxf(m, red_s[w * BM + r]);
    if (m > 0.0f) atomicMax(reinterpret_cast<int*>(ws.amax) + blk.row0 + r, __float_as_int(m));
  }
  __threadfence();
  __syncthreads();
  if (th.tid == 0) epi::arrive_and_wait(ws.counters + rb, col_tiles);
  __syncthreads();
}

// MODE kSwiglu epilogue, second half: quantize s with its row's final max and store 8 codes
// per row per lane; column tile 0 also writes y_scale = amax / 127.
template <class C>
__device__ __forceinline__ void store_codes(const float (&s)[C::kMT][2][8], const GmsqParams& p,
                                            const Scratch& ws, const ThreadPos& th,
                                            const RowBlock& rb, int half, int ocol, bool col_ok,
                                            bool epi, int ct) {
  constexpr int MT = C::kMT;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = (th.wm * MT + mt) * 16 + th.g + 8 * hh;
      if (epi && r < rb.rows && col_ok) {
        const float amax = __ldcg(ws.amax + rb.row0 + r);
        const float inv = amax > 0.0f ? fminf(__fdiv_rn(127.0f, amax), FLT_MAX) : 0.0f;  // saturated: DESIGN.md
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          lo |= (static_cast<uint32_t>(quant_code(s[mt][hh][c], inv)) & 0xffu) << (8 * c);
          hi |= (static_cast<uint32_t>(quant_code(s[mt][hh][4 + c], inv)) & 0xffu) << (8 * c);
        }
        *reinterpret_cast<uint2*>(p.y + static_cast<int64_t>(rb.row0 + r) * half + ocol) =
            make_uint2(lo, hi);
      }
    }
  if (ct == 0) {
    for (int r = th.tid; r < rb.rows; r += C::kThreads)
      p.y_scale[rb.row0 + r] = __fdiv_rn(__ldcg(ws.amax + rb.row0 + r), 127.0f);
  }
}

// Rows at or past the last group end: codes 0 and scale 0 (kSwiglu; the contract's deviation
// from Ascend) or float zeros (kDequant), written grid-stride.
template <class C, int MODE>
__device__ __forceinline__ void zero_tail(const GmsqParams& p, int M, int N, int half,
                                          int rows_end, int tid) {
  constexpr int T = C::kThreads;
  const int tail = M - rows_end;
  if (MODE == kDequant && tail > 0) {
    const int64_t total = static_cast<int64_t>(tail) * (N / 4);
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * T + tid; i < total;
         i += static_cast<int64_t>(gridDim.x) * T)
      reinterpret_cast<float4*>(p.y_float + static_cast<int64_t>(rows_end) * N)[i] =
          make_float4(0.f, 0.f, 0.f, 0.f);
  } else if (MODE == kSwiglu) {
    epi::zero_tail_rows(p.y, p.y_scale, M, half, rows_end,
                        static_cast<int64_t>(blockIdx.x) * T + tid,
                        static_cast<int64_t>(gridDim.x) * T);
  }
}

// ---- the kernel -----------------------------------------------------------------------------

// KM: weight_layout 2 ([E, N, K], K-major; MODE kSwiglu only). The B tile is then stored like
// the A tile, [kBRow GEMM columns][64 k bytes] with the same chunk swizzle, and read with
// ldmatrix (each B register is 4 consecutive k of one column: no transpose). Within a warp's
// 32 columns of each half, physical column c sits in smem row (c % 4) * 8 + c / 4, so the 8
// rows one ldmatrix matrix reads (n8 tile i, column n = physical 4n + i: the layout-0
// relabelling, hence the same epilogue) are 8 consecutive, conflict-free rows.
//
// Per row block: plan the loads, run the pipelined GEMM, merge the k halves, then the
// epilogue (kDequant: store C; kSwiglu: SwiGLU, cross-CTA row max, quantize and store).
template <int WARPS_M, int WARPS_N, int MT, int STAGES, int KSPLIT, int MODE, bool KM>
__global__ void __launch_bounds__(Cfg<WARPS_M, WARPS_N, MT, STAGES, KSPLIT>::kThreads, 1)
    gmsq_kernel(const GmsqParams p, const Scratch ws, const int col_tiles) {
  static_assert(!KM || MODE == kSwiglu, "layout 2 is GroupedMatmulSwigluQuant only");
  using C = Cfg<WARPS_M, WARPS_N, MT, STAGES, KSPLIT>;
  constexpr int BM = C::kBM;
  constexpr int T = C::kThreads;
  extern __shared__ __align__(128) uint8_t smem[];
  int* ends_s = reinterpret_cast<int*>(smem + C::kPipe);       // [E + 1]
  int* blk_s = ends_s + (kGmsqMaxExperts + 1);                   // [E + 1]
  float* red_s = reinterpret_cast<float*>(blk_s + (kGmsqMaxExperts + 1));  // [WARPS_N][BM]

  const ThreadPos th = thread_pos<C>();
  const int M = static_cast<int>(p.m);
  const int K = static_cast<int>(p.k);
  const int N = static_cast<int>(p.n);
  const int half = N / 2;
  const int E = static_cast<int>(p.e);

  if constexpr (MODE == kSwiglu)
    for (int i = blockIdx.x * T + th.tid; i < M; i += gridDim.x * T) p.y_offset[i] = 0.0f;

  // Tile map (warp 0): sanitized group ends and the row-block prefix, both in shared memory.
  if (th.warp == 0)
    epi::build_tile_map(p.group_list, p.group_list_type, M, E, BM, th.lane, ends_s, blk_s,
                        ws.err);
  __syncthreads();
  const int total_blocks = blk_s[E];
  const int rows_end = ends_s[E];

  const int slots = gridDim.x / col_tiles;  // row blocks per round
  const int slot = blockIdx.x / col_tiles;
  const int ct = blockIdx.x % col_tiles;
  const int col0 = ct * C::kBNh;  // first output column of this CTA's tiles
  const int KT = (K + kBK - 1) / kBK;
  const FragOffsets f = frag_offsets<C, KM>(th);

  for (int rb = slot; rb < total_blocks; rb += slots) {
    const RowBlock blk = row_block<BM>(ends_s, blk_s, E, rb);
    // The GEMM: plan the loads, then the pipelined k loop.
    const int8_t* a_src[C::kAPer];
    uint32_t a_dst[C::kAPer];
    int a_k[C::kAPer];
    const int8_t* b_src[C::kBPer];
    uint32_t b_dst[C::kBPer];
    int b_k[C::kBPer];
    plan_a<C>(a_src, a_dst, a_k, p.x + static_cast<int64_t>(blk.row0) * K, K, blk.rows, th.tid);
    // [E, K, N]: row kk of the tile is two 128-byte runs N/2 apart (KM [E, N, K]: the expert's
    // matrix). Packed (weight_layout 1, [E, C, K, 2 * kBNh]): the CTA's whole B stream is one
    // contiguous run.
    const int8_t* wg =
        KM || p.weight_layout == 0
            ? p.weight + static_cast<int64_t>(blk.e) * K * N
            : p.weight + (static_cast<int64_t>(blk.e) * col_tiles + ct) * K * C::kBRow;
    const int64_t b_step = KM                    ? static_cast<int64_t>(kBK)
                           : p.weight_layout == 0 ? static_cast<int64_t>(kBK) * N
                                                  : static_cast<int64_t>(kBK) * C::kBRow;
    // B (here, not in a function: see plan_a): layouts 0 and 1, chunk i is 16 columns (cc) of
    // k row kr of the [64][kBRow] tile; KM, chunk i is 16 k bytes (ch) of smem row sr (see the
    // note above). b_k: k row (KM: k offset) of the chunk within a k tile; INT_MAX: column
    // past N/2 (zero fill).
#pragma unroll
    for (int j = 0; j < C::kBPer; ++j) {
      const int i = j * T + th.tid;
      if constexpr (KM) {
        const int sr = i >> 2, ch = i & 3;
        const int pr = sr % 32;
        const int hcol = col0 + (sr % C::kBNh) / 32 * 32 + (pr & 7) * 4 + (pr >> 3);
        const int col = (sr >= C::kBNh ? half : 0) + (hcol < half ? hcol : 0);
        b_src[j] = wg + static_cast<int64_t>(col) * K + ch * 16;
        b_dst[j] = C::kAStage + sr * kBK + ((ch ^ ((sr >> 1) & 3)) << 4);
        b_k[j] = hcol < half ? ch * 16 : INT_MAX;
        continue;
      }
      const int kr = i / C::kChunks, cc = i % C::kChunks;
      const int hcol = col0 + (cc % (C::kChunks / 2)) * 16;
      const int col = (cc >= C::kChunks / 2 ? half : 0) + hcol;
      b_src[j] = p.weight_layout == 0 ? wg + static_cast<int64_t>(kr) * N + col
                                      : wg + static_cast<int64_t>(kr) * C::kBRow + cc * 16;
      b_dst[j] = C::kAStage + kr * C::kBRow + ((cc ^ (((kr >> 2) & 3) << 1)) << 4);
      b_k[j] = hcol < half ? kr : INT_MAX;
    }
    int acc[MT][8][4];
    mma_k_loop<C, KM>(acc, a_src, a_dst, a_k, b_src, b_dst, b_k, b_step, smem, th, f, p, K, KT,
                      blk.rows);
    ksplit_reduce<C>(acc, smem, th);
    const bool epi = th.warp / C::kWarpsMN == 0;  // warps that own accumulators from here on

    const int ocol = col0 + th.wn * kOutPerWarp + 8 * th.t;  // this lane's 8 output columns
    const bool col_ok = ocol < half;                          // half % 16 == 0: all 8 or none
    float wsa[8], wsg[8];
    load_w_scales(p, blk.e, N, half, ocol, col_ok, wsa, wsg);
    // This lane's bias row (col_ok: its 8 columns of each half exist), or nullptr.
    const float* bias =
        p.bias != nullptr && col_ok ? p.bias + static_cast<int64_t>(blk.e) * N : nullptr;
    if constexpr (MODE == kDequant) {
      store_dequant<C>(acc, p, th, blk, N, half, ocol, col_ok, epi, wsa, wsg, bias);
      __syncthreads();  // the pipeline buffers are reused by the next row block
      continue;
    }
    float s[MT][2][8];
    float rmax[MT][2];
    const bool nonfinite = swiglu_tile<C>(acc, p, th, blk, half, ocol, wsa, wsg, bias, s, rmax);
    if (nonfinite && epi) atomicOr(ws.err, kErrNonFinite);
    share_row_max<C>(rmax, red_s, ws, th, rb, blk, col_tiles, epi);
    store_codes<C>(s, p, ws, th, blk, half, ocol, col_ok, epi, ct);
    __syncthreads();  // red_s and the pipeline buffers are reused by the next row block
  }

  zero_tail<C, MODE>(p, M, N, half, rows_end, th.tid);
}

// ---- host side -----------------------------------------------------------------------------

struct LaunchInfo {
  int blocks_per_sm = 0;
  int sms = 0;
  cudaError_t err = cudaSuccess;
};

template <int WARPS_M, int WARPS_N, int MT, int STAGES, int KSPLIT, int MODE, bool KM>
LaunchInfo launch_info(int device) {
  // Per device: raise the kernel's dynamic shared-memory limit once, read its occupancy.
  static std::mutex mu;
  static LaunchInfo cache[64];
  static bool done[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return LaunchInfo{0, 0, cudaErrorInvalidDevice};
  if (!done[device]) {
    using C = Cfg<WARPS_M, WARPS_N, MT, STAGES, KSPLIT>;
    LaunchInfo li;
    auto kernel = gmsq_kernel<WARPS_M, WARPS_N, MT, STAGES, KSPLIT, MODE, KM>;
    li.err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
    if (li.err == cudaSuccess)
      li.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&li.blocks_per_sm, kernel,
                                                             C::kThreads, C::kSmem);
    if (li.err == cudaSuccess)
      li.err = cudaDeviceGetAttribute(&li.sms, cudaDevAttrMultiProcessorCount, device);
    cache[device] = li;
    done[device] = true;
  }
  return cache[device];
}

template <int WARPS_M, int WARPS_N, int MT, int STAGES, int KSPLIT, int MODE, bool KM = false>
cudaError_t launch_cfg(const GmsqParams& p, const Scratch& s, cudaStream_t stream) {
  using C = Cfg<WARPS_M, WARPS_N, MT, STAGES, KSPLIT>;
  constexpr int kBNh = C::kBNh;
  if (p.weight_layout == 1 && kBNh != kGmsqPackedCols) return cudaErrorInvalidValue;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const LaunchInfo li = launch_info<WARPS_M, WARPS_N, MT, STAGES, KSPLIT, MODE, KM>(device);
  if (li.err != cudaSuccess) return li.err;
  const int64_t half = p.n / 2;
  const int col_tiles = static_cast<int>(std::max<int64_t>(1, (half + kBNh - 1) / kBNh));
  const int64_t co_resident = static_cast<int64_t>(li.blocks_per_sm) * li.sms;
  const int64_t max_blocks = (p.m + C::kBM - 1) / C::kBM + p.e;  // row blocks, upper bound
  const int64_t slots = std::min<int64_t>(co_resident / col_tiles, std::max<int64_t>(1, max_blocks));
  if (slots < 1) return cudaErrorCooperativeLaunchTooLarge;  // N/2 needs more co-resident CTAs
  const epi::CooperativeLaunch launch(static_cast<unsigned>(slots * col_tiles), C::kThreads,
                                      C::kSmem, stream);
  return cudaLaunchKernelEx(&launch.cfg, gmsq_kernel<WARPS_M, WARPS_N, MT, STAGES, KSPLIT, MODE, KM>,
                            p, s, col_tiles);
}

size_t align16(size_t v) { return (v + 15) / 16 * 16; }

__global__ void half_to_float_kernel(const __half* src, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __half2float(src[i]);
}

}  // namespace

cudaError_t launch_half_to_float(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 1024));
  half_to_float_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const __half*>(src), dst, n);
  return cudaGetLastError();
}

namespace {
// The tiled kernels' part (zeroed by their memset): error word, row amax, row-block counters.
size_t tiled_workspace_bytes(int64_t m, int64_t e) {
  const int64_t max_blocks = (m + 15) / 16 + e + 1;  // smallest BM is 16
  return 16 + align16(4 * static_cast<size_t>(m)) + align16(4 * static_cast<size_t>(max_blocks));
}
}  // namespace

size_t gmsq_workspace_bytes(int64_t m, int64_t n, int64_t e) {
  return std::max(tiled_workspace_bytes(m, e), gmsq_stream_workspace_bytes(m, n));
}

namespace {

// Rows per expert on average: few rows make the op a weight stream (small BM); many rows make
// it a GEMM (BM 128 reuses each B tile 128 times). Thresholds from benchmarks/bench_moe_cuda.py
// (bm16w best up to 32 rows per expert, bm64 at 64, bm128 at 1024); the k-split variants (bm16,
// bm32) never won. For weight_layout 2, bm128 means the
// wgmma kernel (128-row tiles).
int auto_config(int64_t m, int64_t e) {
  const int64_t avg = e > 0 ? m / e : m;
  return avg <= 32 ? kGmsqBm16Wide : avg <= 96 ? kGmsqBm64 : kGmsqBm128;
}

// Auto at decode (<= 4 rows an expert on average: one row block an expert, mostly): the stream
// pair (cuda_stream.cuh; on weight_layout 2 its K-major stream), which beats bm16w there at 8 and
// 64 experts when timed with cold instruction caches, as between a model's layers; at 8 rows an
// expert bm16w wins again, hence the 4 (benchmarks/NOTES_moe_cuda.md).
constexpr int64_t kStreamMaxAvgRows = 4;
bool auto_stream(const GmsqParams& p) {
  return p.config == kGmsqAuto && (p.weight_layout == 0 || p.weight_layout == kGmsqLayoutKMajor) &&
         p.e > 0 && p.m <= kStreamMaxAvgRows * p.e && gmsq_stream_workspace_bytes(p.m, p.n) != 0;
}

template <int MODE>
cudaError_t launch_mode(const GmsqParams& p, cudaStream_t stream) {
  if (p.m < 0 || p.m >= (int64_t{1} << 31) || p.k < 0 || p.k > kMaxK || p.k % 16 != 0 ||
      p.n < 0 || p.n % 32 != 0 || p.e < 0 || p.e > kGmsqMaxExperts ||
      (p.group_list_type != 0 && p.group_list_type != 1) || p.config < kGmsqAuto ||
      p.config >= kGmsqNumConfigs || p.n * (p.m / 2 + 1) >= (int64_t{1} << 40) ||
      (p.weight_layout != 0 && p.weight_layout != 1 &&
       (MODE != kSwiglu || p.weight_layout != kGmsqLayoutKMajor || p.config == kGmsqBm128)))
    return cudaErrorInvalidValue;
  Scratch s;
  s.err = p.err != nullptr ? p.err : static_cast<int*>(p.workspace);
  s.amax = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + 16);
  s.counters = reinterpret_cast<int*>(static_cast<char*>(p.workspace) + 16 +
                                      align16(4 * static_cast<size_t>(p.m)));
  if (p.m > 0 && p.n > 0 && p.e > 0 && p.k > 0 && (p.config == kGmsqStream || auto_stream(p)))
    return launch_gmsq_stream(p, MODE == kDequant, stream);  // no memset: see cuda_stream.cu
  cudaError_t err = cudaMemsetAsync(p.workspace, 0, tiled_workspace_bytes(p.m, p.e), stream);
  if (err != cudaSuccess || p.m == 0) return err;
  if (p.n == 0 || p.e == 0) {
    // No output columns or no experts: every row is "past the last group": zeros.
    if (MODE == kDequant) return p.n > 0 ? cudaMemsetAsync(p.y_float, 0, 4 * p.m * p.n, stream) : err;
    if ((err = cudaMemsetAsync(p.y_scale, 0, 4 * p.m, stream)) != cudaSuccess) return err;
    if (p.n > 0 && (err = cudaMemsetAsync(p.y, 0, p.m * (p.n / 2), stream)) != cudaSuccess)
      return err;
    return cudaMemsetAsync(p.y_offset, 0, 4 * p.m, stream);
  }
  const int config = p.config == kGmsqAuto ? auto_config(p.m, p.e) : p.config;
  if constexpr (MODE == kSwiglu) {
    if (p.weight_layout == kGmsqLayoutKMajor) {
      switch (config) {  // bm128 is the wgmma kernel's (launch_gmsq)
        case kGmsqBm16: return launch_cfg<1, 2, 1, 8, 2, MODE, true>(p, s, stream);
        case kGmsqBm64: return launch_cfg<2, 4, 2, 4, 1, MODE, true>(p, s, stream);
        case kGmsqBm16Wide: return launch_cfg<1, 4, 1, 6, 1, MODE, true>(p, s, stream);
        case kGmsqBm32: return launch_cfg<1, 2, 2, 6, 2, MODE, true>(p, s, stream);
        default: return cudaErrorInvalidValue;
      }
    }
  }
  switch (config) {
    //                                 WARPS_M, WARPS_N, MT, STAGES, KSPLIT, MODE
    case kGmsqBm16: return launch_cfg<1, 2, 1, 8, 2, MODE>(p, s, stream);
    case kGmsqBm64: return launch_cfg<2, 4, 2, 4, 1, MODE>(p, s, stream);
    case kGmsqBm16Wide: return launch_cfg<1, 4, 1, 6, 1, MODE>(p, s, stream);
    case kGmsqBm32: return launch_cfg<1, 2, 2, 6, 2, MODE>(p, s, stream);
    default: return launch_cfg<2, 4, 4, 4, 1, MODE>(p, s, stream);
  }
}

}  // namespace

cudaError_t launch_gmsq(const GmsqParams& p, cudaStream_t stream) {
  // weight_layout 2 ([E, N, K], K-major): the Hopper wgmma kernel (cuda_wgmma.cu) for bm128
  // (auto: at least 32 rows an expert on average), else this kernel's K-major B path. The
  // threshold is where the ping-pong wgmma kernel starts to beat bm16w (it ties bm64 at 64 rows;
  // bm16w wins at 2-4 rows; benchmarks/NOTES_moe_cuda.md). Off Hopper the wgmma kernel
  // refuses before enqueuing anything and the layout-0 rule picks this kernel's config instead
  // (bm64, its largest K-major tile, above 32 rows), so an 'ENK' model runs on any sm_80+ GPU.
  if (p.weight_layout == kGmsqLayoutKMajor &&
      (p.config == kGmsqBm128 || (p.config == kGmsqAuto && p.e > 0 && p.m / p.e >= 32))) {
    const cudaError_t err = launch_gmsq_wgmma(p, stream);
    if (err != cudaErrorNotSupported) return err;
    GmsqParams q = p;
    q.config = p.config == kGmsqAuto && auto_config(p.m, p.e) != kGmsqBm128 ? auto_config(p.m, p.e)
                                                                              : kGmsqBm64;
    return launch_mode<kSwiglu>(q, stream);
  }
  return launch_mode<kSwiglu>(p, stream);
}

cudaError_t launch_gmd(const GmsqParams& p, cudaStream_t stream) {
  return launch_mode<kDequant>(p, stream);
}

}  // namespace ort_ops::gmsq_cuda

ORT_OPS_CUDA_EXPORT int ort_ops_gmsq_cuda(const int8_t* x, const int8_t* weight,
                                          const float* w_scale, const float* x_scale,
                                          const int64_t* group_list, int8_t* y, float* y_scale,
                                          float* y_offset, void* workspace, int64_t m, int64_t k,
                                          int64_t n, int64_t e, int group_list_type, int config,
                                          int weight_layout, const float* bias, int activation,
                                          float alpha, float limit, void* stream) {
  using namespace ort_ops::gmsq_cuda;
  GmsqParams p{x, weight, w_scale, x_scale, group_list, y, y_scale, y_offset, workspace,
               m, k, n, e, group_list_type, config, nullptr, weight_layout, nullptr,
               bias, activation, alpha, limit};
  return static_cast<int>(launch_gmsq(p, static_cast<cudaStream_t>(stream)));
}

ORT_OPS_CUDA_EXPORT int ort_ops_gmd_cuda(const int8_t* x, const int8_t* weight,
                                         const float* w_scale, const float* x_scale,
                                         const int64_t* group_list, float* y, void* workspace,
                                         int64_t m, int64_t k, int64_t n, int64_t e,
                                         int group_list_type, int config, int weight_layout,
                                         const float* bias, void* stream) {
  using namespace ort_ops::gmsq_cuda;
  GmsqParams p{x, weight, w_scale, x_scale, group_list, nullptr, nullptr, nullptr, workspace,
               m, k, n, e, group_list_type, config, y, weight_layout, nullptr, bias};
  return static_cast<int>(launch_gmd(p, static_cast<cudaStream_t>(stream)));
}

ORT_OPS_CUDA_EXPORT size_t ort_ops_gmsq_cuda_workspace_bytes(int64_t m, int64_t n, int64_t e) {
  return ort_ops::gmsq_cuda::gmsq_workspace_bytes(m, n, e);
}
