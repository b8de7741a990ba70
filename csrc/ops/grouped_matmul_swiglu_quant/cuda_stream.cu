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
// K-major variant (weight_layout 2, gmsq_stream_km_kernel): the same units, owners and epilogue
// with 16-column tiles whose bytes are contiguous in [E, N, K], streamed by each warp alone from
// global memory into registers (no transposes, no shared memory ring); see its note.
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
// Shape: 3 CTAs of 4 warps an SM with a 4-slot ring, the best of the shapes swept (fewer CTAs
// with deeper rings, 512-column units on one 8-warp CTA an SM, 4 CTAs with 3 slots); the epilogue
// is a programmatic dependent launch that does its owner and scale work before its wait. More
// CTAs an SM, not longer contiguous runs, is what the stream wants (benchmarks/NOTES_moe_cuda.md).
#include "ops/grouped_matmul_swiglu_quant/cuda_stream.cuh"

#include <cuda_runtime.h>

#include <cfloat>
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
constexpr int kMaxK = 131071;             // as cuda.cu: exact int32 sums
// The K-major stream (weight_layout 2, [E, N, K]; gmsq_stream_km_kernel): a tile is 16 rows x
// kKmCols GEMM columns x all of K, whose weight bytes are one contiguous run (kKmCols K-byte
// columns); its units are single 64-deep k steps, and each warp streams its own unit range.
// This shape (16 columns, 4 steps in registers, 2 CTAs of 8 warps an SM) and the L2::256B hint
// won over 32-column tiles, fewer steps, L2 prefetches ahead and a cp.async.bulk ring of column
// runs (benchmarks/NOTES_moe_cuda.md).
constexpr int kKmCols = 16;               // GEMM columns of a tile: two n8 MMA tiles
constexpr int kKmNt = kKmCols / 8;
constexpr int kKmWarps = 8;
constexpr int kKmThreads = 32 * kKmWarps;
constexpr int kKmMinCtas = 2;             // <= 128 registers: the load ring lives in them
constexpr int kKmDepth = 4;               // k steps a warp keeps in registers (1 KB of B each)
constexpr int kKmMaxWarps = 8192;         // owners (slots of 16 x kKmCols int32 each)
constexpr int kMaxColTilesKm = 2 * kMaxHalf / kKmCols;  // 3072
constexpr size_t km_smem_bytes(int64_t e) { return (8 * static_cast<size_t>(e + 1) + 15) / 16 * 16; }

