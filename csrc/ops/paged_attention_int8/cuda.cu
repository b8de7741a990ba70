// SPDX-License-Identifier: MIT
// PagedAttentionInt8 kernels for NVIDIA tensor cores (sm_80+: mma.sync m16n8k32 s8/u8).
// Spec: ort_ops/ops/paged_attention_int8.py; launcher contract: cuda.cuh.
//
// Decode with G <= 8 and D 32 / 64 / 128 runs decode_warp_kernel (below: warps with their own key
// stages, no CTA barrier per stage); everything else runs paged_attention_kernel, described here.
// One CTA (8 warps; 4 at D 32) = one row tile x one kv head x one split of the keys. A row tile
// is up to 16 (query, q head) rows that read the same kv head: decode puts the GQA group of one
// query there, so every K/V byte read serves the whole group; prefill packs 16 / G queries x G
// heads. A split is a run of partition_size-key partitions (the launcher picks the split count
// by a wave model; one split per row tile when that fills the GPU, as at batch 32). The CTA
// streams its keys in stages of KT keys (128; 64 for D 256) through shared memory with cp.async
// 16-byte copies, two stages in flight, and for each stage:
//   phase 1  Q.K on m16n8k32 s8: lane (g, t) reads D/4 consecutive bytes of key row g of an
//            8-key tile and the A fragment holds the same d slice of Q; the d order inside the
//            MMA is a relabelling of the reduction axis, so the dot product is unchanged.
//            Scores (int32 * sQ * sK * scale, causal mask) go to shared memory.
//   phase 2  each row's stage max -> alpha = exp(M - M'), beta = exp(m - M') (online softmax
//            across stages; a group's codes do not change under a common factor, DESIGN.md)
//   phase 3  e = exp(s - m_stage), W = e * sV, per 32-key group max -> codes rint(W * L / max),
//            group scale max / L * beta; row sums kept per thread.
//   phase 4  P.V on m16n8k32 (s8 x s8 or u8 x s8): warp w of W owns D/W output columns; lane
//            (g, t) reads V keys 16t..16t+15 of column g (one 16-byte read of the token-innermost
//            layout) and swaps halves with lane t^2 so that MMA i consumes exactly keys
//            32i..32i+31 of the 64-key tile (fragment_map.h, proven by tests/test_fragments.py).
//            Each group's int32 sum is scaled by its own group scale (V scales were folded
//            into W in phase 3) and accumulated in float32.
// pv_quant none is the float P.V twin: the same kernel with W / max in fp16 on m16n8k16 and V
// codes converted to fp16 (exact), so INT8 and float P.V differ only in the P.V instruction.
// With more than one split per row tile, each split writes O / l, m, l and a merge kernel
// combines them by log-sum-exp; with one split the output is written directly.
// Window, softcap, sink (DESIGN.md): scores are soft-capped where they are made; the window is a
// lower mask bound beside the causal one, and keys before the first row's window start are not
// loaded (their blocks may lie wholly before the window: neither the block-table entry nor the
// block is read); decode splits start at the window's aligned start (tile_shape splits the
// window's span). The sink enters only the final denominator: O / (l + exp(sink - m)) where the
// output is written, or in the merge kernel when the keys were split.
// No full-precision copy of K or V exists anywhere: codes go from memory to the tensor cores.
// Steps (each __forceinline__; those shared with cuda_prefill.cu are in cuda_steps.cuh):
//   paged_attention_kernel: general_work, GenLoader (block ids and stage copies), general_row,
//     per stage general_scores (phase 1), general_codes (phases 2+3), general_rescale_o and
//     general_pv_tile (phase 4); then general_row_sums and general_write_out.
//   decode_warp_kernel: warp_decode_work, WdIds (raw block ids), warp_decode_query_row, WdLoader
//     (stage copies), per stage warp_decode_stage (warp_decode_scores, rescale_row,
//     group_weights8, warp_decode_pv), or per two stages warp_decode_stage2 (the dual loop: D 64
//     with shared 64-key stages); then warp_decode_merge_out.
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/launch.cuh"
#include "ops/paged_attention_int8/cuda.cuh"
#include "ops/paged_attention_int8/cuda_device.cuh"
#include "ops/paged_attention_int8/cuda_prefill.cuh"
#include "ops/paged_attention_int8/cuda_steps.cuh"
#include "ops/paged_attention_int8/fragment_map.h"

namespace ort_ops {
namespace {

constexpr int kRows = 16;           // rows of one MMA tile
constexpr float kNegInf = -__builtin_huge_valf();

using pa_fragment::kPvSwapXor;

// First key of the 8 that lane quad index t feeds into a group's MMA: t = 0..3 -> 0, 16, 8, 24.
// The fragment model (ort_ops/fragments.py) generates fragment_map.h; the kernel computes the
// same table arithmetically and these asserts keep the two identical.
__host__ __device__ constexpr int pv_token_base(int t) { return ((t & 1) << 4) | ((t >> 1) << 3); }
static_assert(pv_token_base(0) == pa_fragment::kPvTokenBase[0] && pv_token_base(1) == pa_fragment::kPvTokenBase[1] &&
                  pv_token_base(2) == pa_fragment::kPvTokenBase[2] && pv_token_base(3) == pa_fragment::kPvTokenBase[3],
              "fragment_map.h and the kernel disagree on the P.V token placement");
static_assert(kPvSwapXor == 2 && pa_fragment::kGroupTokens == 32 && pa_fragment::kTileTokens == 64,
              "the kernel's swap (t < 2 keeps x0,x1) assumes the half swap with lane t ^ 2");

// ---- shared-memory layout (host and device agree) ----
// Keys move through the CTA in stages of KT keys, two stages in flight (cp.async, 16-byte
// copies): while the tensor cores work on stage j, stage j+1 is on its way from memory. A stage
// holds the INT8 K rows, the INT8 V columns (token innermost, as in the cache) and both
// per-token scales; nothing is widened on the way.
template <int D, int R>
struct Cfg {
  // Warps per CTA and keys per stage: 8 warps with 128-key stages, so that two or three CTAs are
  // resident per SM (while one CTA waits at a barrier, the others issue: more resident CTAs beat
  // one CTA of 16 warps with longer stages; benchmarks/NOTES_attention_cuda.md). R = rows of
  // the row tile (8 for decode with G <= 8, else 16) sizes the score/code buffers, so that a
  // decode CTA fits three to an SM (<= 76 KB of shared memory, <= 85 registers). D 32 takes 4
  // warps: P.V gives each warp whole 8-column n-tiles of the output, and D 32 has only 4.
  static constexpr int W = D >= 64 ? 8 : 4;
  static constexpr int THREADS = 32 * W;
  static constexpr int MIN_BLOCKS = D >= 256 ? 1 : (R <= 8 ? 3 : 2);
  static constexpr int KT = D >= 256 ? 64 : 128;  // keys per stage
  static constexpr int KS = D;  // K row stride (2-way conflicts in the small phase-1 reads; saves 2 KB/stage)
  // V: the stage's 64-key tiles one after another, each [D][64]: a row of 64 bytes, so the two
  // rows of a quarter-warp's 16-byte reads start 16 banks apart (conflict-free, no padding).
  static constexpr int K_OFF = 0;
  static constexpr int V_OFF = K_OFF + KT * KS;
  static constexpr int SK_OFF = V_OFF + D * KT;
  static constexpr int SV_OFF = SK_OFF + KT * 4;
  static constexpr int STAGE = SV_OFF + KT * 4;
  static constexpr int S_STRIDE = KT + 8;  // floats per score row; +8: float2 stores of a half-warp conflict-free
  static constexpr int G_STRIDE = KT / 32;
  static constexpr int c_stride(bool fp16) {  // = 32 (int8) / 64 (fp16) mod 128: fragment reads conflict-free
    return fp16 ? (2 * KT + 127) / 128 * 128 + 64 : (KT + 127) / 128 * 128 + 32;
  }
  static constexpr int S_OFF = 2 * STAGE;
  static constexpr int C_OFF = S_OFF + R * S_STRIDE * 4;
  static constexpr int g_off(bool fp16) { return C_OFF + R * c_stride(fp16); }
  static constexpr int misc_off(bool fp16) { return g_off(fp16) + R * G_STRIDE * 4; }
  // misc: red_max[W][16], red_sum[W][16], m[2][16], l (16), lim (16 ints)
  static constexpr int bytes(bool fp16) { return misc_off(fp16) + (2 * W * kRows + 6 * kRows) * 4; }
};
static_assert(3 * (Cfg<128, 8>::bytes(false) + 1024) <= kSm90SmemPerSm, "three decode CTAs per SM (D 128, int8 P.V)");

struct TileShape {
  int n_qt, n_ht, hpt, qpt, nsplit, ppc;
};

// ---- the general kernel's steps ----
// The CTA's work: (sequence, kv head, head tile, row tile, split), its query rows and keys.
struct Work {
  int s, h, ht, qtile, split;
  int q_start, q_len, seq_len;
  int rows_used;         // rows of the tile: qpt queries x hpt heads
  int k_first;           // the tile's first query's window start (0 without a window)
  int k_lo, k_hi, nstages;  // this split's keys the tile sees: [k_lo, k_hi), in stages of KT
};

// Decodes blockIdx.x (row tile fastest) and checks the sequence's rows and length. Returns false
// when the CTA has nothing to do (a tile past the sequence's queries, or a flagged bad input).
template <int KT>
__device__ __forceinline__ bool general_work(const PagedAttentionParams& p, const TileShape& ts, int Hkv, int B,
                                             int partition, int tid, Work& w) {
  int64_t idx = blockIdx.x;
  w.qtile = static_cast<int>(idx % ts.n_qt);
  idx /= ts.n_qt;
  w.split = static_cast<int>(idx % ts.nsplit);
  idx /= ts.nsplit;
  w.ht = static_cast<int>(idx % ts.n_ht);
  idx /= ts.n_ht;
  w.h = static_cast<int>(idx % Hkv);
  w.s = static_cast<int>(idx / Hkv);
  if (p.cu_seqlens_q != nullptr) {
    if (!read_cu_seqlens(p, w.s, w.q_start, w.q_len)) {
      if (tid == 0) atomicOr(p.status, kPaCuSeqlensBad);
      return false;
    }
  } else {
    w.q_start = w.s;
    w.q_len = 1;
  }
  w.rows_used = ts.qpt * ts.hpt;
  if (w.qtile * ts.qpt >= w.q_len) return false;
  w.seq_len = p.seq_lens[w.s];
  // The tile's first query sees keys from k_first on (window; 0 without). Decode splits start at
  // its 32-aligned start (tile_shape splits the window's span); prefill splits stay absolute.
  w.k_first = window_first(static_cast<int64_t>(w.seq_len) - w.q_len + w.qtile * ts.qpt, p.window);
  const int k_base = p.max_q_len == 1 ? (w.k_first & ~31) : 0;
  if (w.seq_len < w.q_len || w.seq_len > p.max_blocks * B ||
      w.seq_len - k_base > static_cast<int64_t>(ts.nsplit) * ts.ppc * partition) {
    if (tid == 0) atomicOr(p.status, kPaSeqLenOutOfRange);
    return false;
  }
  const int last_q = min(w.q_len - 1, w.qtile * ts.qpt + ts.qpt - 1);
  const int key_hi = w.seq_len - w.q_len + last_q + 1;  // keys this tile can see: [0, key_hi)
  const int k_split = k_base + w.split * ts.ppc * partition;
  w.k_hi = min(k_split + ts.ppc * partition, key_hi);
  w.k_lo = max(k_split, w.k_first & ~31);
  w.nstages = w.k_hi > w.k_lo ? (w.k_hi - w.k_lo + KT - 1) / KT : 0;
  return true;
}

// Row r -> (query token, q head) and the keys it sees, [0, returned limit); rows past the tile
// or the group see no keys (token and head -1).
__device__ __forceinline__ int general_row(const Work& w, const TileShape& ts, int G, int r, int& token, int& head) {
  token = -1;
  head = -1;
  if (r >= w.rows_used) return 0;
  const int qi = w.qtile * ts.qpt + r / ts.hpt;
  const int hl = w.ht * kRows + r % ts.hpt;
  if (qi >= w.q_len || hl >= G) return 0;
  token = w.q_start + qi;
  head = w.h * G + hl;
  return w.seq_len - w.q_len + qi + 1;
}

// The CTA's shared memory past the two stages (Cfg's layout).
struct GenSmem {
  float* s_sm;           // scores [R][S_STRIDE]
  unsigned char* c_sm;   // P codes [R][c_stride]
  float* g_sm;           // group scales [R][G_STRIDE]
  float* red_max;        // [W][16] per-warp row maxima
  float* red_sum;        // [W][16] per-warp row sums
  float* row_m;          // [2][16]: running max before / after a stage
  float* row_l;          // [16]
  int* row_lim;          // [16]
};

template <typename C, bool kF16>
__device__ __forceinline__ GenSmem general_smem(unsigned char* smem) {
  GenSmem m;
  m.s_sm = reinterpret_cast<float*>(smem + C::S_OFF);
  m.c_sm = smem + C::C_OFF;
  m.g_sm = reinterpret_cast<float*>(smem + C::g_off(kF16));
  m.red_max = reinterpret_cast<float*>(smem + C::misc_off(kF16));
  m.red_sum = m.red_max + C::W * kRows;
  m.row_m = m.red_sum + C::W * kRows;
  m.row_l = m.row_m + 2 * kRows;
  m.row_lim = reinterpret_cast<int*>(m.row_l + 3 * kRows);
  return m;
}

// ---- stage loads: block ids one stage ahead (registers), data two stages ahead (cp.async) ----
// Each thread moves NKC K chunks (chunk c = tid + kThreads * i: key c / (D/16), 16 bytes at
// (c % (D/16)) * 16, so 8 consecutive lanes read one 128-byte key row), one 16-key V segment
// of NVC columns (8 lanes: 128 contiguous bytes of one V row) and, for tid < KT / 2, one 4-key
// scale chunk. Block ids are looked up one stage ahead.
template <int D, int R>
struct GenLoader {
  using C = Cfg<D, R>;
  static constexpr int KT = C::KT;
  static constexpr int kThreads = C::THREADS;
  static constexpr int NKC = KT * D / 16 / kThreads;  // 16-byte K chunks per thread per stage
  static constexpr int NVC = D * KT / 16 / kThreads;  // 16-byte V chunks per thread per stage (one segment)
  static constexpr int SEGS = KT / 16;                // 16-key segments of a V row in a stage
  static constexpr int kTokStep = kThreads / (D / 16);
  static_assert(NKC >= 1 && NVC >= 1 && kThreads % SEGS == 0 && kThreads % (D / 16) == 0, "stage shape");
  struct Ids {
    int k[NKC];
    int v, sc;
  };

