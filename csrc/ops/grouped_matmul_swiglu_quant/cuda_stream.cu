// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant / GroupedMatmulDequant at decode: a balanced weight stream and a
// separate epilogue. Same bits as the tiled kernel (cuda.cu); spec ort_ops/ops/_moe.py.
//
// Why a second design. With a few rows an expert the op is a read of the touched experts'
// weights (46 MB at 8 experts, ~323 MB at 64, hidden 2048 / intermediate 1408). The tiled
// kernel gives each CTA a whole (row block, 128-output) tile and needs the C column tiles of a
// row block co-resident for the row max: a cooperative launch, a memset node for its
// counters, and rounds of tiles that leave SMs idle (64 experts: 616 tiles in rounds of 264,
// the last a third full; 8 experts: 88 tiles on 132 SMs).
//
// Stream kernel (gmsq_stream_kernel). A unit is 16 rows (one row block) x 256 contiguous GEMM
// columns x one k chunk (K split into ~16 chunks of whole 64-deep steps); units are numbered
// (row block, column tile, k chunk), and CTA c of G takes the contiguous range
// [c U / G, (c + 1) U / G): every CTA streams the same number of weight bytes (within one
// unit) whatever the routing. Its cp.async ring runs across unit boundaries; int32 sums stay
// in registers over the k chunks of a tile and are stored when the tile (or the range) ends:
// to sums[M, N] when the CTA holds the tile's first chunk, else to its own 16 x 256 partial
// slot (only a CTA's first tile can start before its range). A tile's k chunks are thus
// owned by CTAs owner(first) .. owner(last), and sums + the slots of the later owners is the
// exact int32 total (integer sums: the split changes no bit). Normal launch, no counters, so
// no memset: CTA 0 writes the error word (the group_list check) with a plain store.
//
// Epilogue (gmsq_stream_epilogue): one CTA a row, launched as a programmatic dependent on
// sm_90 (resident early: its tile map, the row's tile owners and a prefetch of its scales run
// while the stream does; it waits for the stream's writes with griddepcontrol.wait only before
// the first read of the sums). Dequantize, SwiGLU, the row max over all N/2 outputs in one CTA
// (no cross-CTA handshake), codes; rows past the last group get zeros.
//
// B operand and MMA: the tiled kernel's (mma_sync.cuh): [K, N] rows in a swizzled shared
// tile, 4x4 byte transposes into m16n8k32 B registers, so lane (g, t) of warp w holds physical
// columns 8t..8t+7 of the warp's 32-column quads q * 128 + 32 w (q = 0, 1) of the unit.
//
// Tuning on the H200 (NOTES_moe_cuda.md, session 5), 64 experts at 16 tokens: 3 CTAs of 4 warps
// an SM with a 4-slot ring beat 2 CTAs with 6 slots by 2 % (same-run medians 93.5 vs 95.4 us), which
// beat 5 slots and 8 k chunks a tile by 1.5 %; 512-column units on 8-warp CTAs (one an SM) were 6 %
// slower, the epilogue as a plain launch (no PDL) 1.5 % slower; the epilogue's work before its
// wait (owners, scale prefetch) gained 1.7 % (93.9 -> 92.3 us); 4 CTAs with 3 slots did not
// (92.7). More CTAs an SM, not longer contiguous runs, is what the stream wants.
#include "ops/grouped_matmul_swiglu_quant/cuda_stream.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "ops/grouped_matmul_swiglu_quant/epilogue.cuh"
#include "ops/grouped_matmul_swiglu_quant/mma_sync.cuh"