// Host-computed split of the problem, passed to both kernels.
struct StreamShape {
  int spu;        // 64-deep k steps a unit (1 for the K-major stream)
  int kchunks;    // units a tile
  int col_tiles;  // ceil(N / tile columns)
  int grid;       // owners of unit ranges (G): CTAs of the stream kernel, warps of the K-major one
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

// The error word (GmsqParams::err, or the workspace's first int when the caller gave none).
__device__ __forceinline__ int* error_word(const GmsqParams& p) {
  return p.err != nullptr ? p.err : static_cast<int*>(p.workspace);
}

__device__ __forceinline__ int* stream_sums(const GmsqParams& p) {
  return reinterpret_cast<int*>(static_cast<char*>(p.workspace) + 16);
}
__device__ __forceinline__ int* stream_slots(const GmsqParams& p) {
  return stream_sums(p) + p.m * p.n;
}

// Both stream kernels' start: let the epilogue launch (it waits itself), build the tile map in
// shared memory (warp 0) and report it; every CTA sees the same map, CTA 0 reports a bad list
// (into the caller's word, which it never clears; or writes the workspace word, so zeroing it for
// this launch). Returns the problem's units (row blocks x column tiles x k
// chunks).
__device__ __forceinline__ int64_t stream_start(const GmsqParams& p, const StreamShape& sh, int* ends_s,
                                                int* blk_s, int* bad_s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int tid = threadIdx.x;
  if (tid == 0) *bad_s = 0;
  __syncthreads();
  if (tid < 32)
    epi::build_tile_map(p.group_list, p.group_list_type, static_cast<int>(p.m), static_cast<int>(p.e),
                        kRows, tid, ends_s, blk_s, bad_s);
  __syncthreads();
  if (blockIdx.x == 0 && tid == 0) {
    if (p.err == nullptr)
      *static_cast<int*>(p.workspace) = *bad_s ? kErrGroupList : 0;
    else if (*bad_s)
      atomicOr(p.err, kErrGroupList);
  }
  return static_cast<int64_t>(blk_s[p.e]) * sh.col_tiles * sh.kchunks;
}

__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    gmsq_stream_kernel(const GmsqParams p, const StreamShape sh) {
  extern __shared__ __align__(128) uint8_t smem[];
  int* ends_s = reinterpret_cast<int*>(smem + kStages * kStage);
  int* blk_s = ends_s + (p.e + 1);
  __shared__ int bad_s;
  const int64_t units = stream_start(p, sh, ends_s, blk_s, &bad_s);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int K = static_cast<int>(p.k);
  const int N = static_cast<int>(p.n);
  const int E = static_cast<int>(p.e);
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

// 16-byte global loads for the K-major stream. Weight bytes are read once: not kept in L1, and
// each request asks L2 for the whole 256-byte run the warp reads over its next steps. x rows are
// re-read by every warp streaming the same row block: kept in L1. `ok` false gives zeros and
// reads nothing (the last k step when K % 64 != 0).
__device__ __forceinline__ uint4 ldg_weight(const int8_t* ptr, bool ok) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
      " mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr), "r"(static_cast<int>(ok)));
  return v;
}
__device__ __forceinline__ uint4 ldg_x(const int8_t* ptr, bool ok) {
  uint4 v;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"
      " mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr), "r"(static_cast<int>(ok)));
  return v;
}

// One k step of a K-major tile in a lane's registers: B of the tile's kKmNt n8 column groups
// (column 8 j + g, bytes k .. k + 15 with k = 64 step + 16 t) and A of rows g and g + 8 (same k).
struct KmStep {
  uint4 b[kKmNt];
  uint4 a0, a1;
};

// The K-major stream (weight_layout 2). Units, tiles and owners as gmsq_stream_kernel's, with
// one 64-deep k step a unit, tiles of 16 rows x kKmCols columns, and warps as owners: warp w of
// G takes units [w U / G, (w + 1) U / G) and so streams whole contiguous tiles (16 K bytes each)
// but for its first and last. No shared memory but the tile map, no barrier after it.
//
// Fragments: lane (g, t) loads 16 bytes k .. k + 15 (k = 64 s + 16 t) of B column 8 j + g and of
// A rows g, g + 8. The MMA of half h (k32 step) takes the lane's words 2h, 2h + 1 as its k slots
// 4t .. 4t + 3 and 4t + 16 .. 4t + 19, in A and in B alike: a relabelling of k common to both
// operands, so the sum over k, an exact int32 sum, is unchanged; each column's 64 k of the step
// are taken exactly once (t covers 16-byte quarters, h the halves of each). Checked against the
// m16n8k32 table by tests/ops/test_moe_kmajor_cuda.py (test_kmajor_stream_fragments_*).
//
// Why it is slower than the [E, K, N] stream: its warps wait on DRAM, with 64 KB an SM in flight
// in registers against the cp.async ring's ~150 KB. Auto runs it where the [E, K, N] stream runs
// (up to 4 rows an expert), where it beats the tiled K-major kernel, so a model packed "ENK" for
// prefill still decodes close to "EKN" (benchmarks/NOTES_moe_cuda.md).
__global__ void __launch_bounds__(kKmThreads, kKmMinCtas)
    gmsq_stream_km_kernel(const GmsqParams p, const StreamShape sh) {
  extern __shared__ __align__(128) uint8_t smem[];
  int* ends_s = reinterpret_cast<int*>(smem);
  int* blk_s = ends_s + (p.e + 1);
  __shared__ int bad_s;
  const int64_t units = stream_start(p, sh, ends_s, blk_s, &bad_s);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int K = static_cast<int>(p.k);
  const int N = static_cast<int>(p.n);
  const int E = static_cast<int>(p.e);
  const int ks_per_tile = sh.kchunks;
  const int64_t owners = units < sh.grid ? units : static_cast<int64_t>(sh.grid);
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kKmWarps + warp;
  if (w >= owners) return;
  const int64_t ubeg = range_start(w, units, owners);
  const int nsteps = static_cast<int>(range_start(w + 1, units, owners) - ubeg);

  // Load cursor: unit ld_ks of tile (ld_rb, ld_ct); lane pointers at k = 16 t of column g of the
  // tile and of rows g, g + 8 of its row block (rows past the block's end read its first row:
  // in bounds, and their sums are never stored).
  int ld_rb, ld_ct, ld_ks;
  {
    const int64_t tile = ubeg / ks_per_tile;
    ld_ks = static_cast<int>(ubeg - tile * ks_per_tile);
    ld_rb = static_cast<int>(tile / sh.col_tiles);
    ld_ct = static_cast<int>(tile - static_cast<int64_t>(ld_rb) * sh.col_tiles);
  }
  const int8_t* ld_w;
  const int8_t* ld_x0;
  const int8_t* ld_x1;
  auto locate = [&](int rb, int& row0, int& rows) {
    const int e = epi::expert_of_block(blk_s, E, rb);
    row0 = ends_s[e] + (rb - blk_s[e]) * kRows;
    rows = min(kRows, ends_s[e + 1] - row0);
    return e;
  };
  auto set_load_tile = [&] {
    int row0, rows;
    const int e = locate(ld_rb, row0, rows);
    ld_w = p.weight + (static_cast<int64_t>(e) * N + ld_ct * kKmCols + g) * K + 16 * t;
    ld_x0 = p.x + static_cast<int64_t>(row0 + (g < rows ? g : 0)) * K + 16 * t;
    ld_x1 = p.x + static_cast<int64_t>(row0 + (g + 8 < rows ? g + 8 : 0)) * K + 16 * t;
  };
  set_load_tile();
  auto load_step = [&](KmStep& st) {
    const int k = ld_ks * 64;
    const bool ok = k + 16 * t < K;
#pragma unroll
    for (int j = 0; j < kKmNt; ++j) st.b[j] = ldg_weight(ld_w + static_cast<int64_t>(8 * j) * K + k, ok);
    st.a0 = ldg_x(ld_x0 + k, ok);
    st.a1 = ldg_x(ld_x1 + k, ok);
    if (++ld_ks == ks_per_tile) {
      ld_ks = 0;
      if (++ld_ct == sh.col_tiles) {
        ld_ct = 0;
        ++ld_rb;
      }
      if (ld_ct == 0) {
        set_load_tile();
      } else {
        ld_w += static_cast<int64_t>(kKmCols) * K;  // the next tile of the same expert
      }
    }
  };

  // Compute cursor: the tile being summed, its first unit and where its sums go.
  int cs_ks = static_cast<int>(ubeg % ks_per_tile);
  bool to_slot = cs_ks != 0;  // only the range's first tile can start before it (file note)
  int cs_tile = static_cast<int>(ubeg / ks_per_tile);  // < 2^31: M N <= 2^24, E <= 1024
  int acc[kKmNt][4];
#pragma unroll
  for (int j = 0; j < kKmNt; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0;

  KmStep ring[kKmDepth];
#pragma unroll
  for (int i = 0; i < kKmDepth; ++i)
    if (i < nsteps) load_step(ring[i]);

  for (int base = 0; base < nsteps; base += kKmDepth) {
#pragma unroll
    for (int i = 0; i < kKmDepth; ++i) {
      const int s = base + i;
      if (s >= nsteps) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t* a0 = reinterpret_cast<const uint32_t*>(&ring[i].a0);
        const uint32_t* a1 = reinterpret_cast<const uint32_t*>(&ring[i].a1);
        const uint32_t a[4] = {a0[2 * h], a1[2 * h], a0[2 * h + 1], a1[2 * h + 1]};
#pragma unroll
        for (int j = 0; j < kKmNt; ++j) {
          const uint32_t* b = reinterpret_cast<const uint32_t*>(&ring[i].b[j]);
          mma_s8(acc[j], a, b[2 * h], b[2 * h + 1]);
        }
      }
      if (s + kKmDepth < nsteps) load_step(ring[i]);
      if (++cs_ks < ks_per_tile && s + 1 < nsteps) continue;
      // The tile ends here (or the range does): store its sums and restart.
      const int rb = cs_tile / sh.col_tiles;
      const int ct = cs_tile - rb * sh.col_tiles;
      int row0, rows;
      locate(rb, row0, rows);
#pragma unroll
      for (int j = 0; j < kKmNt; ++j) {
        const int tcol = 8 * j + 2 * t;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = g + 8 * hh;
          if (r < rows) {
            int* dst = to_slot ? stream_slots(p) + (w * kRows + r) * kKmCols + tcol
                               : stream_sums(p) + static_cast<int64_t>(row0 + r) * N + ct * kKmCols + tcol;
            *reinterpret_cast<int2*>(dst) = make_int2(acc[j][2 * hh], acc[j][2 * hh + 1]);
          }
          acc[j][2 * hh] = 0;
          acc[j][2 * hh + 1] = 0;
        }
      }
      cs_ks = 0;
      to_slot = false;
      ++cs_tile;
    }
  }
}