  const PagedAttentionParams& p;
  unsigned char* smem;
  const int32_t* bt;
  int64_t blk_stride;  // bytes per cache block (K or V)
  int tid, h, Hkv, B, lb, k_first, k_lo, k_hi, nstages;
  int ktok, kpart, vseg, vd0, stok;

  __device__ __forceinline__ GenLoader(const PagedAttentionParams& p_, const Work& w, int Hkv_, int B_,
                                       unsigned char* smem_, int tid_)
      : p(p_), smem(smem_), tid(tid_) {
    h = w.h;
    B = B_;
    Hkv = Hkv_;
    bt = p.block_tables + static_cast<int64_t>(w.s) * p.max_blocks;
    blk_stride = static_cast<int64_t>(Hkv) * B * D;
    lb = p.log2_block_size;
    k_first = w.k_first;
    k_lo = w.k_lo;
    k_hi = w.k_hi;
    nstages = w.nstages;
    ktok = tid / (D / 16);
    kpart = tid % (D / 16);
    vseg = tid % SEGS;
    vd0 = tid / SEGS;
    stok = 4 * (tid % (KT / 4));
  }

  __device__ __forceinline__ int block_of(int pos) const {  // block of a visible position, or -1 (flagged)
    const int b = bt[pos >> lb];
    if (b < 0 || b >= p.num_blocks) {
      atomicOr(p.status, kPaBlockOutOfRange);
      return -1;
    }
    return b;
  }

  __device__ __forceinline__ void load_ids(int j, Ids& ids) const {
    const int kp0 = k_lo + j * KT;
    const int kend = min(kp0 + KT, k_hi);
    const bool live = j < nstages;
#pragma unroll
    for (int i = 0; i < NKC; ++i) {
      const int pos = kp0 + ktok + kTokStep * i;
      ids.k[i] = (live && pos < kend && pos >= k_first) ? block_of(pos) : -1;
    }
    // Segments and scale chunks wholly before the window are not read (zero filled, masked).
    ids.v = (live && kp0 + 16 * vseg < kend && kp0 + 16 * vseg + 16 > k_first) ? block_of(kp0 + 16 * vseg) : -1;
    ids.sc = (live && tid < KT / 2 && kp0 + stok < kend && kp0 + stok + 4 > k_first) ? block_of(kp0 + stok) : -1;
  }

  // Stage j's copies into slot j & 1 and their commit group.
  __device__ __forceinline__ void issue(int j, const Ids& ids) const {
    unsigned char* st = smem + (j & 1) * C::STAGE;
    const int kp0 = k_lo + j * KT;
#pragma unroll
    for (int i = 0; i < NKC; ++i) {
      const int tok = ktok + kTokStep * i;
      const bool ok = ids.k[i] >= 0;
      const int8_t* src = ok ? p.key_cache + ids.k[i] * blk_stride +
                                   (static_cast<int64_t>(h) * B + ((kp0 + tok) & (B - 1))) * D + kpart * 16
                             : p.key_cache;
      cp_async16(st + C::K_OFF + tok * C::KS + kpart * 16, src, ok);
    }
    {
      const bool ok = ids.v >= 0;
      const int8_t* src = ok ? p.value_cache + ids.v * blk_stride +
                                   (static_cast<int64_t>(h) * D + vd0) * B + ((kp0 + 16 * vseg) & (B - 1))
                             : p.value_cache;
      const int64_t src_step = static_cast<int64_t>(kThreads / SEGS) * B;
      unsigned char* dst = st + C::V_OFF + (vseg >> 2) * (D * 64) + vd0 * 64 + 16 * (vseg & 3);
#pragma unroll
      for (int i = 0; i < NVC; ++i)
        cp_async16(dst + i * (kThreads / SEGS) * 64, ok ? src + i * src_step : src, ok);
    }
    if (tid < KT / 2) {
      const bool is_v = tid >= KT / 4;
      const bool ok = ids.sc >= 0;
      const float* base = is_v ? p.value_scale : p.key_scale;
      const float* src = ok ? base + (static_cast<int64_t>(ids.sc) * Hkv + h) * B + ((kp0 + stok) & (B - 1)) : base;
      cp_async16(st + (is_v ? C::SV_OFF : C::SK_OFF) + stok * 4, src, ok);
    }
    cp_async_commit();
  }
};

// Phase 1: scores of the stage's keys into shared memory (warp w takes 8-key n-tiles w, w + W,
// ...; rows g and g+8 of lane (g, t)), each warp's row maxima into red_max.
template <int D, bool ROWS16>
__device__ __forceinline__ void general_scores(const PagedAttentionParams& p, const unsigned char* st, const GenSmem& sm,
                                               int kp0, int kend, const uint32_t (&qa)[ROWS16 ? 2 : 1][D / 16],
                                               const float (&sq)[ROWS16 ? 2 : 1], const int (&lim)[ROWS16 ? 2 : 1],
                                               const int (&wlo)[ROWS16 ? 2 : 1], int warp, int g, int t) {
  using C = Cfg<D, ROWS16 ? 16 : 8>;
  constexpr int kWarps = C::W;
  constexpr int kRi = ROWS16 ? 2 : 1;
  const unsigned char* k_sm = st + C::K_OFF;
  const float* sk_sm = reinterpret_cast<const float*>(st + C::SK_OFF);
  float pmax[kRi];
#pragma unroll
  for (int ri = 0; ri < kRi; ++ri) pmax[ri] = kNegInf;
  const int n8 = (kend - kp0 + 7) / 8;
#pragma unroll
  for (int u = 0; u < (C::KT / 8 + kWarps - 1) / kWarps; ++u) {
    const int nt = warp + kWarps * u;
    if (nt >= n8) break;  // warp-uniform
    uint32_t kw[D / 16];
    load_k_slice<D>(k_sm + (nt * 8 + g) * C::KS + t * (D / 4), kw);
    int acc[4] = {0, 0, 0, 0};
#pragma unroll
    for (int c = 0; c < D / 32; ++c)
      mma_i8<false>(acc, qa[0][2 * c], ROWS16 ? qa[kRi - 1][2 * c] : 0u, qa[0][2 * c + 1],
                    ROWS16 ? qa[kRi - 1][2 * c + 1] : 0u, kw[2 * c], kw[2 * c + 1]);
    const int kc = nt * 8 + 2 * t;  // this lane's two score columns (stage offsets)
    const float2 sk = *reinterpret_cast<const float2*>(sk_sm + kc);
#pragma unroll
    for (int ri = 0; ri < kRi; ++ri) {
      const int lim_rel = min(lim[ri], kend) - kp0, lo_rel = wlo[ri] - kp0;
      const float s0 = kc < lim_rel && kc >= lo_rel
                           ? qk_score(static_cast<float>(acc[2 * ri]), sq[ri], sk.x, p.scale, p.softcap)
                           : kNegInf;
      const float s1 = kc + 1 < lim_rel && kc + 1 >= lo_rel
                           ? qk_score(static_cast<float>(acc[2 * ri + 1]), sq[ri], sk.y, p.scale, p.softcap)
                           : kNegInf;
      pmax[ri] = fmaxf(pmax[ri], fmaxf(s0, s1));
      *reinterpret_cast<float2*>(sm.s_sm + (g + 8 * ri) * C::S_STRIDE + kc) = make_float2(s0, s1);
    }
  }
#pragma unroll
  for (int ri = 0; ri < kRi; ++ri) {
    const float m = warp_max4(pmax[ri]);
    if (t == 0) sm.red_max[warp * kRows + g + 8 * ri] = m;
  }
  if (!ROWS16 && t == 0) sm.red_max[warp * kRows + g + 8] = kNegInf;
}

// Phases 2+3 for one row r and its 4 keys 4c .. 4c+3: the row's stage max from the per-warp
// maxima, alpha = exp(M - M'), beta = exp(m - M'); e = exp(s - m_stage), W = e * sV, the 32-key
// group's max over 8 threads -> codes and the group scale. Every thread derives these itself
// (no extra barrier); row_m is double-buffered by stage parity so the old M stays readable
// while the new one is written. lacc: the thread's part of the row sum, rescaled by alpha.
template <int D, PvQuant PV, bool ROWS16>
__device__ __forceinline__ void general_codes(const PagedAttentionParams& p, const unsigned char* st,
                                              const GenSmem& sm, const float* m_old, float* m_new, int r, int c,
                                              bool row_ok, int kp0, int kend, float& lacc) {
  using C = Cfg<D, ROWS16 ? 16 : 8>;
  constexpr bool kF16 = PV == PvQuant::kNone;
  constexpr float kLevels = PV == PvQuant::kU8 ? 255.0f : 127.0f;
  constexpr int CS = C::c_stride(kF16);
  const float* sv_sm = reinterpret_cast<const float*>(st + C::SV_OFF);
  const int k = 4 * c;
  float mp = kNegInf, mo = kNegInf;
  int lim_rel = 0, lo_rel = 0;
  if (row_ok) {
#pragma unroll
    for (int i = 0; i < C::W; ++i) mp = fmaxf(mp, sm.red_max[i * kRows + r]);
    mo = m_old[r];
    lim_rel = min(sm.row_lim[r], kend) - kp0;
    lo_rel = window_first(sm.row_lim[r] - 1, p.window) - kp0;
  }
  const float mn = fmaxf(mo, mp);
  const float alpha = mo == kNegInf ? 0.0f : __expf(mo - mn);
  const float beta = mp == kNegInf ? 0.0f : __expf(mp - mn);
  if (row_ok && c == 0) m_new[r] = mn;
  float wv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float esum = 0.0f;
  if (k < lim_rel && k + 3 >= lo_rel) {
    const float4 sc = *reinterpret_cast<const float4*>(sm.s_sm + r * C::S_STRIDE + k);
    const float4 sv = *reinterpret_cast<const float4*>(sv_sm + k);
    const float scv[4] = {sc.x, sc.y, sc.z, sc.w};
    const float svv[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      if (k + jj < lim_rel && k + jj >= lo_rel) {
        const float e = __expf(scv[jj] - mp);  // ex2.approx: a few ulp, W codes tolerate it
        esum += e;
        wv[jj] = e * svv[jj];
      }
    }
  }
  lacc = alpha * lacc + beta * esum;
  float gmax = fmaxf(fmaxf(wv[0], wv[1]), fmaxf(wv[2], wv[3]));
  gmax = fmaxf(gmax, __shfl_xor_sync(0xffffffffu, gmax, 1));
  gmax = fmaxf(gmax, __shfl_xor_sync(0xffffffffu, gmax, 2));
  gmax = fmaxf(gmax, __shfl_xor_sync(0xffffffffu, gmax, 4));
  if (!row_ok) return;
  if constexpr (kF16) {
    __half hv[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) hv[jj] = __float2half_rn(gmax > 0.0f ? __fdiv_rn(wv[jj], gmax) : 0.0f);
    *reinterpret_cast<uint2*>(sm.c_sm + r * CS + 2 * k) = *reinterpret_cast<const uint2*>(hv);
    if ((c & 7) == 0) sm.g_sm[r * C::G_STRIDE + (c >> 3)] = gmax * beta;
  } else {
    *reinterpret_cast<uint32_t*>(sm.c_sm + r * CS + k) = codes4_rint(wv, code_inverse(gmax, kLevels), kLevels);
    if ((c & 7) == 0) sm.g_sm[r * C::G_STRIDE + (c >> 3)] = __fdiv_rn(gmax, kLevels) * beta;
  }
}

// Phase 4 for one 64-key tile ti: P.V on the tensor cores. Warp w owns NT 8-column n-tiles of
// the output from dbase; lane (g, t) reads V keys 64ti+16t .. +15 of column g (one 16-byte read)
// and swaps halves with lane t^2 so that MMA grp consumes exactly keys 32grp .. 32grp+31 of the
// tile (fragment_map.h). Each group's sum is scaled by its own group scale.
template <int D, PvQuant PV, bool ROWS16, int NT>
__device__ __forceinline__ void general_pv_tile(const unsigned char* v_sm, const GenSmem& sm, int ti, int dbase, int g,
                                                int t, float (&o)[NT][4]) {
  using C = Cfg<D, ROWS16 ? 16 : 8>;
  constexpr bool kF16 = PV == PvQuant::kNone;
  constexpr int CS = C::c_stride(kF16);
  // A fragments and group scales of the tile's two groups (rows g and g+8).
  uint32_t a[2][kF16 ? 8 : 4];
  float gs[2][2];
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
    const int tok0 = 64 * ti + 32 * grp + pv_token_base(t);
    gs[grp][0] = sm.g_sm[g * C::G_STRIDE + 2 * ti + grp];
    gs[grp][1] = ROWS16 ? sm.g_sm[(g + 8) * C::G_STRIDE + 2 * ti + grp] : 0.0f;
    if constexpr (kF16) {
      const uint4 r0 = *reinterpret_cast<const uint4*>(sm.c_sm + g * CS + 2 * tok0);
      uint4 r1 = make_uint4(0u, 0u, 0u, 0u);
      if (ROWS16) r1 = *reinterpret_cast<const uint4*>(sm.c_sm + (g + 8) * CS + 2 * tok0);
      // k16 MMA #1 takes keys tok0+0..3, #2 takes tok0+4..7 (slots 2t,2t+1 then 2t+8,2t+9).
      a[grp][0] = r0.x; a[grp][1] = r1.x; a[grp][2] = r0.y; a[grp][3] = r1.y;
      a[grp][4] = r0.z; a[grp][5] = r1.z; a[grp][6] = r0.w; a[grp][7] = r1.w;
    } else {
      const uint2 r0 = *reinterpret_cast<const uint2*>(sm.c_sm + g * CS + tok0);
      uint2 r1 = make_uint2(0u, 0u);
      if (ROWS16) r1 = *reinterpret_cast<const uint2*>(sm.c_sm + (g + 8) * CS + tok0);
      a[grp][0] = r0.x; a[grp][1] = r1.x; a[grp][2] = r0.y; a[grp][3] = r1.y;
    }
  }
#pragma unroll
  for (int jn = 0; jn < NT; ++jn) {
    // One 16-byte read: keys 64ti+16t .. +15 of output column dbase + 8jn + g.
    const uint4 x = *reinterpret_cast<const uint4*>(v_sm + ti * (D * 64) + (dbase + 8 * jn + g) * 64 + 16 * t);
    // Lane t < 2 keeps x0,x1 (group 0) and receives the partner's x0,x1 (group 1); lane
    // t >= 2 receives the partner's x2,x3 (group 0) and keeps x2,x3 (group 1).
    const bool lo = t < 2;
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, lo ? x.z : x.x, kPvSwapXor);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, lo ? x.w : x.y, kPvSwapXor);
    const uint32_t b[2][2] = {{lo ? x.x : r0, lo ? x.y : r1}, {lo ? r0 : x.z, lo ? r1 : x.w}};
#pragma unroll
    for (int grp = 0; grp < 2; ++grp) {
      if constexpr (kF16) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        pv_f16_8keys(acc, a[grp][0], a[grp][1], a[grp][2], a[grp][3], a[grp][4], a[grp][5], a[grp][6], a[grp][7],
                     b[grp][0], b[grp][1]);
        o[jn][0] += gs[grp][0] * acc[0];
        o[jn][1] += gs[grp][0] * acc[1];
        o[jn][2] += gs[grp][1] * acc[2];
        o[jn][3] += gs[grp][1] * acc[3];
      } else {
        int acc[4] = {0, 0, 0, 0};
        mma_i8<PV == PvQuant::kU8>(acc, a[grp][0], a[grp][1], a[grp][2], a[grp][3], b[grp][0], b[grp][1]);
        o[jn][0] += gs[grp][0] * static_cast<float>(acc[0]);
        o[jn][1] += gs[grp][0] * static_cast<float>(acc[1]);
        o[jn][2] += gs[grp][1] * static_cast<float>(acc[2]);
        o[jn][3] += gs[grp][1] * static_cast<float>(acc[3]);
      }
    }
  }
}