namespace ort_ops::gmsq_cuda {
namespace {

using namespace mma;  // cp.async, ldmatrix, the s8 MMA, B transposes (mma_sync.cuh)

constexpr int kRows = 16;                 // rows of a unit (one m16 tile)
constexpr int kWarps = 4;
constexpr int kCols = 64 * kWarps;        // GEMM columns of a unit (contiguous in N): 256
constexpr int kChunks = kCols / 16;       // 16-byte chunks of a B row
constexpr int kBK = 64;                   // k per pipeline stage
constexpr int kThreads = 32 * kWarps;     // one warp a 64-column slice of the unit
constexpr int kStages = 4;                // ring slots (3 stages, 48 KB, in flight; 3 CTAs an SM)
constexpr int kMinCtasPerSm = 3;          // up to E ~ 500 (the tile map's shared memory grows with E)
constexpr int kChunksPerTile = 16;        // target k chunks a tile (the balancing grain)
constexpr int kAStage = kRows * kBK;      // A [16][64], 16-byte chunks swizzled
constexpr int kBStage = kBK * kCols;      // B [64][256], 16-byte chunks swizzled
constexpr int kStage = kAStage + kBStage;
// Dynamic shared memory: the ring, then the tile map (group ends and row-block prefix, E + 1 ints
// each), sized by E so that fewer experts leave room for more CTAs an SM.
constexpr size_t smem_bytes(int64_t e) {
  return (static_cast<size_t>(kStages) * kStage + 8 * static_cast<size_t>(e + 1) + 15) / 16 * 16;
}
constexpr int kEpiMaxThreads = 1024;      // epilogue: one thread a pair of output columns
constexpr int kMaxHalf = 24576;           // the epilogue keeps a row's N/2 outputs in shared memory
constexpr int64_t kMaxSums = int64_t{1} << 24;  // M * N int32 sums
constexpr int kMaxCtas = 1024;
constexpr int kMaxColTiles = 2 * kMaxHalf / kCols;  // 192
constexpr int kMaxK = 131071;             // as cuda.cu: exact int32 sums

// Host-computed split of the problem, passed to both kernels.
struct StreamShape {
  int spu;        // 64-deep k steps a unit
  int kchunks;    // units a tile
  int col_tiles;  // ceil(N / 256)
  int grid;       // CTAs of the stream kernel (G)
};

// CTA ranges: CTA c of `ctas` takes units [start(c), start(c + 1)); owner(u) is the CTA
// holding unit u, the largest c with c * units / ctas <= u.
__device__ __forceinline__ int64_t range_start(int64_t c, int64_t units, int64_t ctas) {
  return c * units / ctas;
}
__device__ __forceinline__ int64_t owner(int64_t u, int64_t units, int64_t ctas) {
  return ((u + 1) * ctas - 1) / units;
}

struct UnitPos {
  int e, row0, rows, ctile, kchunk;
};
__device__ __forceinline__ UnitPos unit_pos(int64_t u, const StreamShape& sh, const int* ends_s,
                                            const int* blk_s, int E) {
  UnitPos up;
  const int64_t tile = u / sh.kchunks;
  up.kchunk = static_cast<int>(u - tile * sh.kchunks);
  const int rb = static_cast<int>(tile / sh.col_tiles);
  up.ctile = static_cast<int>(tile - static_cast<int64_t>(rb) * sh.col_tiles);
  up.e = epi::expert_of_block(blk_s, E, rb);
  up.row0 = ends_s[up.e] + (rb - blk_s[up.e]) * kRows;
  up.rows = min(kRows, ends_s[up.e + 1] - up.row0);
  return up;
}

__device__ __forceinline__ int* stream_sums(const GmsqParams& p) {
  return reinterpret_cast<int*>(static_cast<char*>(p.workspace) + 16);
}
__device__ __forceinline__ int* stream_slots(const GmsqParams& p) {
  return stream_sums(p) + p.m * p.n;
}

__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    gmsq_stream_kernel(const GmsqParams p, const StreamShape sh) {
  extern __shared__ __align__(128) uint8_t smem[];
  int* ends_s = reinterpret_cast<int*>(smem + kStages * kStage);
  int* blk_s = ends_s + (p.e + 1);
  __shared__ int bad_s;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the epilogue waits itself
#endif
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int M = static_cast<int>(p.m);
  const int K = static_cast<int>(p.k);
  const int N = static_cast<int>(p.n);
  const int E = static_cast<int>(p.e);

  if (tid == 0) bad_s = 0;
  __syncthreads();
  if (warp == 0)
    epi::build_tile_map(p.group_list, p.group_list_type, M, E, kRows, lane, ends_s, blk_s, &bad_s);
  __syncthreads();
  // Every CTA sees the same map; CTA 0 reports it (and so zeroes the word for this launch).
  if (blockIdx.x == 0 && tid == 0) *static_cast<int*>(p.workspace) = bad_s ? kErrGroupList : 0;

  const int64_t units = static_cast<int64_t>(blk_s[E]) * sh.col_tiles * sh.kchunks;
  const int64_t ctas = units < gridDim.x ? units : static_cast<int64_t>(gridDim.x);
  const int64_t c = blockIdx.x;
  if (c >= ctas) return;
  const int64_t ubeg = range_start(c, units, ctas);
  const int64_t uend = range_start(c + 1, units, ctas);
  const int nsteps = static_cast<int>((uend - ubeg) * sh.spu);

  // Load plan: thread tid copies B chunk cc = tid % 16 of k rows 8j + tid / 16 (j < 8) and, for
  // tid < 64, A chunk tid % 4 of row tid / 4. The swizzles are the tiled kernel's.
  const int cc = tid % kChunks;
  int64_t b_off[8];
  uint32_t b_dst[8];
  int b_kr[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int kr = 8 * j + tid / kChunks;
    b_kr[j] = kr;
    b_off[j] = static_cast<int64_t>(kr) * N;
    b_dst[j] = kAStage + kr * kCols + ((cc ^ (((kr >> 2) & 3) << 1)) << 4);
  }
  const int a_r = tid >> 2, a_ch = tid & 3;
  const uint32_t a_dst = a_r * kBK + ((a_ch ^ ((a_r >> 1) & 3)) << 4);
  const uint32_t smem_base = smem_addr(smem);

  int64_t ld_u = ubeg;
  int ld_ks = 0, ld_k = 0, ld_rows = 0;
  bool ld_col = false;
  const int8_t* ld_w = p.weight;
  const int8_t* ld_x = p.x;
  auto load_next = [&](int slot) {
    if (ld_ks == 0) {
      const UnitPos up = unit_pos(ld_u, sh, ends_s, blk_s, E);
      ld_k = up.kchunk * sh.spu * kBK;
      ld_rows = up.rows;
      const int col = up.ctile * kCols + cc * 16;
      ld_col = col < N;
      ld_w = p.weight + static_cast<int64_t>(up.e) * K * N + static_cast<int64_t>(ld_k) * N + col;
      ld_x = p.x + static_cast<int64_t>(up.row0 + (a_r < up.rows ? a_r : 0)) * K + ld_k + a_ch * 16;
    }
    const uint32_t st = smem_base + slot * kStage;
    if (tid < kRows * 4) {
      const bool ok = a_r < ld_rows && ld_k + a_ch * 16 < K;
      cp_async16(st + a_dst, ok ? static_cast<const void*>(ld_x) : p.x, ok);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bool ok = ld_col && ld_k + b_kr[j] < K;
      cp_async16(st + b_dst[j], ok ? static_cast<const void*>(ld_w + b_off[j]) : p.weight, ok);
    }
    ld_w += static_cast<int64_t>(kBK) * N;
    ld_x += kBK;
    ld_k += kBK;
    if (++ld_ks == sh.spu) {
      ld_ks = 0;
      ++ld_u;
    }
  };

  // MMA side: B reads as cuda.cu's WARPS_N = 4 tile (warp w: columns q * 128 + 32 w + [0, 32)).
  uint32_t b_lane_off[2];
#pragma unroll
  for (int q = 0; q < 2; ++q)
    b_lane_off[q] = 4 * t * kCols + (((q * (kChunks / 2) + warp * 2 + (g >> 2)) ^ (t << 1)) << 4) + (g & 3) * 4;
  const int a_row_in = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int a_chunk_hi = lane >> 4;

  int acc[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[nt][j] = 0;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nsteps) load_next(s);
    cp_async_commit();
  }
  int64_t cu = ubeg;
  int cks = 0;
  for (int step = 0; step < nsteps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (step + kStages - 1 < nsteps) load_next((step + kStages - 1) % kStages);
    cp_async_commit();
    const uint32_t as_addr = smem_base + (step % kStages) * kStage;
    const uint32_t bs_addr = as_addr + kAStage;
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
      uint32_t a[4];
      {
        const int ch = kb * 2 + a_chunk_hi;
        ldmatrix_x4(a, as_addr + a_row_in * kBK + ((ch ^ ((a_row_in >> 1) & 3)) << 4));
      }
      uint32_t b[8][2];
      load_b_transposed(bs_addr, b_lane_off, kb, kCols, b);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) mma_s8(acc[nt], a, b[nt][0], b[nt][1]);
    }
    if (++cks < sh.spu) continue;
    cks = 0;
    const int64_t next = ++cu;
    if (next != uend && next % sh.kchunks != 0) continue;
    // The tile of unit next - 1 ends here: store its sums (see the file note) and restart.
    const UnitPos up = unit_pos(next - 1, sh, ends_s, blk_s, E);
    const int64_t tile_first = (next - 1) / sh.kchunks * sh.kchunks;
    const bool to_slot = tile_first < ubeg;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int tcol = q * (kCols / 2) + warp * 32 + 8 * t;  // column within the unit
      const int col = up.ctile * kCols + tcol;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = g + 8 * hh;
        if (r < up.rows && col < N) {
          int* dst = to_slot ? stream_slots(p) + (c * kRows + r) * kCols + tcol
                             : stream_sums(p) + static_cast<int64_t>(up.row0 + r) * N + col;
          *reinterpret_cast<int4*>(dst) =
              make_int4(acc[q * 4 + 0][2 * hh], acc[q * 4 + 1][2 * hh], acc[q * 4 + 2][2 * hh],
                        acc[q * 4 + 3][2 * hh]);
          *reinterpret_cast<int4*>(dst + 4) =
              make_int4(acc[q * 4 + 0][2 * hh + 1], acc[q * 4 + 1][2 * hh + 1],
                        acc[q * 4 + 2][2 * hh + 1], acc[q * 4 + 3][2 * hh + 1]);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[nt][j] = 0;
  }
  cp_async_wait<0>();
}