// The int32 sums of GEMM columns col[c], col[c] + 1 (each even) of row r, row rin of its row
// block: sums[r] plus the partial slots (16 x TC int32 each) of the later owners c0[ct] + 1 ..
// c0[ct] + extra[ct] of the column's tile (see the file note). TC: tile columns. The slot loads
// of all NC columns go out four owners at a time, so a tile split over a few owners costs one
// L2 round trip, not one per owner (8 experts at 16 tokens: ~4 owners a tile).
template <int TC, int NC>
__device__ __forceinline__ void row_sums(const GmsqParams& p, const int* c0_s, const int* extra_s,
                                         int r, int rin, const int (&col)[NC], int2 (&v)[NC]) {
  const int* slot[NC];
  int extra[NC];
  int most = 0;
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int ct = col[c] / TC;
    v[c] = __ldcg(reinterpret_cast<const int2*>(stream_sums(p) + static_cast<int64_t>(r) * p.n + col[c]));
    extra[c] = extra_s[ct];
    slot[c] = stream_slots(p) + (static_cast<int64_t>(c0_s[ct] + 1) * kRows + rin) * TC + col[c] - ct * TC;
    most = max(most, extra[c]);
  }
  for (int i = 0; i < most; i += 4) {
    int2 o[NC][4];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        o[c][q] = i + q < extra[c]
                      ? __ldcg(reinterpret_cast<const int2*>(slot[c] + static_cast<int64_t>(i + q) * kRows * TC))
                      : make_int2(0, 0);
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        v[c].x += o[c][q].x;
        v[c].y += o[c][q].y;
      }
  }
}