// Phase 4's first step: O of rows g and g+8 scaled by alpha = exp(M - M') (0 while the row had no key).
template <bool ROWS16, int NT>
__device__ __forceinline__ void general_rescale_o(const float* m_old, const float* m_new, int g, float (&o)[NT][4]) {
  auto alpha_of = [&](int r) {
    const float mo = m_old[r], mn = m_new[r];
    return mo == kNegInf ? 0.0f : __expf(mo - mn);
  };
  const float al0 = alpha_of(g);
  const float al1 = ROWS16 ? alpha_of(g + 8) : 0.0f;
#pragma unroll
  for (int jn = 0; jn < NT; ++jn) {
    o[jn][0] *= al0;
    o[jn][1] *= al0;
    o[jn][2] *= al1;
    o[jn][3] *= al1;
  }
}

// Row sums: each row's per-thread partial l over NCHUNK consecutive threads (whole warps) ->
// red_sum per warp -> row_l.
template <int kThreads, int NCHUNK, int kPasses>
__device__ __forceinline__ void general_row_sums(const GenSmem& sm, const float (&lacc)[kPasses], int tid,
                                                 int rows_used) {
  constexpr int kRowLanes = NCHUNK < 32 ? NCHUNK : 32;  // lanes of one row within a warp
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    float v = lacc[pass];
#pragma unroll
    for (int off = kRowLanes / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int r = pass * (kThreads / NCHUNK) + tid / NCHUNK;
    if (tid % kRowLanes == 0 && r < kRows) sm.red_sum[((tid % NCHUNK) / 32) * kRows + r] = v;
  }
  __syncthreads();
  if (tid < kRows) {
    float l = 0.0f;
#pragma unroll
    for (int i = 0; i < (NCHUNK + 31) / 32; ++i) l += sm.red_sum[i * kRows + tid];
    sm.row_l[tid] = tid < rows_used ? l : 0.0f;
  }
  __syncthreads();
}

// Writes O / l of the lane's rows (the sink joins l with one split; the merge kernel adds it
// otherwise), or the split's partial O and its m, l.
template <int D, int kRi, int NT>
__device__ __forceinline__ void general_write_out(const PagedAttentionParams& p, const TileShape& ts, int split,
                                                  const GenSmem& sm, const float* m_final, const int (&qtok)[kRi],
                                                  const int (&qhead)[kRi], const float (&o)[NT][4], int dbase,
                                                  int warp, int g, int t) {
#pragma unroll
  for (int ri = 0; ri < kRi; ++ri) {
    if (qtok[ri] < 0) continue;
    const int r = g + 8 * ri;
    const float l = sm.row_l[r];
    const float den = ts.nsplit == 1 ? add_sink(l, m_final[r], p.head_sink, qhead[ri], p.status) : l;
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    const int64_t row = static_cast<int64_t>(qtok[ri]) * p.num_heads + qhead[ri];
#pragma unroll
    for (int jn = 0; jn < NT; ++jn)
      store_row2<D>(p, row, ts.nsplit, split, dbase + 8 * jn + 2 * t, o[jn][2 * ri] * inv, o[jn][2 * ri + 1] * inv);
    if (ts.nsplit > 1 && warp == 0 && t == 0) store_split_ml<D>(p, row, ts.nsplit, split, m_final[r], l);
  }
}

template <int D, PvQuant PV, bool ROWS16>
__global__ void __launch_bounds__(Cfg<D, ROWS16 ? 16 : 8>::THREADS, Cfg<D, ROWS16 ? 16 : 8>::MIN_BLOCKS)
    paged_attention_kernel(PagedAttentionParams p, TileShape ts) {
  using C = Cfg<D, ROWS16 ? 16 : 8>;
  constexpr int kWarps = C::W;
  constexpr int kThreads = C::THREADS;
  constexpr int KT = C::KT;
  constexpr int NT = D / 8 / kWarps;  // 8-column n-tiles per warp in P.V (warp owns D/kWarps columns)
  constexpr int kRi = ROWS16 ? 2 : 1;
  static_assert(NT >= 1, "head_dim too small for the warp count");

  extern __shared__ __align__(16) unsigned char smem[];
  const GenSmem sm = general_smem<C, PV == PvQuant::kNone>(smem);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int Hkv = p.num_kv_heads, B = p.block_size;
  const int G = p.num_heads / Hkv;

  Work w;
  if (!general_work<KT>(p, ts, Hkv, B, p.partition_size, tid, w)) return;

  const GenLoader<D, ROWS16 ? 16 : 8> ld(p, w, Hkv, B, smem, tid);
  typename GenLoader<D, ROWS16 ? 16 : 8>::Ids ids_next;
  ld.load_ids(0, ids_next);
  ld.issue(0, ids_next);
  ld.load_ids(1, ids_next);
  ld.issue(1, ids_next);
  ld.load_ids(2, ids_next);

  if (tid < kRows) {
    int tok, hd;
    sm.row_lim[tid] = general_row(w, ts, G, tid, tok, hd);
    sm.row_m[tid] = kNegInf;
    sm.row_m[kRows + tid] = kNegInf;
    sm.row_l[tid] = 0.0f;
  }

  // Q: quantize this lane's d slice of rows g and g+8 (bit-exact with quantize_rows).
  uint32_t qa[kRi][D / 16];
  float sq[kRi];
  int lim[kRi], wlo[kRi], qtok[kRi], qhead[kRi];
#pragma unroll
  for (int ri = 0; ri < kRi; ++ri) {
    lim[ri] = general_row(w, ts, G, g + 8 * ri, qtok[ri], qhead[ri]);
    wlo[ri] = window_first(lim[ri] - 1, p.window);  // the row sees keys [wlo, lim)
    if (!quantize_q_slice<D>(p, qtok[ri], qhead[ri], t, qa[ri], sq[ri])) atomicOr(p.status, kPaQueryNonFinite);
  }

  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const int dbase = warp * (D / kWarps);

  constexpr int NCHUNK = KT / 4;  // 4 keys per thread per row; 8 threads = one 32-key group
  constexpr int kPasses = (kRows + kThreads / NCHUNK - 1) / (kThreads / NCHUNK);
  static_assert(NCHUNK % 32 == 0 || 32 % NCHUNK == 0, "a row's threads tile warps");
  float lacc[kPasses];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) lacc[i] = 0.0f;

  for (int j = 0; j < w.nstages; ++j) {
    cp_async_wait<1>();  // stage j has landed (stage j+1 may still be in flight)
    __syncthreads();
    const unsigned char* st = smem + (j & 1) * C::STAGE;
    const int kp0 = w.k_lo + j * KT;
    const int kend = min(kp0 + KT, w.k_hi);

    general_scores<D, ROWS16>(p, st, sm, kp0, kend, qa, sq, lim, wlo, warp, g, t);
    __syncthreads();

    const float* m_old = sm.row_m + (j & 1) * kRows;
    float* m_new = sm.row_m + ((j + 1) & 1) * kRows;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = pass * (kThreads / NCHUNK) + tid / NCHUNK;
      general_codes<D, PV, ROWS16>(p, st, sm, m_old, m_new, r, tid % NCHUNK, r < w.rows_used, kp0, kend, lacc[pass]);
    }
    __syncthreads();

    // Phase 4: O rescaled to the new running max, then P.V per 64-key tile.
    general_rescale_o<ROWS16>(m_old, m_new, g, o);
    const int n64 = (kend - kp0 + 63) / 64;