// The int32 sums of GEMM columns col, col + 1 (col even) of row r, row rin of its row block:
// sums[r] plus the partial slots of the later owners c0[ct] + 1 .. c0[ct] + extra[ct] of the
// column tile's tile (see the file note).
__device__ __forceinline__ int2 row_sums2(const GmsqParams& p, const int* c0_s,
                                          const int* extra_s, int r, int rin, int col) {
  const int ct = col / kCols;
  int2 v = __ldcg(reinterpret_cast<const int2*>(stream_sums(p) + static_cast<int64_t>(r) * p.n + col));
  const int c0 = c0_s[ct];
  for (int i = 1; i <= extra_s[ct]; ++i) {
    const int2 o = __ldcg(reinterpret_cast<const int2*>(
        stream_slots(p) + (static_cast<int64_t>(c0 + i) * kRows + rin) * kCols + col - ct * kCols));
    v.x += o.x;
    v.y += o.y;
  }
  return v;
}

// One CTA a row; each thread owns pairs of output columns (2 j, 2 j + 1), so a row's work is
// spread over up to 1024 threads: the tail after the stream is one L2 round trip, one SwiGLU
// and one block max deep (an earlier version, 8 columns a thread on 256 threads with the
// owner arithmetic in every thread, ran 5-7 us after the stream on the H200).
template <bool DEQUANT>
__global__ void __launch_bounds__(kEpiMaxThreads)
    gmsq_stream_epilogue(const GmsqParams p, const StreamShape sh) {
  extern __shared__ float s_out[];  // [N/2] a row's SwiGLU outputs
  __shared__ int ends_s[kGmsqMaxExperts + 1];
  __shared__ int blk_s[kGmsqMaxExperts + 1];
  __shared__ int c0_s[kMaxColTiles];
  __shared__ int extra_s[kMaxColTiles];
  __shared__ int bad_s;
  __shared__ float red_s[kEpiMaxThreads / 32];
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int lane = tid & 31;
  const int M = static_cast<int>(p.m);
  const int N = static_cast<int>(p.n);
  const int E = static_cast<int>(p.e);
  const int half = N / 2;
  const int pairs = (DEQUANT ? N : half) / 2;
  if (tid < 32)  // the stream kernel reported the map; this copy only locates rows
    epi::build_tile_map(p.group_list, p.group_list_type, M, E, kRows, lane, ends_s, blk_s, &bad_s);
  __syncthreads();
  const int64_t units = static_cast<int64_t>(blk_s[E]) * sh.col_tiles * sh.kchunks;
  const int64_t ctas = units < sh.grid ? units : static_cast<int64_t>(sh.grid);
  const int rows_end = ends_s[E];
  // Everything up to the first read of the stream's sums (the map, the first row's owners, its
  // scales pulled into L1) overlaps the stream; then wait for its writes once.
  bool waited = false;
  auto wait_stream = [&waited] {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (!waited) asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    waited = true;
  };

  int prev_rb = -1;
  for (int r = blockIdx.x; r < M; r += gridDim.x) {
    if (r >= rows_end) {  // past the last group: zeros (the contract's deviation from Ascend)
      if constexpr (DEQUANT) {
        for (int j = tid; j < N / 4; j += nt)
          reinterpret_cast<float4*>(p.y_float + static_cast<int64_t>(r) * N)[j] =
              make_float4(0.f, 0.f, 0.f, 0.f);
      } else {
        for (int j = tid; j < half / 16; j += nt)
          reinterpret_cast<uint4*>(p.y + static_cast<int64_t>(r) * half)[j] = make_uint4(0, 0, 0, 0);
        if (tid == 0) p.y_scale[r] = 0.0f, p.y_offset[r] = 0.0f;
      }
      continue;
    }
    const int e = epi::expert_of_block(ends_s, E, r);  // ends_s[e] <= r < ends_s[e + 1]
    const int rb = blk_s[e] + (r - ends_s[e]) / kRows;
    const int rin = (r - ends_s[e]) % kRows;
    if (rb != prev_rb) {  // the owners of this row block's tiles, once a CTA and row block
      __syncthreads();
      for (int ct = tid; ct < sh.col_tiles; ct += nt) {
        const int64_t tile = static_cast<int64_t>(rb) * sh.col_tiles + ct;
        const int64_t c0 = owner(tile * sh.kchunks, units, ctas);
        c0_s[ct] = static_cast<int>(c0);
        extra_s[ct] = static_cast<int>(owner((tile + 1) * sh.kchunks - 1, units, ctas) - c0);
      }
      __syncthreads();
      prev_rb = rb;
    }
    const float xs = p.x_scale[r];
    const float* wsr = p.w_scale + static_cast<int64_t>(e) * N;
    if (!waited) {
      for (int i = tid; i < N / 32; i += nt)  // the row's weight scales, 128-byte lines
        asm volatile("prefetch.global.L1 [%0];\n" ::"l"(wsr + 32 * i));
      wait_stream();
    }
    if constexpr (DEQUANT) {
      // y = (float32(acc) * x_scale) * w_scale (overflow gives Inf: no error, as cuda.cu).
      for (int j = tid; j < pairs; j += nt) {
        const int2 v = row_sums2(p, c0_s, extra_s, r, rin, 2 * j);
        const float2 w = *reinterpret_cast<const float2*>(wsr + 2 * j);
        *reinterpret_cast<float2*>(p.y_float + static_cast<int64_t>(r) * N + 2 * j) =
            make_float2(__fmul_rn(__fmul_rn(__int2float_rn(v.x), xs), w.x),
                        __fmul_rn(__fmul_rn(__int2float_rn(v.y), xs), w.y));
      }
      continue;
    }
    float m = 0.0f;
    bool nonfinite = false;
    for (int j = tid; j < pairs; j += nt) {
      const int2 va = row_sums2(p, c0_s, extra_s, r, rin, 2 * j);
      const int2 vg = row_sums2(p, c0_s, extra_s, r, rin, half + 2 * j);
      const float2 wa = *reinterpret_cast<const float2*>(wsr + 2 * j);
      const float2 wg = *reinterpret_cast<const float2*>(wsr + half + 2 * j);
      const float ca0 = __fmul_rn(__fmul_rn(__int2float_rn(va.x), xs), wa.x);
      const float ca1 = __fmul_rn(__fmul_rn(__int2float_rn(va.y), xs), wa.y);
      const float cg0 = __fmul_rn(__fmul_rn(__int2float_rn(vg.x), xs), wg.x);
      const float cg1 = __fmul_rn(__fmul_rn(__int2float_rn(vg.y), xs), wg.y);
      if (!isfinite(ca0) || !isfinite(cg0) || !isfinite(ca1) || !isfinite(cg1)) nonfinite = true;
      const float v0 = epi::swiglu_f32(ca0, cg0);
      const float v1 = epi::swiglu_f32(ca1, cg1);
      if (!isfinite(v0) || !isfinite(v1)) nonfinite = true;  // s * g overflowed: refused
      s_out[2 * j] = v0;
      s_out[2 * j + 1] = v1;
      m = fmaxf(m, fmaxf(fabsf(v0), fabsf(v1)));
    }
    if (nonfinite) atomicOr(static_cast<int*>(p.workspace), kErrNonFinite);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red_s[tid >> 5] = m;
    __syncthreads();
    float amax = red_s[0];
    for (int w = 1; w < nt / 32; ++w) amax = fmaxf(amax, red_s[w]);
    const float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    for (int j = tid; j < pairs; j += nt) {
      const uint32_t lo = static_cast<uint32_t>(epi::quant_code(s_out[2 * j], inv)) & 0xffu;
      const uint32_t hi = static_cast<uint32_t>(epi::quant_code(s_out[2 * j + 1], inv)) & 0xffu;
      *reinterpret_cast<uint16_t*>(p.y + static_cast<int64_t>(r) * half + 2 * j) =
          static_cast<uint16_t>(lo | (hi << 8));
    }
    if (tid == 0) {
      p.y_scale[r] = __fdiv_rn(amax, 127.0f);
      p.y_offset[r] = 0.0f;
    }
    __syncthreads();  // s_out and red_s are reused by the next row
  }
  wait_stream();  // a CTA of tail rows only: do not finish ahead of the stream's writes
}