// One CTA a row; each thread owns pairs of output columns (2 j, 2 j + 1), so a row's work is
// spread over up to 1024 threads: the tail after the stream is one L2 round trip, one SwiGLU
// and one block max deep (fewer threads, each with more columns and its own owner arithmetic,
// left a tail several microseconds long).
// Dynamic shared memory: s_out (N/2 floats, the SwiGLU mode only), then the owners c0_s and
// extra_s of the row block's column tiles (sh.col_tiles ints each).
template <bool DEQUANT, int TC>
__global__ void __launch_bounds__(kEpiMaxThreads)
    gmsq_stream_epilogue(const GmsqParams p, const StreamShape sh) {
  extern __shared__ float s_out[];  // [N/2] a row's SwiGLU outputs
  __shared__ int ends_s[kGmsqMaxExperts + 1];
  __shared__ int blk_s[kGmsqMaxExperts + 1];
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
  int* c0_s = reinterpret_cast<int*>(s_out + (DEQUANT ? 0 : half));
  int* extra_s = c0_s + sh.col_tiles;
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
#pragma unroll 1
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
    const float* bias = p.bias != nullptr ? p.bias + static_cast<int64_t>(e) * N : nullptr;
    if (!waited) {
      for (int i = tid; i < N / 32; i += nt)  // the row's weight scales, 128-byte lines
        asm volatile("prefetch.global.L1 [%0];\n" ::"l"(wsr + 32 * i));
      wait_stream();
    }
    if constexpr (DEQUANT) {
      // y = ((float32(acc) * x_scale) * w_scale) + bias (overflow gives Inf: no error, as cuda.cu).
      for (int j = tid; j < pairs; j += nt) {
        const int cols[1] = {2 * j};
        int2 vs[1];
        row_sums<TC, 1>(p, c0_s, extra_s, r, rin, cols, vs);
        const int2 v = vs[0];
        const float2 w = *reinterpret_cast<const float2*>(wsr + 2 * j);
        *reinterpret_cast<float2*>(p.y_float + static_cast<int64_t>(r) * N + 2 * j) =
            make_float2(epi::plus_bias(__fmul_rn(__fmul_rn(__int2float_rn(v.x), xs), w.x), bias, 2 * j),
                        epi::plus_bias(__fmul_rn(__fmul_rn(__int2float_rn(v.y), xs), w.y), bias,
                                       2 * j + 1));
      }
      continue;
    }
    float m = 0.0f;
    bool nonfinite = false;
    for (int j = tid; j < pairs; j += nt) {
      const int cols[2] = {2 * j, half + 2 * j};
      int2 vs[2];
      row_sums<TC, 2>(p, c0_s, extra_s, r, rin, cols, vs);
      const int2 va = vs[0], vg = vs[1];
      const float2 wa = *reinterpret_cast<const float2*>(wsr + 2 * j);
      const float2 wg = *reinterpret_cast<const float2*>(wsr + half + 2 * j);
      auto c_of = [&](int v, float w, int col) {  // ((float32(acc) * xs) * ws) + bias
        return epi::plus_bias(__fmul_rn(__fmul_rn(__int2float_rn(v), xs), w), bias, col);
      };
      const float ca0 = c_of(va.x, wa.x, 2 * j);
      const float ca1 = c_of(va.y, wa.y, 2 * j + 1);
      const float cg0 = c_of(vg.x, wg.x, half + 2 * j);
      const float cg1 = c_of(vg.y, wg.y, half + 2 * j + 1);
      if (!isfinite(ca0) || !isfinite(cg0) || !isfinite(ca1) || !isfinite(cg1)) nonfinite = true;
      const float v0 = epi::activation_f32(p, ca0, cg0);
      const float v1 = epi::activation_f32(p, ca1, cg1);
      if (!isfinite(v0) || !isfinite(v1)) nonfinite = true;  // s * g overflowed: refused
      s_out[2 * j] = v0;
      s_out[2 * j + 1] = v1;
      m = fmaxf(m, fmaxf(fabsf(v0), fabsf(v1)));
    }
    if (nonfinite) atomicOr(error_word(p), kErrNonFinite);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red_s[tid >> 5] = m;
    __syncthreads();
    // Every warp reduces the per-warp maxima itself (one read a lane and five shuffles, not a
    // serial loop over up to 32 of them): the max is exact in any order.
    float amax = lane < nt / 32 ? red_s[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.0f ? fminf(__fdiv_rn(127.0f, amax), FLT_MAX) : 0.0f;  // saturated: DESIGN.md
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
  int grid = 0;     // most stream CTAs (SM count x resident CTAs a SM at E = 1): the slots sized
  int km_grid = 0;  // most K-major stream warps (its owners), likewise
  int sms = 0;
  int major = 0;
  cudaError_t err = cudaSuccess;
};

constexpr size_t kEpiMaxSmem = 4 * static_cast<size_t>(kMaxHalf) + 8 * static_cast<size_t>(kMaxColTilesKm);

template <bool DEQUANT, int TC>
cudaError_t allow_epilogue_smem() {
  return cudaFuncSetAttribute(gmsq_stream_epilogue<DEQUANT, TC>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kEpiMaxSmem));
}