#pragma unroll
    for (int ti = 0; ti < KT / 64; ++ti) {
      if (ti >= n64) break;  // warp-uniform
      general_pv_tile<D, PV, ROWS16, NT>(st + C::V_OFF, sm, ti, dbase, g, t, o);
    }
    __syncthreads();  // every warp is done with stage j's buffer and the codes
    if (j + 2 < w.nstages) ld.issue(j + 2, ids_next);
    else cp_async_commit();  // an empty group keeps wait_group<1> counting stages
    ld.load_ids(j + 3, ids_next);
  }
  cp_async_wait<0>();
  general_row_sums<kThreads, NCHUNK, kPasses>(sm, lacc, tid, w.rows_used);
  general_write_out<D, kRi, NT>(p, ts, w.split, sm, sm.row_m + (w.nstages & 1) * kRows, qtok, qhead, o, dbase, warp,
                                g, t);
}

// ---- decode with warp-independent key ranges ----
// One CTA (DW warps) = one sequence x one kv head x one split of the keys, as above, but each
// warp owns every DW-th 32-key stage of the split: its own cp.async ring of NS stages in a
// private slice of shared memory, its own online-softmax state (m, l and O in registers), and
// no CTA barrier until the warps merge by log-sum-exp at the end. A stage is exactly one W scale
// group (32 key positions, 32-aligned since partitions are multiples of 32).
//   Q.K  m16n8k32 s8, rows = the G query heads (lane (g, t) holds head g), 4 n-tiles of 8 keys.
//        Column n of n-tile j is key 8 (n >> 1) + 2j + (n & 1), so the accumulators of lane
//        (g, t) are keys 8t .. 8t+7 of head g: softmax, W and the codes stay in registers.
//   P.V  m16n8k32 (s8 x s8 or u8 x s8): A slots 4t..4t+3 / 16+4t..16+4t+3 of lane (g, t) are
//        its own keys 8t..8t+3 / 8t+4..8t+7 (the codes it just made), B is one 8-byte read of
//        V row d at keys 8t..8t+7; every MMA's K set is the 32 keys of the stage = its group.
// pv none: the same with W / max in fp16 on two m16n8k16 per stage (keys 8t..8t+3, 8t+4..8t+7).
// Blocks of 64+ keys (VROWS): warps 2p and 2p+1 share each 64-key stage, so that V is copied as
// whole 64-byte rows into a [D][64] slot (each warp copies half of the D rows, both halves of the
// keys), each warp still computing only its own 32 keys; a named barrier per stage pairs them.
// Why: a cp.async instruction becomes one L2 request per piece of a 128-byte line that is
// contiguous in global AND shared memory. A per-warp [D][32] slot splits every 64-byte V row of a
// block-64 cache into two 32-byte pieces (four at block 128), nearly doubling the L2 requests for
// the same DRAM bytes; the shared [D][64] slot keeps each row one piece. (Two warps per CTA with
// 64-key stages would also read whole rows, but hide too little latency; the measurements are in
// benchmarks/NOTES_attention_cuda.md.)
template <int D, int DW_, int NS_>
struct WCfg {
  static constexpr int DW = DW_;               // warps per CTA
  static constexpr int NS = NS_;               // stages per warp ring (NS - 1 in flight while one is computed)
  static constexpr int KS = D + 16;            // K row stride: the 8-lane phases of 16-byte reads hit distinct banks
  static constexpr int K_OFF = 0;
  static constexpr int V_OFF = 32 * KS;        // V [D][32], token innermost
  static constexpr int SK_OFF = V_OFF + D * 32;
  static constexpr int SV_OFF = SK_OFF + 128;
  static constexpr int STAGE = SV_OFF + 128;
  static constexpr int RING = NS * STAGE;
  static constexpr int MISC = DW * RING;       // wm[DW][8], wl[DW][8], row_m[8], row_l[8]
  static constexpr int BYTES = MISC + (2 * DW * 8 + 16) * 4;
  static constexpr int OS = D + 8;             // float row stride of the merge buffer (aliases the ring)
  // CTAs per SM by shared memory on sm_90 (1 KB reserved per CTA), at most 3 (registers): the
  // launch-bound hint; the split model uses the device's own shared memory (warp_decode_ctas_per_sm).
  static constexpr int FIT = kSm90SmemPerSm / (BYTES + 1024);
  static constexpr int MIN_BLOCKS = FIT < 1 ? 1 : (FIT > 3 ? 3 : FIT);
  static_assert(8 * OS * 4 <= RING, "merge buffer fits the warp's ring");
};
// The warp-decode shape a head dim runs (warps per CTA, ring slots per warp). D 128: 4 warps with
// 2-slot rings, so three CTAs (12 warps) fit an SM; the best of the shapes swept (4 x 3, 6 x 2,
// 12 x 2, 8 x 3; benchmarks/NOTES_attention_cuda.md). D 64 keeps 4 x 3 (three CTAs fit), and D 32
// takes the same (smaller stages; at D 32 a lane's K slice is one 8-byte read, load_k_slice).
// D 64 with shared 64-key stages runs 4 x 4 instead, two stages computed an iteration (DUAL; two
// CTAs fit, which the split model assumes for every warp-decode shape).
template <int D>
struct WarpShape {
  static constexpr int DW = 4;
  static constexpr int NS = D <= 64 ? 3 : 2;
};
static_assert(WCfg<128, 4, 2>::MIN_BLOCKS == 3 && WCfg<64, 4, 3>::MIN_BLOCKS == 3 && WCfg<32, 4, 3>::MIN_BLOCKS == 3,
              "three warp-decode CTAs per SM");

// Named barrier of warps 2p and 2p+1 (id 1 + p as an immediate: ptx::named_barrier_sync; id 0
// is __syncthreads').
__device__ __forceinline__ void pair_barrier(int warp) {
  switch (warp >> 1) {
    case 0: ptx::named_barrier_sync<1, 64>(); break;
    case 1: ptx::named_barrier_sync<2, 64>(); break;
    case 2: ptx::named_barrier_sync<3, 64>(); break;
    default: ptx::named_barrier_sync<4, 64>(); break;
  }
}

// Pair 0 has one more 64-key stage than pair 1 when the split's count is odd. Pair 1 passes as
// many pair barriers anyway, so that every warp reaches the merge's __syncthreads having passed
// the same number of barriers: compute-sanitizer's racecheck orders shared-memory accesses by
// that count, and without this reports the wm / wl writes and reads of the merge as hazards
// between warps of different pairs (the hardware needs no such padding). STEP: pair stages per
// loop iteration (one barrier each iteration; 2 in the dual-stage loop).
template <int DW, int STEP>
__device__ __forceinline__ void pair_barrier_padding(int nst64, int nwp, int warp) {
  const int nwp_pair0 = nst64 > 0 ? (nst64 + DW / 2 - 1) / (DW / 2) : 0;
  for (int i = (nwp + STEP - 1) / STEP; i < (nwp_pair0 + STEP - 1) / STEP; ++i) pair_barrier(warp);
}

// The CTA's work: (sequence, kv head, split) and the split's first key. With a window the query
// (position seq_len - 1) sees keys from k_first on, and the splits start at its aligned start
// (64 for VROWS's 64-key stages, in k_first's block since B >= 64): so seq_len is loaded here,
// before the block ids. Without, k_first = 0 and seq_len follows them.
struct WdWork {
  int s, h, split, partition;
  int k_first, k_base, k_lo;
  int k_max;  // the split's keys end here if seq_len allows
};

template <bool VROWS>
__device__ __forceinline__ void warp_decode_work(const PagedAttentionParams& p, const TileShape& ts, int Hkv, int B,
                                                 WdWork& w) {
  int64_t idx = blockIdx.x;
  w.split = static_cast<int>(idx % ts.nsplit);
  idx /= ts.nsplit;
  w.h = static_cast<int>(idx % Hkv);
  w.s = static_cast<int>(idx / Hkv);
  w.partition = p.partition_size;
  w.k_first = p.window > 0 ? window_first(static_cast<int64_t>(p.seq_lens[w.s]) - 1, p.window) : 0;
  w.k_base = w.k_first & ~(VROWS ? 63 : 31);
  w.k_lo = w.k_base + w.split * ts.ppc * w.partition;
  w.k_max = min(w.k_lo + ts.ppc * w.partition, p.max_blocks * B);
}

// The query row of sequence s: s itself without cu_seqlens_q; with it (decode_with_cu), the
// sequence's first row if it has exactly one, else the launch must be redone (status bit).
// Returns false (status flagged by thread 0) when there is no such row.
__device__ __forceinline__ bool warp_decode_query_row(const PagedAttentionParams& p, int s, int tid, int& qrow) {
  qrow = s;
  if (p.cu_seqlens_q != nullptr) {
    const int q0 = p.cu_seqlens_q[s], q1 = p.cu_seqlens_q[s + 1];
    if (q0 < 0 || q1 < q0 || q1 > p.num_tokens || (s == 0 && q0 != 0) || (s == p.num_seqs - 1 && q1 != p.num_tokens)) {
      if (tid == 0) atomicOr(p.status, kPaCuSeqlensBad);
      return false;
    }
    if (q1 - q0 != 1) {
      if (tid == 0) atomicOr(p.status, kPaNotOneQueryEach);
      return false;
    }
    qrow = q0;
  }
  return true;
}

// Shared-memory places of one warp: its ring, and with VROWS the pair slots it shares with its
// partner. VROWS: warps 2p and 2p+1 share NS pair slots in their two rings: V [D][64] first,
// then the two warps' K rows and scales. Row d of V keeps its two 32-key halves swapped when
// bit 1 of d is set, so that the 8-byte B reads of a half-warp (rows g = 0..3, one half) hit
// distinct banks; a 128-byte global line (rows d, d+1, d even) still lands in 128 contiguous bytes.
template <int D, int DW, int NS, bool VROWS>
struct WdSlots {
  using C = WCfg<D, DW, NS>;
  static constexpr int PST = 2 * C::STAGE;  // pair slot
  static constexpr int PK_OFF = D * 64;
  static constexpr int PS_OFF = PK_OFF + 2 * 32 * C::KS;
  static_assert(PS_OFF + 2 * 256 <= PST && (!VROWS || DW == 4 || DW == 8), "pair slot; pairs are warps 2p, 2p+1");
  static constexpr int SST = VROWS ? PST : C::STAGE;  // slot stride
  static constexpr int VRS = VROWS ? 64 : 32;         // V row stride in the slot
};

// Raw block ids of this warp's stages (every DW-th 32-key stage of the split; VROWS: warps 2p and
// 2p+1 share 64-key stage p + (DW / 2) li, so each still owns its kp0_of). Loaded without a check
// NS stages ahead of use, the first NS before seq_len is known, so that those loads and the
// seq_lens load are in flight together (decode at batch 1 is a chain of dependent loads); checked
// where the stage is issued.
template <int DW, bool VROWS>
struct WdIds {
  const int32_t* bt;
  int lb, B, k_lo, k_max, k_first, warp;
  __device__ __forceinline__ int kp0_of(int li) const { return k_lo + 32 * (warp + DW * li); }
  __device__ __forceinline__ int kpp_of(int li) const { return k_lo + 64 * ((warp >> 1) + (DW / 2) * li); }
  __device__ __forceinline__ void raw_ids(int li, int& r0, int& r1) const {
    const int kp0 = VROWS ? kpp_of(li) : kp0_of(li);
    // B 16: keys kp0..kp0+15 may lie in a block wholly before the window (its entry is not read).
    r0 = kp0 < k_max && (B >= 32 || kp0 + 16 > k_first) ? bt[kp0 >> lb] : -1;
    r1 = B >= 32 ? r0 : (kp0 + 16 < k_max ? bt[(kp0 + 16) >> lb] : -1);
  }
};