struct DeviceInfo {
  int grid = 0;   // most stream CTAs (SM count x resident CTAs a SM at E = 1): the slots sized
  int sms = 0;
  int major = 0;
  cudaError_t err = cudaSuccess;
};

// Per device, once: the kernels' shared-memory limits and the stream grid.
DeviceInfo device_info() {
  static std::mutex mu;
  static DeviceInfo cache[64];
  static bool done[64] = {};
  int device = 0;
  DeviceInfo di;
  if ((di.err = cudaGetDevice(&device)) != cudaSuccess) return di;
  if (device < 0 || device >= 64) return DeviceInfo{0, 0, cudaErrorInvalidDevice};
  std::lock_guard<std::mutex> lock(mu);
  if (!done[device]) {
    int per_sm = 0;
    di.err = cudaFuncSetAttribute(gmsq_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem_bytes(kGmsqMaxExperts)));
    if (di.err == cudaSuccess)
      di.err = cudaFuncSetAttribute(gmsq_stream_epilogue<false>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * kMaxHalf);
    if (di.err == cudaSuccess)
      di.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gmsq_stream_kernel, kThreads,
                                                             smem_bytes(1));
    if (di.err == cudaSuccess)
      di.err = cudaDeviceGetAttribute(&di.sms, cudaDevAttrMultiProcessorCount, device);
    if (di.err == cudaSuccess)
      di.err = cudaDeviceGetAttribute(&di.major, cudaDevAttrComputeCapabilityMajor, device);
    di.grid = std::min(kMaxCtas, std::max(1, di.sms * per_sm));
    cache[device] = di;
    done[device] = true;
  }
  return cache[device];
}

}  // namespace