// Per device, once: the kernels' shared-memory limits and the stream grids.
DeviceInfo device_info() {
  static std::mutex mu;
  static DeviceInfo cache[64];
  static bool done[64] = {};
  int device = 0;
  DeviceInfo di;
  if ((di.err = cudaGetDevice(&device)) != cudaSuccess) return di;
  if (device < 0 || device >= 64) return DeviceInfo{0, 0, 0, 0, cudaErrorInvalidDevice};
  std::lock_guard<std::mutex> lock(mu);
  if (!done[device]) {
    int per_sm = 0, km_per_sm = 0;
    di.err = cudaFuncSetAttribute(gmsq_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem_bytes(kGmsqMaxExperts)));
    if (di.err == cudaSuccess) di.err = allow_epilogue_smem<false, kCols>();
    if (di.err == cudaSuccess) di.err = allow_epilogue_smem<true, kCols>();
    if (di.err == cudaSuccess) di.err = allow_epilogue_smem<false, kKmCols>();
    if (di.err == cudaSuccess) di.err = allow_epilogue_smem<true, kKmCols>();
    if (di.err == cudaSuccess)
      di.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gmsq_stream_kernel, kThreads,
                                                             smem_bytes(1));
    if (di.err == cudaSuccess)
      di.err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&km_per_sm, gmsq_stream_km_kernel,
                                                             kKmThreads, km_smem_bytes(1));
    if (di.err == cudaSuccess)
      di.err = cudaDeviceGetAttribute(&di.sms, cudaDevAttrMultiProcessorCount, device);
    if (di.err == cudaSuccess)
      di.err = cudaDeviceGetAttribute(&di.major, cudaDevAttrComputeCapabilityMajor, device);
    di.grid = std::min(kMaxCtas, std::max(1, di.sms * per_sm));
    di.km_grid = std::min(kKmMaxWarps, std::max(1, di.sms * km_per_sm) * kKmWarps);
    cache[device] = di;
    done[device] = true;
  }
  return cache[device];
}