// The split's keys end at k_hi (seq_len known): this warp's stages nw (every DW-th 32-key stage)
// and, VROWS, nwp (the pair stages it copies V rows for). Returns the split's 64-key stage count.
template <int DW, bool VROWS>
__device__ __forceinline__ int warp_stages(int k_hi, int k_lo, int warp, int& nw, int& nwp) {
  const int nst = k_hi > k_lo ? (k_hi - k_lo + 31) / 32 : 0;
  nw = nst > warp ? (nst - warp + DW - 1) / DW : 0;
  const int nst64 = (k_hi - k_lo + 63) / 64;
  nwp = VROWS ? (nst64 > (warp >> 1) ? (nst64 - (warp >> 1) + DW / 2 - 1) / (DW / 2) : 0) : nw;
  return nst64;
}

// ---- stage copies: data NS-1 stages ahead (cp.async) ----
// Per-lane source offsets and shared-memory destinations are fixed for the whole loop; a stage
// only adds its block's base (one 64-bit multiply per half) and the key offset in the block, so
// that the chunks of a half are one base plus immediate offsets. A half whose block is not
// valid reads block 0 with source size 0 (zero fill, nothing read). The per-stage address
// arithmetic must stay this small: with few warps per scheduler the loop is bound by its own
// instruction latency, not by memory, once it issues more than a few hundred instructions a stage.
template <int D, int DW, int NS, bool VROWS>
struct WdLoader {
  using C = WCfg<D, DW, NS>;
  using S = WdSlots<D, DW, NS, VROWS>;
  static constexpr int NKC = 32 * D / 16 / 32;  // 16-byte K chunks per lane per stage
  static constexpr int NVC = D * 2 / 32;        // 16-byte V chunks per lane per stage
  static constexpr int KPR = D / 16;            // 16-byte chunks of one K row
  static_assert(NKC % 2 == 0 && 32 % KPR == 0, "stage shape");

  const PagedAttentionParams& p;
  const WdIds<DW, VROWS>& ids;
  int lane, k_hi, nw, nwp;  // the split's keys end at k_hi; this warp's stages (nwp: pair stages, VROWS)
  int half, Hkv, B, k_first, blk_stride, vstep, s_key;
  const int8_t *k_lane, *v_lane, *vr_lane;
  const float* s_lane;
  unsigned k_dst, v_dst, s_dst, vr_dst;

  __device__ __forceinline__ WdLoader(const PagedAttentionParams& p_, const WdIds<DW, VROWS>& ids_, int Hkv_, int B_,
                                      int k_hi_, int nw_, int nwp_, int h, int warp, int lane_, unsigned char* ring,
                                      unsigned char* sbase_ptr, int kof, int sof)
      : p(p_), ids(ids_), lane(lane_), k_hi(k_hi_), nw(nw_), nwp(nwp_) {
    Hkv = Hkv_;
    B = B_;
    half = warp & 1;
    k_first = ids.k_first;
    blk_stride = Hkv * B * D;  // bytes per cache block (K or V): one block's K fits an int
    const int kkey = lane / KPR, kpart = lane % KPR;  // K chunk i: key kkey + (32 / KPR) i
    const int vd = lane >> 1, vhalf = lane & 1;       // V chunk i: row vd + 16 i, keys 16 vhalf ..
    k_lane = p.key_cache + static_cast<int64_t>(h) * B * D + kkey * D + kpart * 16;
    v_lane = p.value_cache + (static_cast<int64_t>(h) * D + vd) * B;
    k_dst = static_cast<unsigned>(__cvta_generic_to_shared(sbase_ptr)) + kof + kkey * C::KS + kpart * 16;
    v_dst = static_cast<unsigned>(__cvta_generic_to_shared(ring)) + C::V_OFF + vd * 32 + 16 * vhalf;
    s_key = 4 * (lane & 7);  // scale chunk (lane < 16): keys s_key .. s_key + 3
    s_lane = (lane >= 8 ? p.value_scale : p.key_scale) + static_cast<int64_t>(h) * B + (s_key & 15);
    s_dst = static_cast<unsigned>(__cvta_generic_to_shared(sbase_ptr)) + sof + (lane >= 8 ? 128 : 0) + s_key * 4;
    vstep = 16 * B;
    // VROWS V copies: lane (vr, vq) = (lane >> 2, lane & 3) copies bytes 16 vq .. 16 vq + 15 of
    // rows d = half * D / 2 + vr + 8 i of the pair stage's V [D][64] (keys 0..31 are warp 2p's,
    // 32..63 warp 2p+1's), so that one instruction copies 8 whole 64-byte rows into 512
    // contiguous bytes.
    const int vr = lane >> 2, vq = lane & 3;
    vr_lane = p.value_cache + (static_cast<int64_t>(h) * D + half * (D / 2) + vr) * B + 16 * vq;
    vr_dst = static_cast<unsigned>(__cvta_generic_to_shared(sbase_ptr)) + (half * (D / 2) + vr) * 64 +
             32 * ((vq >> 1) ^ ((vr >> 1) & 1)) + 16 * (vq & 1);
  }

  // A pair stage (VROWS): this warp's half of the V rows of 64 keys, and its own 32 keys' K rows
  // and scales.
  __device__ __forceinline__ void issue_pair(int li, int slot, int r0) const {
    const unsigned so = slot * S::PST;
    const int kpp = ids.kpp_of(li);
    const bool okb = static_cast<unsigned>(r0) < static_cast<unsigned>(p.num_blocks);
    if (!okb) atomicOr(p.status, kPaBlockOutOfRange);  // li < nwp: the pair stage has live keys
    const int b = okb ? r0 : 0;
    const int8_t* vb = vr_lane + static_cast<int64_t>(b) * blk_stride + (kpp & (B - 1));
#pragma unroll
    for (int i = 0; i < NVC; ++i) cp_async16_s(vr_dst + so + 8 * i * 64, vb + i * (8 * B), okb);
    if (li < nw) {
      const int kp0 = kpp + 32 * half;
      const bool ok1 = okb && kp0 + 16 < k_hi;
      const int pos0 = kp0 & (B - 1);
      const int8_t* kb0 = k_lane + static_cast<int64_t>(b) * blk_stride + pos0 * D;
#pragma unroll
      for (int i = 0; i < NKC / 2; ++i) cp_async16_s(k_dst + so + (32 / KPR) * i * C::KS, kb0 + (32 / KPR) * i * D, okb);
#pragma unroll
      for (int i = 0; i < NKC / 2; ++i)
        cp_async16_s(k_dst + so + (16 + (32 / KPR) * i) * C::KS, kb0 + (16 + (32 / KPR) * i) * D, ok1);
      if (lane < 16) {
        const bool hi = s_key >= 16;
        const float* src = s_lane + static_cast<int64_t>(b) * (Hkv * B) + pos0 + (hi ? 16 : 0);
        cp_async16_s(s_dst + so, src, hi ? ok1 : okb);
      }
    }
  }

  // A 32-key stage of this warp's own ring: two 16-key halves, each from its block.
  __device__ __forceinline__ void issue_own(int li, int slot, int r0, int r1) const {
    const unsigned so = slot * C::STAGE;
    const int kp0 = ids.kp0_of(li);
    const bool hi_live = kp0 + 16 < k_hi;                 // the stage's keys 16..31 exist
    const bool lo_live = B >= 32 || kp0 + 16 > k_first;  // keys 0..15 not in a block wholly before the window
    const int r1b = B >= 32 ? r0 : r1;                    // B >= 32: both halves in one block
    const bool ok0 = lo_live && static_cast<unsigned>(r0) < static_cast<unsigned>(p.num_blocks);
    const bool ok1 = hi_live && static_cast<unsigned>(r1b) < static_cast<unsigned>(p.num_blocks);
    if ((lo_live && !ok0) || (hi_live && !ok1)) atomicOr(p.status, kPaBlockOutOfRange);
    const int b0 = ok0 ? r0 : 0, b1 = ok1 ? r1b : 0;
    const int pos0 = kp0 & (B - 1), pos1 = (kp0 + 16) & (B - 1);
    const int8_t* kb0 = k_lane + static_cast<int64_t>(b0) * blk_stride + pos0 * D;
    const int8_t* kb1 = k_lane + static_cast<int64_t>(b1) * blk_stride + pos1 * D;
#pragma unroll
    for (int i = 0; i < NKC / 2; ++i) cp_async16_s(k_dst + so + (32 / KPR) * i * C::KS, kb0 + (32 / KPR) * i * D, ok0);
#pragma unroll
    for (int i = 0; i < NKC / 2; ++i)
      cp_async16_s(k_dst + so + (16 + (32 / KPR) * i) * C::KS, kb1 + (32 / KPR) * i * D, ok1);
    {
      const int vhalf = lane & 1;
      const bool okv = vhalf ? ok1 : ok0;
      const int8_t* vb = v_lane + static_cast<int64_t>(vhalf ? b1 : b0) * blk_stride + (vhalf ? pos1 : pos0);
#pragma unroll
      for (int i = 0; i < NVC; ++i) cp_async16_s(v_dst + so + 16 * i * 32, vb + i * vstep, okv);
    }
    if (lane < 16) {
      const bool hi = s_key >= 16;
      const bool oks = hi ? ok1 : ok0;
      const float* src = s_lane + static_cast<int64_t>(hi ? b1 : b0) * (Hkv * B) + (hi ? pos1 : pos0);
      cp_async16_s(s_dst + so, src, oks);
    }
  }

  // Stage li into ring slot `slot`, then its commit group (empty past the warp's stages, so
  // that wait_group keeps counting stages).
  __device__ __forceinline__ void issue(int li, int slot, int r0, int r1) const {
    if (VROWS) {
      if (li < nwp) issue_pair(li, slot, r0);
    } else if (li < nw) {
      issue_own(li, slot, r0, r1);
    }
    cp_async_commit();
  }
};

// ---- one 32-key stage of one warp: lane (g, t) holds keys 8t .. 8t+7 of head g ----
// Q.K into sc (keys outside [lo_t, lim_t) relative to 8t are -inf), the row's stage max in mp
// and the keys' V scales in svv. ks: the stage's K rows; ss: its K scales (V scales at +128).
template <int D, int KS>
__device__ __forceinline__ void warp_decode_scores(const unsigned char* ks, const unsigned char* ss, int krow0, int t,
                                                   const uint32_t (&qa)[D / 16], float sq, int lim_t, int lo_t,
                                                   float scale, float softcap, float (&sc)[8], float& mp,
                                                   float (&svv)[8]) {
  int acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t kw[D / 16];
    load_k_slice<D>(ks + (krow0 + 2 * j) * KS + t * (D / 4), kw);
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) mma_i8<false>(acc[j], qa[2 * c], 0u, qa[2 * c + 1], 0u, kw[2 * c], kw[2 * c + 1]);
  }
  const float4 sk0 = *reinterpret_cast<const float4*>(ss + 32 * t);
  const float4 sk1 = *reinterpret_cast<const float4*>(ss + 32 * t + 16);
  const float4 sv0 = *reinterpret_cast<const float4*>(ss + 128 + 32 * t);
  const float4 sv1 = *reinterpret_cast<const float4*>(ss + 128 + 32 * t + 16);
  const float skv[8] = {sk0.x, sk0.y, sk0.z, sk0.w, sk1.x, sk1.y, sk1.z, sk1.w};
  const float svl[8] = {sv0.x, sv0.y, sv0.z, sv0.w, sv1.x, sv1.y, sv1.z, sv1.w};
#pragma unroll
  for (int k = 0; k < 8; ++k) svv[k] = svl[k];
  // Scores bit-identical to the reference's (same int32 dot, same float32 multiplies).
  mp = kNegInf;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    sc[k] = k < lim_t && k >= lo_t ? qk_score(static_cast<float>(acc[k >> 1][k & 1]), sq, skv[k], scale, softcap)
                                   : kNegInf;
    mp = fmaxf(mp, sc[k]);
  }
  mp = warp_max4(mp);
}