size_t gmsq_stream_workspace_bytes(int64_t m, int64_t n) {
  if (m <= 0 || n <= 0 || m * n > kMaxSums || n / 2 > kMaxHalf) return 0;
  const DeviceInfo di = device_info();
  if (di.err != cudaSuccess) return 0;
  return 16 + 4 * static_cast<size_t>(m * n) + static_cast<size_t>(di.grid) * kRows * kCols * 4;
}

cudaError_t launch_gmsq_stream(const GmsqParams& p, bool dequant, cudaStream_t stream) {
  if (p.weight_layout != 0 || p.m <= 0 || p.n <= 0 || p.e <= 0 || p.k <= 0 || p.k > kMaxK ||
      p.k % 16 != 0 || p.n % 32 != 0 || p.e > kGmsqMaxExperts ||
      gmsq_stream_workspace_bytes(p.m, p.n) == 0)
    return cudaErrorInvalidValue;
  const DeviceInfo di = device_info();
  if (di.err != cudaSuccess) return di.err;
  StreamShape sh;
  const int steps = static_cast<int>((p.k + kBK - 1) / kBK);
  sh.spu = (steps + kChunksPerTile - 1) / kChunksPerTile;
  sh.kchunks = (steps + sh.spu - 1) / sh.spu;
  sh.col_tiles = static_cast<int>((p.n + kCols - 1) / kCols);
  int per_sm = 0;
  cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gmsq_stream_kernel,
                                                                 kThreads, smem_bytes(p.e));
  if (err != cudaSuccess) return err;
  sh.grid = std::min(di.grid, std::max(1, di.sms * per_sm));  // <= the slots the workspace has
  gmsq_stream_kernel<<<sh.grid, kThreads, smem_bytes(p.e), stream>>>(p, sh);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  // The epilogue: a programmatic dependent launch on sm_90 (see the file note).
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(p.m, 65535)));
  const int64_t pairs = (dequant ? p.n : p.n / 2) / 2;
  cfg.blockDim = dim3(static_cast<unsigned>(std::min<int64_t>(kEpiMaxThreads, (pairs + 31) / 32 * 32)));
  cfg.dynamicSmemBytes = dequant ? 0 : 4 * static_cast<size_t>(p.n / 2);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (di.major >= 9) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return dequant ? cudaLaunchKernelEx(&cfg, gmsq_stream_epilogue<true>, p, sh)
                 : cudaLaunchKernelEx(&cfg, gmsq_stream_epilogue<false>, p, sh);
}

}  // namespace ort_ops::gmsq_cuda