template <bool DEQUANT, int TC>
cudaError_t launch_epilogue(const GmsqParams& p, const StreamShape& sh, int major,
                            cudaStream_t stream) {
  // The epilogue: a programmatic dependent launch on sm_90 (see the file note).
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(p.m, 65535)));
  const int64_t pairs = (DEQUANT ? p.n : p.n / 2) / 2;
  cfg.blockDim = dim3(static_cast<unsigned>(std::min<int64_t>(kEpiMaxThreads, (pairs + 31) / 32 * 32)));
  cfg.dynamicSmemBytes = (DEQUANT ? 0 : 4 * static_cast<size_t>(p.n / 2)) + 8 * static_cast<size_t>(sh.col_tiles);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (major >= 9) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, gmsq_stream_epilogue<DEQUANT, TC>, p, sh);
}

}  // namespace

size_t gmsq_stream_workspace_bytes(int64_t m, int64_t n) {
  if (m <= 0 || n <= 0 || m * n > kMaxSums || n / 2 > kMaxHalf) return 0;
  const DeviceInfo di = device_info();
  if (di.err != cudaSuccess) return 0;
  const size_t slots = std::max(static_cast<size_t>(di.grid) * kRows * kCols,
                                static_cast<size_t>(di.km_grid) * kRows * kKmCols);
  return 16 + 4 * static_cast<size_t>(m * n) + 4 * slots;
}

cudaError_t launch_gmsq_stream(const GmsqParams& p, bool dequant, cudaStream_t stream) {
  const bool km = p.weight_layout == kGmsqLayoutKMajor;
  if ((p.weight_layout != 0 && !km) || p.m <= 0 || p.n <= 0 || p.e <= 0 || p.k <= 0 ||
      p.k > kMaxK || p.k % 16 != 0 || p.n % 32 != 0 || p.e > kGmsqMaxExperts ||
      gmsq_stream_workspace_bytes(p.m, p.n) == 0)
    return cudaErrorInvalidValue;
  const DeviceInfo di = device_info();
  if (di.err != cudaSuccess) return di.err;
  StreamShape sh;
  const int steps = static_cast<int>((p.k + kBK - 1) / kBK);
  cudaError_t err;
  if (km) {
    sh.spu = 1;
    sh.kchunks = steps;
    sh.col_tiles = static_cast<int>(p.n / kKmCols);
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gmsq_stream_km_kernel, kKmThreads,
                                                        km_smem_bytes(p.e));
    if (err != cudaSuccess) return err;
    sh.grid = std::min(di.km_grid, std::max(1, di.sms * per_sm) * kKmWarps);  // <= the slots
    gmsq_stream_km_kernel<<<sh.grid / kKmWarps, kKmThreads, km_smem_bytes(p.e), stream>>>(p, sh);
  } else {
    sh.spu = (steps + kChunksPerTile - 1) / kChunksPerTile;
    sh.kchunks = (steps + sh.spu - 1) / sh.spu;
    sh.col_tiles = static_cast<int>((p.n + kCols - 1) / kCols);
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gmsq_stream_kernel, kThreads,
                                                        smem_bytes(p.e));
    if (err != cudaSuccess) return err;
    sh.grid = std::min(di.grid, std::max(1, di.sms * per_sm));  // <= the slots the workspace has
    gmsq_stream_kernel<<<sh.grid, kThreads, smem_bytes(p.e), stream>>>(p, sh);
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (km)
    return dequant ? launch_epilogue<true, kKmCols>(p, sh, di.major, stream)
                   : launch_epilogue<false, kKmCols>(p, sh, di.major, stream);
  return dequant ? launch_epilogue<true, kCols>(p, sh, di.major, stream)
                 : launch_epilogue<false, kCols>(p, sh, di.major, stream);
}

}  // namespace ort_ops::gmsq_cuda