// P.V of the stage (one W group) for row g: codes of keys 8t..8t+7 are this lane's A slots
// (row g+8 of the MMA is zero); V row d read as 8 bytes at v_sm + d * VRS.
template <int D, PvQuant PV, int VRS>
__device__ __forceinline__ void warp_decode_pv(const float (&wv)[8], float gmax, float beta, const unsigned char* v_sm,
                                               int g, float (&o)[D / 8][2]) {
  constexpr float kLevels = PV == PvQuant::kU8 ? 255.0f : 127.0f;
  if constexpr (PV == PvQuant::kNone) {
    uint32_t a[4];
    codes8_f16(wv, gmax, a);
    const float gs = gmax * beta;
#pragma unroll
    for (int jn = 0; jn < D / 8; ++jn) {
      const uint2 x = *reinterpret_cast<const uint2*>(v_sm + (8 * jn + g) * VRS);
      float pacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      pv_f16_8keys(pacc, a[0], 0u, a[1], 0u, a[2], 0u, a[3], 0u, x.x, x.y);
      o[jn][0] = fmaf(gs, pacc[0], o[jn][0]);
      o[jn][1] = fmaf(gs, pacc[1], o[jn][1]);
    }
  } else {
    const float inv = code_inverse(gmax, kLevels);
    const uint32_t pk[2] = {codes4_rint(wv, inv, kLevels), codes4_rint(wv + 4, inv, kLevels)};
    const float gs = __fdiv_rn(gmax, kLevels) * beta;
#pragma unroll
    for (int jn = 0; jn < D / 8; ++jn) {
      const uint2 x = *reinterpret_cast<const uint2*>(v_sm + (8 * jn + g) * VRS);
      int pacc[4] = {0, 0, 0, 0};
      mma_i8<PV == PvQuant::kU8>(pacc, pk[0], 0u, pk[1], 0u, x.x, x.y);
      o[jn][0] = fmaf(gs, static_cast<float>(pacc[0]), o[jn][0]);
      o[jn][1] = fmaf(gs, static_cast<float>(pacc[1]), o[jn][1]);
    }
  }
}

// One stage: scores, lazy rescaling, weights, codes and P.V. Lazy rescaling: the reference max
// m_run (of O and l) moves only when some row's stage max passes it by more than kLazyRescale
// (then O and l are rescaled, as in the plain online softmax); otherwise the stage's weights
// carry beta = exp(mp - m_run) <= e^kLazyRescale and O is not touched. The codes do not depend
// on it (each group is quantized against its own max, e = exp(s - mp)).
template <int D, PvQuant PV, int KS, int VRS>
__device__ __forceinline__ void warp_decode_stage(const unsigned char* ks, const unsigned char* ss,
                                                  const unsigned char* v_sm, int krow0, int g, int t,
                                                  const uint32_t (&qa)[D / 16], float sq, int lim_t, int lo_t,
                                                  float scale, float softcap, float (&o)[D / 8][2], float& m_run,
                                                  float& l_run) {
  float sc[8], svv[8], mp;
  warp_decode_scores<D, KS>(ks, ss, krow0, t, qa, sq, lim_t, lo_t, scale, softcap, sc, mp, svv);
  if (__any_sync(0xffffffffu, mp > m_run + kLazyRescale)) rescale_row(m_run, l_run, mp, o, 0);
  const float beta = mp == kNegInf ? 0.0f : fast_exp(mp - m_run);
  float wv[8];
  float esum = 0.0f, gmax;
  bool vis[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) vis[k] = k < lim_t && k >= lo_t;
  group_weights8(sc, svv, 0, vis, mp, wv, esum, gmax);
  gmax = warp_max4(gmax);
  l_run = fmaf(beta, esum, l_run);
  warp_decode_pv<D, PV, VRS>(wv, gmax, beta, v_sm, g, o);
}

// Two of the warp's 32-key stages (A, then B: two W groups) as one step: both stages' Q.K and
// softmax chains are independent until the shared rescale decision, so the warp's instruction
// stream interleaves them (at head_dim 64 one stage's chain of MMAs, shuffles, exp and divisions
// bounds the kernel, not its bytes: benchmarks/NOTES_attention_cuda.md). The rescale moves m_run
// once, to the larger of the two stage maxima when it passes the reference by kLazyRescale, so
// both stages' beta stay <= e^kLazyRescale; each group's codes depend only on its own max, as in
// warp_decode_stage, so the codes are the same as two warp_decode_stage calls would make.
template <int D, PvQuant PV, int KS, int VRS>
__device__ __forceinline__ void warp_decode_stage2(const unsigned char* ks_a, const unsigned char* ss_a,
                                                   const unsigned char* v_a, const unsigned char* ks_b,
                                                   const unsigned char* ss_b, const unsigned char* v_b, int krow0,
                                                   int g, int t, const uint32_t (&qa)[D / 16], float sq, int lim_a,
                                                   int lo_a, int lim_b, int lo_b, float scale, float softcap,
                                                   float (&o)[D / 8][2], float& m_run, float& l_run) {
  float sc_a[8], sv_a[8], mp_a, sc_b[8], sv_b[8], mp_b;
  warp_decode_scores<D, KS>(ks_a, ss_a, krow0, t, qa, sq, lim_a, lo_a, scale, softcap, sc_a, mp_a, sv_a);
  warp_decode_scores<D, KS>(ks_b, ss_b, krow0, t, qa, sq, lim_b, lo_b, scale, softcap, sc_b, mp_b, sv_b);
  const float mp = fmaxf(mp_a, mp_b);
  if (__any_sync(0xffffffffu, mp > m_run + kLazyRescale)) rescale_row(m_run, l_run, mp, o, 0);
  const float beta_a = mp_a == kNegInf ? 0.0f : fast_exp(mp_a - m_run);
  const float beta_b = mp_b == kNegInf ? 0.0f : fast_exp(mp_b - m_run);
  float wv_a[8], wv_b[8];
  float esum_a = 0.0f, esum_b = 0.0f, gmax_a, gmax_b;
  bool vis_a[8], vis_b[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    vis_a[k] = k < lim_a && k >= lo_a;
    vis_b[k] = k < lim_b && k >= lo_b;
  }
  group_weights8(sc_a, sv_a, 0, vis_a, mp_a, wv_a, esum_a, gmax_a);
  group_weights8(sc_b, sv_b, 0, vis_b, mp_b, wv_b, esum_b, gmax_b);
  gmax_a = warp_max4(gmax_a);
  gmax_b = warp_max4(gmax_b);
  l_run = fmaf(beta_a, esum_a, l_run);
  l_run = fmaf(beta_b, esum_b, l_run);
  warp_decode_pv<D, PV, VRS>(wv_a, gmax_a, beta_a, v_a, g, o);
  warp_decode_pv<D, PV, VRS>(wv_b, gmax_b, beta_b, v_b, g, o);
}

// ---- merge the warps by log-sum-exp, then write O / l (and m, l for the split merge) ----
// Each warp's O (scaled to the common max) goes to its own ring (free: all its copies landed);
// the CTA then sums the DW slices per output element.
template <int D, int DW, int NS>
__device__ __forceinline__ void warp_decode_merge_out(const PagedAttentionParams& p, const TileShape& ts,
                                                      unsigned char* smem, const WdWork& w, int qrow, int warp,
                                                      int g, int t, const float (&o)[D / 8][2], float m_run,
                                                      float l_run) {
  using C = WCfg<D, DW, NS>;
  const int G = p.num_heads / p.num_kv_heads;
  const int tid = threadIdx.x;
  float* wm = reinterpret_cast<float*>(smem + C::MISC);
  float* wl = wm + DW * 8;
  float* row_m = wl + DW * 8;
  float* row_l = row_m + 8;
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  if (t == 0) {
    wm[warp * 8 + g] = m_run;
    wl[warp * 8 + g] = l_run;
  }
  __syncthreads();
  float M = kNegInf;
#pragma unroll
  for (int w2 = 0; w2 < DW; ++w2)
    if (wl[w2 * 8 + g] > 0.0f) M = fmaxf(M, wm[w2 * 8 + g]);
  float L = 0.0f;
#pragma unroll
  for (int w2 = 0; w2 < DW; ++w2) {
    const float l2 = wl[w2 * 8 + g];
    if (l2 > 0.0f) L += l2 * fast_exp(wm[w2 * 8 + g] - M);
  }
  const float f = l_run > 0.0f ? fast_exp(m_run - M) : 0.0f;
  float* ob = reinterpret_cast<float*>(smem + warp * C::RING);
#pragma unroll
  for (int jn = 0; jn < D / 8; ++jn)
    *reinterpret_cast<float2*>(ob + g * C::OS + 8 * jn + 2 * t) = make_float2(f * o[jn][0], f * o[jn][1]);
  if (warp == 0 && t == 0) {
    row_m[g] = M;
    row_l[g] = ts.nsplit == 1 && g < G ? add_sink(L, M, p.head_sink, w.h * G + g, p.status) : L;  // else: the merge adds it
  }
  __syncthreads();
  for (int e = tid; e < 8 * (D / 4); e += 32 * DW) {
    const int r = e / (D / 4), d = 4 * (e % (D / 4));
    if (r >= G) break;
    float4 acc4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w2 = 0; w2 < DW; ++w2) {
      const float4 v = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(smem + w2 * C::RING) + r * C::OS + d);
      acc4.x += v.x;
      acc4.y += v.y;
      acc4.z += v.z;
      acc4.w += v.w;
    }
    const float l = row_l[r];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t row = static_cast<int64_t>(qrow) * p.num_heads + w.h * G + r;
    const float4 v = make_float4(acc4.x * inv, acc4.y * inv, acc4.z * inv, acc4.w * inv);
    if (ts.nsplit == 1) {
      store_out2(p, row, d, v.x, v.y);
      store_out2(p, row, d + 2, v.z, v.w);
    } else {
      float* ws = static_cast<float*>(p.workspace);
      *reinterpret_cast<float4*>(ws + (row * ts.nsplit + w.split) * D + d) = v;
      if (d == 0) store_split_ml<D>(p, row, ts.nsplit, w.split, row_m[r], l);
    }
  }
}

// DUAL (VROWS only, NS 4): the loop takes two of the warp's stages an iteration (warp_decode_stage2):
// at the top both have landed (nothing else is in flight), one pair barrier, the next two are
// issued into the slots of the two computed last iteration, then both are computed while those
// two are on their way: the same 64 keys a warp in flight as NS 3's two single stages.
template <int D, PvQuant PV, int DW_, int NS_, bool VROWS, bool DUAL>
__global__ void __launch_bounds__(32 * WCfg<D, DW_, NS_>::DW, WCfg<D, DW_, NS_>::MIN_BLOCKS)
    decode_warp_kernel(PagedAttentionParams p, TileShape ts) {
  static_assert(!DUAL || (VROWS && NS_ == 4), "the dual-stage loop: shared 64-key stages, two computed + two in flight");
  using C = WCfg<D, DW_, NS_>;
  using S = WdSlots<D, DW_, NS_, VROWS>;
  constexpr int DW = C::DW;
  constexpr int NS = C::NS;
  // Launched as a programmatic dependent of the stream's previous kernel (sm_90; launch_warp):
  // resident while that kernel (QuantizeKVCache, writing this step's keys) finishes, it waits here,
  // before its first global read, for that grid's writes. A no-op when launched normally.
  ptx::griddep_wait();

  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int Hkv = p.num_kv_heads, B = p.block_size;
  const int G = p.num_heads / Hkv;
  unsigned char* ring = smem + warp * C::RING;
  const int half = warp & 1;
  unsigned char* sbase_ptr = VROWS ? smem + (warp >> 1) * 2 * C::RING : ring;
  const int kof = VROWS ? S::PK_OFF + half * 32 * C::KS : C::K_OFF;
  const int sof = VROWS ? S::PS_OFF + half * 256 : C::SK_OFF;  // V scales at sof + 128

  WdWork w;
  warp_decode_work<VROWS>(p, ts, Hkv, B, w);
  const WdIds<DW, VROWS> ids{p.block_tables + static_cast<int64_t>(w.s) * p.max_blocks,
                             p.log2_block_size, B, w.k_lo, w.k_max, w.k_first, warp};
  int rid0[NS], rid1[NS];
#pragma unroll
  for (int li = 0; li < NS; ++li) ids.raw_ids(li, rid0[li], rid1[li]);

  const int seq_len = p.seq_lens[w.s];
  if (seq_len < 1 || seq_len > p.max_blocks * B ||
      seq_len - w.k_base > static_cast<int64_t>(ts.nsplit) * ts.ppc * w.partition) {
    if (tid == 0) atomicOr(p.status, kPaSeqLenOutOfRange);
    return;
  }
  int qrow;
  if (!warp_decode_query_row(p, w.s, tid, qrow)) return;
  int nw, nwp;
  const int k_hi = min(w.k_lo + ts.ppc * w.partition, seq_len);
  const int nst64 = warp_stages<DW, VROWS>(k_hi, w.k_lo, warp, nw, nwp);
  const WdLoader<D, DW, NS, VROWS> ld(p, ids, Hkv, B, k_hi, nw, nwp, w.h, warp, lane, ring, sbase_ptr, kof, sof);

  constexpr int kAhead = DUAL ? 2 : NS - 1;  // stages issued before the loop
#pragma unroll
  for (int li = 0; li < kAhead; ++li) ld.issue(li, li, rid0[li], rid1[li]);
  int nb0 = rid0[kAhead], nb1 = rid1[kAhead];  // raw ids of the next stage to issue
  int nc0 = rid0[NS - 1], nc1 = rid1[NS - 1];  // DUAL: and of the one after it
  // The merge may launch (it waits). Without a merge the next kernel is another op's (the next
  // layer's): it launches when this grid is done, not resident beside it for the whole kernel.
  if (ts.nsplit > 1) ptx::griddep_launch_dependents();

  // Q: this lane's d slice of head g (bit-exact with quantize_rows).
  const bool row_ok = g < G;
  uint32_t qa[D / 16];
  float sq;
  if (!quantize_q_slice<D>(p, row_ok ? qrow : -1, w.h * G + g, t, qa, sq) && warp == 0)
    atomicOr(p.status, kPaQueryNonFinite);

  float o[D / 8][2];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = 0.0f;
  float m_run = kNegInf, l_run = 0.0f;  // per row g; O and l are relative to exp(m_run)
  const float scale = p.scale;
  // Row of n-tile j's B fragment this lane reads: key 8 (g >> 1) + 2j + (g & 1).
  const int krow0 = 8 * (g >> 1) + (g & 1);

  // VROWS: a pair slot is refilled only when both warps are done with it, so the refill follows
  // the barrier that also makes the partner's copies of stage i visible.
  const int v_lane_off = VROWS ? 32 * (half ^ ((g >> 1) & 1)) + 8 * t : 8 * t;
  if constexpr (DUAL) {
    for (int i = 0; i < nwp; i += 2) {
      cp_async_wait<0>();   // this warp's parts of stages i and i + 1 have landed
      pair_barrier(warp);   // the partner's too, and both are done with stages i - 2 and i - 1
      ld.issue(i + 2, (i + 2) & 3, nb0, nb1);
      ld.issue(i + 3, (i + 3) & 3, nc0, nc1);
      ids.raw_ids(i + 4, nb0, nb1);
      ids.raw_ids(i + 5, nc0, nc1);
      const unsigned char* st_a = sbase_ptr + (i & 3) * S::SST;
      const unsigned char* st_b = sbase_ptr + ((i + 1) & 3) * S::SST;
      const int kp_a = ids.kp0_of(i), kp_b = ids.kp0_of(i + 1);
      const int lim_a = (row_ok ? k_hi - kp_a : 0) - 8 * t, lo_a = w.k_first - kp_a - 8 * t;
      const int lim_b = (row_ok ? k_hi - kp_b : 0) - 8 * t, lo_b = w.k_first - kp_b - 8 * t;
      if (i + 1 < nw) {
        warp_decode_stage2<D, PV, C::KS, S::VRS>(st_a + kof, st_a + sof, st_a + v_lane_off, st_b + kof, st_b + sof,
                                                 st_b + v_lane_off, krow0, g, t, qa, sq, lim_a, lo_a, lim_b, lo_b,
                                                 scale, p.softcap, o, m_run, l_run);
      } else if (i < nw) {  // the warp's last stage, alone (stage i + 1 is the partner's or none)
        warp_decode_stage<D, PV, C::KS, S::VRS>(st_a + kof, st_a + sof, st_a + v_lane_off, krow0, g, t, qa, sq, lim_a,
                                                lo_a, scale, p.softcap, o, m_run, l_run);
      }
      __syncwarp();
    }
  } else {
    int wslot = NS - 1, rslot = 0;  // ring slots of the stage issued / consumed this iteration
    for (int i = 0; i < nwp; ++i) {
      if constexpr (VROWS) {
        cp_async_wait<NS - 2>();  // this warp's part of stage i has landed
        pair_barrier(warp);       // the partner's too, and both are done with stage i - 1's slot
        ld.issue(i + NS - 1, wslot, nb0, nb1);
        wslot = wslot == NS - 1 ? 0 : wslot + 1;
        ids.raw_ids(i + NS, nb0, nb1);
      } else {
        ld.issue(i + NS - 1, wslot, nb0, nb1);
        wslot = wslot == NS - 1 ? 0 : wslot + 1;
        ids.raw_ids(i + NS, nb0, nb1);
        cp_async_wait<NS - 1>();  // stage i has landed
        __syncwarp();
      }
      const unsigned char* st = sbase_ptr + rslot * S::SST;
      rslot = rslot == NS - 1 ? 0 : rslot + 1;
      if (VROWS && i >= nw) continue;  // the partner's last stage: this warp only copied V rows
      const int kp0 = ids.kp0_of(i);
      const int lim_rel = k_hi - kp0;  // keys of this stage the query sees: [0, lim_rel)
      const int lim_t = (row_ok ? lim_rel : 0) - 8 * t;  // keys 8t + k with lo_t <= k < lim_t are visible
      const int lo_t = w.k_first - kp0 - 8 * t;
      warp_decode_stage<D, PV, C::KS, S::VRS>(st + kof, st + sof, st + (VROWS ? 0 : C::V_OFF) + v_lane_off, krow0, g, t,
                                              qa, sq, lim_t, lo_t, scale, p.softcap, o, m_run, l_run);
      __syncwarp();  // every lane is done with slot i % NS before iteration i+1 refills it
    }
  }
  if constexpr (VROWS) pair_barrier_padding<DW, DUAL ? 2 : 1>(nst64, nwp, warp);
  cp_async_wait<0>();
  warp_decode_merge_out<D, DW, NS>(p, ts, smem, w, qrow, warp, g, t, o, m_run, l_run);
}

// Combines the splits of each (token, head) row: weights l_i exp(m_i - max m). One CTA of D
// threads per row: kMergeGroups groups of D / 4 threads, group q merging splits q, q + 4, ... by
// a running log-sum-exp with kMergeBatch splits' loads in flight at once (a long context gives a
// row tens of splits, and each load is an L2 round trip: issued together, their latencies
// overlap instead of adding up), then the groups combine through shared memory.
constexpr int kMergeGroups = 4;
constexpr int kMergeBatch = 8;
template <int D>
__global__ void __launch_bounds__(D) merge_splits_kernel(PagedAttentionParams p, int nsplit) {
  // Launched as a programmatic dependent (sm_90): resident early, it waits here until the
  // attention grid has finished and its writes are visible.
  ptx::griddep_wait();
  __shared__ float s_acc[kMergeGroups][D];
  __shared__ float s_mw[kMergeGroups][2];
  const int64_t row = blockIdx.x;
  const int grp = threadIdx.x / (D / 4), d = 4 * (threadIdx.x % (D / 4));
  const float* ws = static_cast<const float*>(p.workspace);
  const float2* ml = reinterpret_cast<const float2*>(ws + static_cast<int64_t>(p.num_tokens) * p.num_heads * nsplit * D) +
                     row * nsplit;
  const float4* x4 = reinterpret_cast<const float4*>(ws + row * nsplit * D + d);
  float mx = kNegInf, wsum = 0.0f;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int base = grp; base < nsplit; base += kMergeGroups * kMergeBatch) {
    float2 v[kMergeBatch];
    float4 x[kMergeBatch];
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {
      const int i = base + kMergeGroups * u;
      v[u] = i < nsplit ? ml[i] : make_float2(0.0f, 0.0f);
      x[u] = i < nsplit ? x4[static_cast<int64_t>(i) * (D / 4)] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kMergeBatch; ++u) {
      if (v[u].y > 0.0f) {  // a split that saw no key wrote l = 0 (its O is not read)
        const float mn = fmaxf(mx, v[u].x);
        const float c = expf(mx - mn);  // 0 while mx is -inf
        const float wt = v[u].y * expf(v[u].x - mn);
        wsum = wsum * c + wt;
        acc.x = acc.x * c + wt * x[u].x;
        acc.y = acc.y * c + wt * x[u].y;
        acc.z = acc.z * c + wt * x[u].z;
        acc.w = acc.w * c + wt * x[u].w;
        mx = mn;
      }
    }
  }
  *reinterpret_cast<float4*>(&s_acc[grp][d]) = acc;
  if (d == 0) {
    s_mw[grp][0] = mx;
    s_mw[grp][1] = wsum;
  }
  __syncthreads();
  if (grp != 0) return;
  float M = kNegInf;
#pragma unroll
  for (int q = 0; q < kMergeGroups; ++q)
    if (s_mw[q][1] > 0.0f) M = fmaxf(M, s_mw[q][0]);
  // The head's sink joins the denominator, rescaled into the common max like the splits' sums.
  const float sink = p.head_sink != nullptr ? p.head_sink[row % p.num_heads] : kNegInf;
  if (p.head_sink != nullptr && !isfinite(sink) && d == 0) atomicOr(p.status, kPaSinkNonFinite);
  M = fmaxf(M, sink);
  float total = p.head_sink != nullptr ? expf(sink - M) : 0.0f;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
  for (int q = 0; q < kMergeGroups; ++q) {
    if (s_mw[q][1] > 0.0f) {
      const float f = expf(s_mw[q][0] - M);
      const float4 a = *reinterpret_cast<const float4*>(&s_acc[q][d]);
      total += f * s_mw[q][1];
      o.x += f * a.x;
      o.y += f * a.y;
      o.z += f * a.z;
      o.w += f * a.w;
    }
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  store_out2(p, row, d, o.x * inv, o.y * inv);
  store_out2(p, row, d + 2, o.z * inv, o.w * inv);
}

int sm_major() {  // of the current device, cached per device
  static int major[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (major[dev] == 0) {
    int m = 0;
    if (cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
    major[dev] = m;
  }
  return major[dev];
}



// CTAs of `bytes` of shared memory that fit on one SM of `smem_per_sm` (1 KB reserved per CTA),
// at most `by_regs` (the launch bound), at least 1.
int fit_per_sm(int by_regs, int bytes, int smem_per_sm) {
  return std::max(1, std::min(by_regs, smem_per_sm / (bytes + 1024)));
}

template <int D>
int resident_ctas(bool rows16, bool fp16_codes, int smem_per_sm) {  // per SM: shared memory and launch bounds
  const int bytes = rows16 ? Cfg<D, 16>::bytes(fp16_codes) : Cfg<D, 8>::bytes(fp16_codes);
  const int by_regs = rows16 ? Cfg<D, 16>::MIN_BLOCKS : Cfg<D, 8>::MIN_BLOCKS;
  return fit_per_sm(by_regs, bytes, smem_per_sm);
}

int resident_ctas(int head_dim, bool rows16, bool fp16_codes, int smem_per_sm) {
  switch (head_dim) {
    case 32: return resident_ctas<32>(rows16, fp16_codes, smem_per_sm);
    case 64: return resident_ctas<64>(rows16, fp16_codes, smem_per_sm);
    case 128: return resident_ctas<128>(rows16, fp16_codes, smem_per_sm);
    default: return resident_ctas<256>(rows16, fp16_codes, smem_per_sm);
  }
}

int warp_decode_ctas_per_sm(int head_dim, int smem_per_sm) {
  using C32 = WCfg<32, WarpShape<32>::DW, WarpShape<32>::NS>;
  using C64 = WCfg<64, WarpShape<64>::DW, WarpShape<64>::NS>;
  using C128 = WCfg<128, WarpShape<128>::DW, WarpShape<128>::NS>;
  return head_dim <= 32   ? fit_per_sm(C32::MIN_BLOCKS, C32::BYTES, smem_per_sm)
         : head_dim <= 64 ? fit_per_sm(C64::MIN_BLOCKS, C64::BYTES, smem_per_sm)
                          : fit_per_sm(C128::MIN_BLOCKS, C128::BYTES, smem_per_sm);
}

// Decode launches (no cu_seqlens_q, or decode_with_cu) with G <= 8 and D 32 / 64 / 128 run
// decode_warp_kernel; other launches with cu_seqlens_q never do, so the workspace for
// max_q_len == 1 and T == S is sized for both (the caller does not say whether cu comes).
bool warp_decode_shape(const PagedAttentionParams& p) {
  return p.max_q_len == 1 && p.num_tokens == p.num_seqs && p.num_heads / p.num_kv_heads <= 8 &&
         (p.head_dim == 32 || p.head_dim == 64 || p.head_dim == 128);
}
bool use_warp_decode(const PagedAttentionParams& p) {
  return (p.cu_seqlens_q == nullptr || p.decode_with_cu) && warp_decode_shape(p);
}

TileShape tile_shape(const PagedAttentionParams& p, bool warp_decode, const DeviceLimits& lim) {
  TileShape ts;
  const int G = p.num_heads / p.num_kv_heads;
  // Prefill shapes of cuda_prefill.cu (D 64 / 128, G in {1, 2, 4, 8}, max_q_len * G >= 32): 64 rows a
  // CTA, all G heads of 64 / G queries. D 32 / 256, other G and fewer rows keep the general kernel.
  const bool prefill = !warp_decode && paged_attention_prefill_applies(p);
  ts.hpt = warp_decode || prefill ? G : std::min(G, kRows);
  ts.n_ht = warp_decode || prefill ? 1 : (G + kRows - 1) / kRows;
  ts.qpt = warp_decode ? 1 : std::max(1, std::min((prefill ? kPrefillRows : kRows) / ts.hpt, p.max_q_len));
  ts.n_qt = (p.max_q_len + ts.qpt - 1) / ts.qpt;
  const int partition = p.partition_size;
  // Decode with a window splits only the window's span (+ 63: its start aligned down to 32 or 64).
  const int64_t span = p.window > 0 && p.max_q_len == 1
                           ? std::min<int64_t>(p.max_context, static_cast<int64_t>(p.window) + 63)
                           : p.max_context;
  const int nparts = static_cast<int>(std::max<int64_t>(1, (span + partition - 1) / partition));
  int nsplit = p.num_splits;
  if (nsplit <= 0) {
    // Pick the split count by a wave model: CTAs resident at once (the device's SMs x the CTAs
    // its shared memory holds), time ~ waves x (keys per CTA + a fixed start-up worth ~128 keys).
    // Fewer splits win ties: each extra split costs a partial-output write and read plus the merge.
    // Warp decode: modelled as at most two CTAs per SM although three may fit (WarpShape): two
    // already saturate memory, so a third adds no throughput, and counting it made the model split
    // large batches that run faster unsplit (sweeps in benchmarks/NOTES_attention_cuda.md).
    const int per_sm = warp_decode ? std::min(2, warp_decode_ctas_per_sm(p.head_dim, lim.smem_per_sm))
                       : prefill   ? paged_attention_prefill_ctas_per_sm(p.head_dim, lim.smem_per_sm)
                                   : resident_ctas(p.head_dim, ts.qpt * ts.hpt > 8, p.pv_quant == PvQuant::kNone,
                                                   lim.smem_per_sm);
    const int64_t conc = static_cast<int64_t>(lim.sms) * per_sm;
    const int64_t base = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * ts.n_ht * ts.n_qt;
    int64_t best_cost = -1;
    for (int ns = 1; ns <= nparts; ++ns) {
      const int ppc = (nparts + ns - 1) / ns;
      if ((nparts + ppc - 1) / ppc != ns) continue;  // same as a smaller ns
      const int64_t waves = (base * ns + conc - 1) / conc;
      const int64_t cost = waves * (static_cast<int64_t>(ppc) * partition + 128);
      if (best_cost < 0 || cost < best_cost) {
        best_cost = cost;
        nsplit = ns;
      }
    }
  }
  nsplit = std::min(nsplit, nparts);
  ts.ppc = (nparts + nsplit - 1) / nsplit;
  ts.nsplit = (nparts + ts.ppc - 1) / ts.ppc;
  return ts;
}

// Shared 64-key stages (VROWS) need blocks of 64+ keys and 64-aligned split starts (partitions
// are multiples of 32 only).
bool warp_decode_vrows(const PagedAttentionParams& p, const TileShape& ts) {
  return p.block_size >= 64 && (ts.ppc * p.partition_size) % 64 == 0;
}

// Head dim 64 with shared 64-key stages: which loop and CTA shape (read at each launch: the
// tests run each, benchmarks compare them). Default: the one-stage loop with 8 warps and 2-slot
// rings (four pairs sharing stages; two CTAs an SM, so 16 warps hide the cache loads' latency
// where the 4-warp shapes have 8: this decode waits on memory latency, not bandwidth);
// ORT_OPS_PA_DECODE=dual the dual-stage loop (4 warps, 4-slot rings); =single the one-stage loop
// (4 warps, 3 slots).
enum class D64Loop { kDual, kSingle, kWide };
D64Loop warp_decode_d64_loop(const PagedAttentionParams& p, const TileShape& ts) {
  if (p.head_dim != 64 || !warp_decode_vrows(p, ts)) return D64Loop::kSingle;
  const char* force = std::getenv("ORT_OPS_PA_DECODE");
  if (force != nullptr && std::strcmp(force, "single") == 0) return D64Loop::kSingle;
  if (force != nullptr && std::strcmp(force, "dual") == 0) return D64Loop::kDual;
  return D64Loop::kWide;
}

// FORM: kAnyStages (shared 64-key stages where warp_decode_vrows allows, else per-warp ones),
// kSharedStages (the caller checked warp_decode_vrows), kDualStages (shared, the dual loop).
enum WarpForm { kAnyStages, kSharedStages, kDualStages };
template <int D, PvQuant PV, int DW, int NS, WarpForm FORM>
cudaError_t launch_warp(const PagedAttentionParams& p, const TileShape& ts, int64_t ctas, cudaStream_t stream) {
  using C = WCfg<D, DW, NS>;
  auto kernel = [&] {
    if constexpr (FORM == kDualStages)
      return decode_warp_kernel<D, PV, DW, NS, true, true>;
    else if constexpr (FORM == kSharedStages)
      return decode_warp_kernel<D, PV, DW, NS, true, false>;
    else
      return warp_decode_vrows(p, ts) ? decode_warp_kernel<D, PV, DW, NS, true, false>
                                      : decode_warp_kernel<D, PV, DW, NS, false, false>;
  }();
  const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::BYTES);
  if (attr != cudaSuccess) return attr;
  // While a CUDA graph is captured, a programmatic dependent of the previous kernel (cuda/launch.cuh).
  if (cuda_util::dependent_launch_pays(stream))
    return cuda_util::launch_dependent(kernel, dim3(static_cast<unsigned>(ctas)), dim3(32 * DW), C::BYTES, stream, p, ts);
  kernel<<<static_cast<unsigned>(ctas), 32 * DW, C::BYTES, stream>>>(p, ts);
  return cudaGetLastError();
}

template <int D, PvQuant PV>
cudaError_t launch_d_pv(const PagedAttentionParams& p, const TileShape& ts, cudaStream_t stream) {
  const int rows_used = ts.qpt * ts.hpt;
  const int bytes = rows_used > 8 ? Cfg<D, 16>::bytes(PV == PvQuant::kNone) : Cfg<D, 8>::bytes(PV == PvQuant::kNone);
  const int64_t ctas = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * ts.n_ht * ts.nsplit * ts.n_qt;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (ctas == 0) return cudaSuccess;
  if constexpr (D <= 128) {
    if (use_warp_decode(p)) {
      cudaError_t attr;
      if constexpr (D == 64) {
        switch (warp_decode_d64_loop(p, ts)) {
          case D64Loop::kDual: attr = launch_warp<64, PV, 4, 4, kDualStages>(p, ts, ctas, stream); break;
          case D64Loop::kWide: attr = launch_warp<64, PV, 8, 2, kSharedStages>(p, ts, ctas, stream); break;
          default:
            attr = launch_warp<64, PV, WarpShape<64>::DW, WarpShape<64>::NS, kAnyStages>(p, ts, ctas, stream);
        }
      } else
        attr = launch_warp<D, PV, WarpShape<D>::DW, WarpShape<D>::NS, kAnyStages>(p, ts, ctas, stream);
      if (attr != cudaSuccess) return attr;
    }
  }
  if (!(D <= 128 && use_warp_decode(p)) && paged_attention_prefill_applies(p)) {
    const cudaError_t e = launch_paged_attention_prefill(p, PrefillTiling{ts.n_qt, ts.qpt, ts.nsplit, ts.ppc}, stream);
    if (e != cudaSuccess) return e;
  } else if (!(D <= 128 && use_warp_decode(p))) {
    auto kernel = rows_used > 8 ? paged_attention_kernel<D, PV, true> : paged_attention_kernel<D, PV, false>;
    if (bytes > 48 * 1024) {
      cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      if (err != cudaSuccess) return err;
    }
    kernel<<<static_cast<unsigned>(ctas), Cfg<D, 8>::THREADS, bytes, stream>>>(p, ts);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || ts.nsplit == 1) return err;
  // The merge is a programmatic dependent launch where the GPU has it (sm_90): its launch
  // overlaps the attention grid's tail instead of following it.
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(static_cast<int64_t>(p.num_tokens) * p.num_heads));
  cfg.blockDim = dim3(D);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (sm_major() >= 9) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, merge_splits_kernel<D>, p, ts.nsplit);
}

template <int D>
cudaError_t launch_d(const PagedAttentionParams& p, const TileShape& ts, cudaStream_t stream) {
  switch (p.pv_quant) {
    case PvQuant::kS8: return launch_d_pv<D, PvQuant::kS8>(p, ts, stream);
    case PvQuant::kU8: return launch_d_pv<D, PvQuant::kU8>(p, ts, stream);
    case PvQuant::kNone: return launch_d_pv<D, PvQuant::kNone>(p, ts, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

const char* paged_attention_unsupported(const PagedAttentionParams& p) {
  if (p.head_dim != 32 && p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return "head_dim must be one of {32, 64, 128, 256} on CUDA";
  if (p.block_size < 16 || (p.block_size & (p.block_size - 1)) != 0)
    return "block_size must be a power of two >= 16 on CUDA (16-byte V loads within one block)";
  if (p.partition_size <= 0 || p.partition_size % 32 != 0) return "partition_size must be a positive multiple of 32";
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return "query heads must be a multiple of kv heads";
  if (p.max_q_len < 1) return "max_q_len must be >= 1";
  if (p.window < 0) return "window must be >= 0 (0: no window)";
  if (!(p.softcap >= 0.0f) || p.softcap > 3.4e38f) return "softcap must be finite and >= 0 (0: off)";
  return nullptr;
}

DeviceLimits current_device_limits() {
  static DeviceLimits cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return DeviceLimits{};
  if (cache[dev].smem_per_sm == 0) {
    int sms = 0, smem = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess || sms < 1)
      return DeviceLimits{};
    cache[dev] = DeviceLimits{sms, smem};
  }
  return cache[dev];
}

int paged_attention_num_splits(const PagedAttentionParams& p) {
  return tile_shape(p, use_warp_decode(p), current_device_limits()).nsplit;
}

int paged_attention_num_splits(const PagedAttentionParams& p, const DeviceLimits& lim) {
  return tile_shape(p, use_warp_decode(p), lim).nsplit;
}

bool paged_attention_decode_kernel_applies(const PagedAttentionParams& p) { return warp_decode_shape(p); }

size_t paged_attention_workspace_bytes(const PagedAttentionParams& p) {
  auto bytes = [&](const TileShape& ts) -> size_t {
    if (ts.nsplit == 1) return 0;
    const size_t rows = static_cast<size_t>(p.num_tokens) * p.num_heads * ts.nsplit;
    return rows * p.head_dim * sizeof(float) + rows * 2 * sizeof(float);
  };
  const DeviceLimits lim = current_device_limits();
  const size_t general = bytes(tile_shape(p, false, lim));
  return warp_decode_shape(p) ? std::max(general, bytes(tile_shape(p, true, lim))) : general;
}

cudaError_t launch_paged_attention_int8(const PagedAttentionParams& p, cudaStream_t stream) {
  // The status word is checked here, not in paged_attention_unsupported: the ORT glue asks that
  // question before it has allocated the word.
  if (paged_attention_unsupported(p) != nullptr || p.status == nullptr) return cudaErrorInvalidValue;
  if (p.num_tokens == 0 || p.num_seqs == 0) return cudaSuccess;
  const TileShape ts = tile_shape(p, use_warp_decode(p), current_device_limits());
  if (ts.nsplit > 1 && p.workspace == nullptr) return cudaErrorInvalidValue;
  PagedAttentionParams q = p;
  q.log2_block_size = 0;
  while ((1 << q.log2_block_size) < q.block_size) ++q.log2_block_size;
  switch (p.head_dim) {
    case 32: return launch_d<32>(q, ts, stream);
    case 64: return launch_d<64>(q, ts, stream);
    case 128: return launch_d<128>(q, ts, stream);
    case 256: return launch_d<256>(q, ts, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ort_ops
