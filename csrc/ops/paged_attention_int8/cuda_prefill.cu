// SPDX-License-Identifier: MIT
// PagedAttentionInt8 prefill kernel: 64 (query, q head) rows per CTA. Spec:
// ort_ops/ops/paged_attention_int8.py; launcher contract: cuda.cuh; dispatch: cuda.cu's
// launch_d_pv and tile_shape (paged_attention_prefill_applies below says which launches).
//
// Why a new kernel. The general kernel (cuda.cu, paged_attention_kernel) runs prefill with 16 rows
// per CTA of 8 warps and four barrier-separated phases per 128-key stage (scores and codes go
// through shared memory): a small fraction of what the matrix units can do, so INT8 P.V saves
// little against its float twin there (benchmarks/NOTES_attention_cuda.md). Here:
//
// CTA = 4 warps = one row tile (64 / G queries x the G q heads of one kv head; G in {1, 2, 4, 8})
// x one kv head x one key split. Warp w owns rows 16w .. 16w+15 of the tile: row r is query r / G,
// head r % G, so a warp holds 16 / G consecutive queries of all G heads. Why not one head per
// warp: the causal limit of a warp is then its own 16 / G queries (its last stages are masked or
// skipped on their own), and every G in {1, 2, 4, 8} maps the same way (G = 1: 16 queries).
// The warps share each 64-key stage in shared memory: a 3-slot cp.async ring (two stages in
// flight while one is computed), one __syncthreads per stage (it also frees the slot that the
// stage's refill overwrites). A stage holds K (64 rows of D bytes, padded to D+16), V as one
// [D][64] slot (whole 64-byte rows of a block-64 cache: each cp.async instruction copies 32
// whole rows, so a 128-byte line is contiguous in global AND shared memory: one L2 request; the
// 32-byte halves of row d swapped when bit 1 of d is set, so the 8-byte B reads of a half-warp
// hit distinct banks, as in decode_warp_kernel) and both per-token scales.
// Per stage, each warp on its own (online softmax per row, scores, codes and O in registers):
//   Q.K  m16n8k32 s8 with the warp's 16 rows as A (rows g and g+8 of lane (g, t)); 8 n-tiles
//        of 8 keys. Column n of n-tile j (group j / 4, jj = j % 4) is key 32 (j / 4) +
//        8 (n >> 1) + 2 jj + (n & 1): lane (g, t) accumulates keys 8t .. 8t+7 of each 32-key
//        group for rows g and g+8 (decode_warp_kernel's permutation, fragments.py
//        nvidia_qk_decode_keys), so softmax, W and the codes never leave its registers.
//   softmax: the stage max per row (both groups), lazy rescaling of O and l (only when a row's
//        max passes its reference by more than kLazyRescale), e = exp(s - m_stage), W = e * sV.
//   P.V  per 32-key group (= one W scale group, its own max and code factor), m16n8k32 (s8 x s8
//        or u8 x s8): A slots 4t..4t+3 / 16+4t.. of rows g / g+8 are the lane's own codes of
//        keys 8t..8t+3 / 8t+4..8t+7, B is one 8-byte read of V row d at keys 8t..8t+7; every
//        MMA's K set is exactly its group's 32 keys (the placement of
//        fragments.nvidia_pv_placement_warp_decode, tests/test_fragments.py; the second row
//        half only adds A rows, which the model's A table already covers).
//   pv none: the float twin, the same with W / max in fp16 on two m16n8k16 per group and V
//        codes converted to fp16 (exact): the two differ only in the P.V instruction.
//   Order: both groups' W and max reductions, then both groups' codes, then their P.V MMAs
//        interleaved per output n-tile: independent chains side by side, because the kernel is
//        latency bound (below) and a warp must have other work while one chain waits.
// Integer accumulators leave the tensor cores as floats without I2F (a quarter-rate conversion
// on sm_80/90, 16 a clock per SM, which would bound this kernel): each integer MMA starts from
// C = 0x4B400000 (the float 1.5 * 2^23), so for |sum| < 2^22 the result's bits are the float
// 1.5 * 2^23 + sum and one FADD gives sum exactly (|Q.K| <= 127 * 128 * 128, |P.V| <= 255 * 128
// * 32). Codes likewise: rint(min(W * L / max, L)) + 1.5 * 2^23 in one FADD holds the code in
// its low byte (round half to even, as rintf), packed by PRMT. Scores, codes and group scales
// are the same float32 operations as the reference's (bit-identical scores; codes equal up to
// the exp's rounding, tests/tolerances.py).
// Causal masking only on the stages that reach past the warp's first query; stages past its last
// query are skipped. Window (DESIGN.md): the CTA starts at its first query's window start
// (aligned down to 32, or 64 for blocks of 64+), 16-key chunks wholly before it are not read
// (B 16: their blocks lie wholly before the window), stages before every row's window are
// skipped and the window's lower bound joins the mask. Softcap where the scores are made; the
// sink in the final denominator (or the merge kernel's, with splits). Keys are split across CTAs
// only when the row tiles do not fill the GPU (cuda.cu's wave model; at 512 new tokens x 32 heads
// there are 256 CTAs, one split); splits write O / l, m, l to the workspace and cuda.cu's merge
// kernel combines them.
// Not matrix-bound: with 2 warps per scheduler (two CTAs an SM by registers) the kernel waits on
// fixed-latency dependencies, about 1200 instructions per warp per stage against 64 IMMA, so INT8
// P.V wins by instructions: the float twin executes more (V to fp16, the W / max divisions,
// twice the MMAs). Timings and profiles: benchmarks/NOTES_attention_cuda.md.
// Steps (each __forceinline__; the ones shared with cuda.cu's kernels are in cuda_steps.cuh):
// prefill_work (the CTA's sequence, split and keys), prefill_rows (the lane's two rows and the
// warp's bounds), PfLoader (stage copies), prefill_stage per stage (prefill_scores, rescale_row,
// group_weights8, prefill_pv_f16 / prefill_pv_int8), prefill_write_out.
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ops/paged_attention_int8/cuda_device.cuh"
#include "ops/paged_attention_int8/cuda_prefill.cuh"
#include "ops/paged_attention_int8/cuda_steps.cuh"

namespace ort_ops {
namespace {

constexpr float kPfNegInf = -__builtin_huge_valf();
constexpr int kPfWarps = 4;
constexpr int kPfThreads = 32 * kPfWarps;
constexpr int kPfKeys = 64;                   // keys per stage
constexpr uint32_t kMagic = 0x4B400000u;      // bits of 1.5 * 2^23
constexpr float kMagicF = 12582912.0f;        // 1.5 * 2^23

template <int D>
struct PCfg {
  static constexpr int NS = 3;                // ring slots
  static constexpr int KS = D + 16;           // K row stride: 8-lane phases of 16-byte reads on distinct banks
  static constexpr int V_OFF = 0;             // V [D][64]
  static constexpr int K_OFF = D * kPfKeys;
  static constexpr int SK_OFF = K_OFF + kPfKeys * KS;
  static constexpr int SV_OFF = SK_OFF + kPfKeys * 4;
  static constexpr int STAGE = SV_OFF + kPfKeys * 4;
  static constexpr int BYTES = NS * STAGE;
  // CTAs per SM: registers (launch bound) and shared memory (1 KB reserved per CTA) on sm_90.
  static constexpr int MIN_BLOCKS = D <= 64 ? 3 : 2;
  static_assert(MIN_BLOCKS * (BYTES + 1024) <= kSm90SmemPerSm, "resident prefill CTAs fit in shared memory");
};

// The exact value of an integer accumulator that started from kMagic (|sum| < 2^22).
__device__ __forceinline__ float magic_value(int acc) { return __fsub_rn(__int_as_float(acc), kMagicF); }

// Code rint(min(x, levels)) for x >= 0 in the low byte of the result (the FADD rounds half to even).
__device__ __forceinline__ uint32_t code_bits(float x, float levels) {
  return static_cast<uint32_t>(__float_as_int(__fadd_rn(fminf(x, levels), kMagicF)));
}
// Low bytes of four code words -> one packed word (byte k = code k).
__device__ __forceinline__ uint32_t pack4(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  return __byte_perm(__byte_perm(c0, c1, 0x0040), __byte_perm(c2, c3, 0x0040), 0x5410);
}

// ---- the CTA's work and its warps' rows ----
// (sequence, kv head, split, row tile) of the CTA, the tile's queries and the split's keys.
struct PfWork {
  int s, h, split;
  int q_start, q_len, q0;  // the sequence's query rows; the tile's first query
  int seq_len, first_pos;  // first_pos: position of query 0
  int k_first;             // the tile's first query's window start (0 without a window)
  int k_lo, k_hi, nst;     // this split's keys [k_lo, k_hi), in nst stages
};

// Decodes blockIdx.x (row tile fastest) and checks the sequence's rows and length. Returns false
// when the CTA has nothing to do (a tile past the sequence's queries, or a flagged bad input).
__device__ __forceinline__ bool prefill_work(const PagedAttentionParams& p, const PrefillTiling& tl, int tid, PfWork& w) {
  const int Hkv = p.num_kv_heads, B = p.block_size;
  int64_t idx = blockIdx.x;
  const int qtile = static_cast<int>(idx % tl.n_qt);
  idx /= tl.n_qt;
  w.split = static_cast<int>(idx % tl.nsplit);
  idx /= tl.nsplit;
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
  w.q0 = qtile * tl.qpt;
  if (w.q0 >= w.q_len) return false;
  w.seq_len = p.seq_lens[w.s];
  const int partition = p.partition_size;
  if (w.seq_len < w.q_len || w.seq_len > p.max_blocks * B ||
      w.seq_len > static_cast<int64_t>(tl.nsplit) * tl.ppc * partition) {
    if (tid == 0) atomicOr(p.status, kPaSeqLenOutOfRange);
    return false;
  }
  const int q_last = min(w.q_len, w.q0 + tl.qpt) - 1;  // last query of the tile
  w.first_pos = w.seq_len - w.q_len;
  w.k_first = window_first(w.first_pos + w.q0, p.window);
  const int k_split = w.split * tl.ppc * partition;
  w.k_lo = max(k_split, w.k_first & ~(B >= 64 ? 63 : 31));
  w.k_hi = min(k_split + tl.ppc * partition, w.first_pos + q_last + 1);
  w.nst = w.k_hi > w.k_lo ? (w.k_hi - w.k_lo + kPfKeys - 1) / kPfKeys : 0;
  return true;
}

// This lane's two rows (g and g+8 of the warp's 16): query token and q head (token -1: a row
// past the tile), the keys each sees [wlo, lim), and the warp's extremes of both bounds.
struct PfRows {
  int qtok[2], qhead[2], lim[2], wlo[2];
  int w_lo, w_hi;              // the warp's smallest and largest row limit (valid rows)
  int w_first_lo, w_first_hi;  // and its rows' smallest and largest window start
};

__device__ __forceinline__ void prefill_rows(const PagedAttentionParams& p, const PrefillTiling& tl, const PfWork& w,
                                             int warp, int g, PfRows& r) {
  const int G = p.num_heads / p.num_kv_heads;
  const int lg = __ffs(G) - 1;  // G is a power of two (<= 8)
  const int rows_used = tl.qpt << lg;
  r.w_lo = 0x7fffffff;
  r.w_hi = 0;
  r.w_first_lo = 0x7fffffff;
  r.w_first_hi = 0;
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int row = 16 * warp + g + 8 * ri;
    const int qi = w.q0 + (row >> lg);
    const bool ok = row < rows_used && qi < w.q_len;
    r.qtok[ri] = ok ? w.q_start + qi : -1;
    r.qhead[ri] = w.h * G + (row & (G - 1));
    r.lim[ri] = ok ? min(w.first_pos + qi + 1, w.k_hi) : 0;
    r.wlo[ri] = window_first(w.first_pos + qi, p.window);  // the row sees keys [wlo, lim)
    if (ok) {
      r.w_lo = min(r.w_lo, r.lim[ri]);
      r.w_hi = max(r.w_hi, r.lim[ri]);
      r.w_first_lo = min(r.w_first_lo, r.wlo[ri]);
      r.w_first_hi = max(r.w_first_hi, r.wlo[ri]);
    }
  }
  r.w_lo = __reduce_min_sync(0xffffffffu, r.w_lo);
  r.w_hi = __reduce_max_sync(0xffffffffu, r.w_hi);
  r.w_first_lo = __reduce_min_sync(0xffffffffu, r.w_first_lo);
  r.w_first_hi = __reduce_max_sync(0xffffffffu, r.w_first_hi);
  // Rows past the tile see what the warp's last row sees (their q is zero; never written), so
  // that they do not force the masked path.
#pragma unroll
  for (int ri = 0; ri < 2; ++ri)
    if (r.qtok[ri] < 0) {
      r.lim[ri] = r.w_hi;
      r.wlo[ri] = r.w_first_hi;
    }
}

// ---- stage copies: a 64-key stage of K, V and both scales into ring slot j % NS ----
// Block ids of a stage's four 16-key chunks (B >= 16: a chunk is in one block; stages start at
// multiples of 32) are loaded raw one stage ahead of the copies (raw_ids) and checked where the
// copies are issued. Per-thread source offsets and shared-memory destinations are fixed for the
// whole loop; a stage adds only its blocks' bases and the key offset in the block.
template <int D>
struct PfLoader {
  using C = PCfg<D>;
  static constexpr int KPR = D / 16;                      // 16-byte chunks of one K row
  static constexpr int NKC = kPfKeys * KPR / kPfThreads;  // K chunks per thread per stage
  static constexpr int KSTEP = kPfThreads / KPR;          // keys between a thread's K chunks
  static constexpr int NVC = D * 4 / kPfThreads;          // V chunks per thread per stage
  static_assert(NKC >= 1 && NVC >= 1 && KSTEP % 16 == 0, "stage shape");

  const PagedAttentionParams& p;
  const int32_t* bt;
  int tid, B, lb, Hkv, blk_stride, k_first, k_lo, k_hi, nst;
  int kkey;  // K chunk i: key kkey + KSTEP i
  const int8_t* k_thr;
  unsigned k_dst;
  int vq;  // V chunk i: row vr + 32 i, keys 16 vq .. 16 vq + 15 (a 128-thread instruction = 32 whole rows)
  const int8_t* v_thr;
  unsigned v_dst;
  int s_key;  // scales: threads 0..15 K scales, 16..31 V scales, 4 keys each
  const float* s_thr;
  unsigned s_dst;
  // Blocks of 64+ keys with 64-aligned stages (split starts): each stage lies in one block, so one
  // id, one check and immediate offsets (B 64 at compile time: the V row stride too). Keys past
  // k_hi in that block are copied as they are (a block the context needs); the stage masks them.
  bool whole;

  __device__ __forceinline__ PfLoader(const PagedAttentionParams& p_, const PfWork& w, unsigned char* smem, int tid_)
      : p(p_), tid(tid_) {
    B = p.block_size;
    Hkv = p.num_kv_heads;
    bt = p.block_tables + static_cast<int64_t>(w.s) * p.max_blocks;
    lb = p.log2_block_size;
    k_first = w.k_first;
    k_lo = w.k_lo;
    k_hi = w.k_hi;
    nst = w.nst;
    blk_stride = Hkv * B * D;  // bytes per cache block (K or V)
    kkey = tid / KPR;
    const int kpart = tid % KPR;
    k_thr = p.key_cache + static_cast<int64_t>(w.h) * B * D + kpart * 16;
    const unsigned smem_base = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    k_dst = smem_base + C::K_OFF + kkey * C::KS + kpart * 16;
    const int vr = tid >> 2;
    vq = tid & 3;
    v_thr = p.value_cache + (static_cast<int64_t>(w.h) * D + vr) * B;
    v_dst = smem_base + C::V_OFF + vr * 64 + 32 * ((vq >> 1) ^ ((vr >> 1) & 1)) + 16 * (vq & 1);
    s_key = 4 * (tid & 15);
    s_thr = (tid >= 16 ? p.value_scale : p.key_scale) + static_cast<int64_t>(w.h) * B;
    s_dst = smem_base + (tid >= 16 ? C::SV_OFF : C::SK_OFF) + s_key * 4;
    whole = B >= 64 && (k_lo & 63) == 0;
  }

  // B 16: a chunk wholly before the window lies in a block wholly before it: not read. (B >= 32:
  // the first stage's chunks share k_first's block, k_lo being aligned down to 32 or 64 within it.)
  __device__ __forceinline__ bool before(int pos) const { return B < 32 && pos + 16 <= k_first; }

  __device__ __forceinline__ void raw_ids(int j, int (&r)[4]) const {
    const int pos = k_lo + kPfKeys * j;
    const bool live = j < nst;
    // Chunks 0/1 and 2/3 share a block when B >= 32 (pos is a multiple of 32); all four when B >= 64
    // and pos is a multiple of 64.
    r[0] = live && pos < k_hi && !before(pos) ? bt[pos >> lb] : -1;
    r[1] = live && pos + 16 < k_hi && !before(pos + 16) ? (B >= 32 ? r[0] : bt[(pos + 16) >> lb]) : -1;
    r[2] = live && pos + 32 < k_hi ? (B >= 64 && (pos & 63) == 0 ? r[0] : bt[(pos + 32) >> lb]) : -1;
    r[3] = live && pos + 48 < k_hi ? (B >= 32 ? r[2] : bt[(pos + 48) >> lb]) : -1;
  }

  // A stage inside one block (whole): BC = B at compile time, or 0 (B at run time).
  template <int BC>
  __device__ __forceinline__ void issue_whole(unsigned so, int pos, int r0) const {
    const int Bv = BC ? BC : B;
    const bool ok = static_cast<unsigned>(r0) < static_cast<unsigned>(p.num_blocks);
    if (!ok) atomicOr(p.status, kPaBlockOutOfRange);  // pos < k_hi: the block is needed
    const int b = ok ? r0 : 0;
    const int off = pos & (Bv - 1);
    const int8_t* kb = k_thr + kkey * D + static_cast<int64_t>(b) * blk_stride + off * D;
#pragma unroll
    for (int i = 0; i < NKC; ++i) cp_async16_s(k_dst + so + KSTEP * i * C::KS, kb + KSTEP * i * D, ok);
    const int8_t* vb = v_thr + 16 * vq + static_cast<int64_t>(b) * blk_stride + off;
#pragma unroll
    for (int i = 0; i < NVC; ++i) cp_async16_s(v_dst + so + 32 * i * 64, vb + 32 * i * Bv, ok);
    if (tid < 32) cp_async16_s(s_dst + so, s_thr + s_key + static_cast<int64_t>(b) * (Hkv * Bv) + off, ok);
  }

  // A stage of four 16-key chunks, each checked and copied from its own block.
  __device__ __forceinline__ void issue_chunks(unsigned so, int pos, const int (&r)[4]) const {
    bool ok[4];
    int b[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const bool live = pos + 16 * c < k_hi && !before(pos + 16 * c);
      ok[c] = live && static_cast<unsigned>(r[c]) < static_cast<unsigned>(p.num_blocks);
      if (live && !ok[c]) atomicOr(p.status, kPaBlockOutOfRange);
      b[c] = ok[c] ? r[c] : 0;
    }
    // Chunk c of the four by a run-time c without indexing a register array (local memory).
    auto bsel = [&](int c) { return c & 2 ? (c & 1 ? b[3] : b[2]) : (c & 1 ? b[1] : b[0]); };
    auto oksel = [&](int c) { return c & 2 ? (c & 1 ? ok[3] : ok[2]) : (c & 1 ? ok[1] : ok[0]); };
#pragma unroll
    for (int i = 0; i < NKC; ++i) {
      const int key = kkey + KSTEP * i;
      const int c = KSTEP == 16 ? i : (kkey >> 4) + (KSTEP / 16) * i;  // D 128: chunk i
      const int8_t* src = k_thr + static_cast<int64_t>(bsel(c)) * blk_stride + ((pos + key) & (B - 1)) * D;
      cp_async16_s(k_dst + so + KSTEP * i * C::KS, src, oksel(c));
    }
    {
      const int8_t* src = v_thr + static_cast<int64_t>(bsel(vq)) * blk_stride + ((pos + 16 * vq) & (B - 1));
      const bool okv = oksel(vq);
#pragma unroll
      for (int i = 0; i < NVC; ++i) cp_async16_s(v_dst + so + 32 * i * 64, src + 32 * i * B, okv);
    }
    if (tid < 32) {
      const int c = s_key >> 4;
      const float* src = s_thr + static_cast<int64_t>(bsel(c)) * (Hkv * B) + ((pos + s_key) & (B - 1));
      cp_async16_s(s_dst + so, src, oksel(c));
    }
  }

  // Stage j's copies (none past the last stage) and their commit group: one group per stage, so
  // that wait_group keeps counting stages.
  __device__ __forceinline__ void issue(int j, const int (&r)[4]) const {
    if (j < nst && whole) {
      const unsigned so = (j % C::NS) * C::STAGE;
      const int pos = k_lo + kPfKeys * j;
      if (B == 64)
        issue_whole<64>(so, pos, r[0]);
      else
        issue_whole<0>(so, pos, r[0]);
    } else if (j < nst) {
      issue_chunks((j % C::NS) * C::STAGE, k_lo + kPfKeys * j, r);
    }
    cp_async_commit();
  }
};

// ---- one 64-key stage of one warp (its 16 rows; online softmax, scores, codes and O in registers) ----
// Q.K: lane (g, t) gets keys 32 grp + 8t .. +7 (grp 0, 1) of rows g and g+8 as sc[ri][8 grp + k],
// each row's stage max in mp (over the 4 lanes of g), and the keys' V scales in svv. MASK: some
// key of the stage is outside some row's [wlo, lim): those scores are -inf.
template <int D, bool MASK>
__device__ __forceinline__ void prefill_scores(const unsigned char* st, int kp0, const uint32_t (&qa)[2][D / 16],
                                               const float (&sq)[2], const PfRows& rows, float scale, float softcap,
                                               int g, int t, float (&sc)[2][16], float (&mp)[2], float (&svv)[16]) {
  using C = PCfg<D>;
  const int krow0 = 8 * (g >> 1) + (g & 1);  // n-tile jj's B row (key) for this lane: krow0 + 2 jj
  int acc[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t kw[D / 16];
    load_words<D / 64>(st + C::K_OFF + (32 * (j >> 2) + krow0 + 2 * (j & 3)) * C::KS + t * (D / 4), kw);
    mma_i8_c<false>(acc[j], qa[0][0], qa[1][0], qa[0][1], qa[1][1], kw[0], kw[1], kMagic);
#pragma unroll
    for (int c = 1; c < D / 32; ++c)
      mma_i8<false>(acc[j], qa[0][2 * c], qa[1][2 * c], qa[0][2 * c + 1], qa[1][2 * c + 1], kw[2 * c], kw[2 * c + 1]);
  }
  float skv[16];
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
    const float* sk = reinterpret_cast<const float*>(st + C::SK_OFF) + 32 * grp + 8 * t;
    const float* sv = reinterpret_cast<const float*>(st + C::SV_OFF) + 32 * grp + 8 * t;
    const float4 k0 = reinterpret_cast<const float4*>(sk)[0], k1 = reinterpret_cast<const float4*>(sk)[1];
    const float4 v0 = reinterpret_cast<const float4*>(sv)[0], v1 = reinterpret_cast<const float4*>(sv)[1];
    const float kk[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
    const float vv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      skv[8 * grp + k] = kk[k];
      svv[8 * grp + k] = vv[k];
    }
  }
  // Scores bit-identical to the reference's (same int32 dot, same float32 multiplies).
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int lim_t = rows.lim[ri] - kp0 - 8 * t;  // key 32 grp + 8t + k visible iff lo_t <= 32 grp + k < lim_t
    const int lo_t = rows.wlo[ri] - kp0 - 8 * t;
    mp[ri] = kPfNegInf;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int grp = i >> 3, k = i & 7;
      const float v = qk_score(magic_value(acc[4 * grp + (k >> 1)][2 * ri + (k & 1)]), sq[ri], skv[i], scale, softcap);
      sc[ri][i] = (!MASK || (32 * grp + k < lim_t && 32 * grp + k >= lo_t)) ? v : kPfNegInf;
      mp[ri] = fmaxf(mp[ri], sc[ri][i]);
    }
    mp[ri] = warp_max4(mp[ri]);
  }
}

// P.V of the stage's two groups, float twin: W / max in fp16, group scale max * beta.
template <int D>
__device__ __forceinline__ void prefill_pv_f16(const float (&wv)[2][2][8], const float (&gmax)[2][2],
                                               const float (&beta)[2], const unsigned char* v_sm0,
                                               const unsigned char* v_sm1, float (&o)[D / 8][4]) {
  uint32_t a[2][2][4];
  float gs[2][2];
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      codes8_f16(wv[grp][ri], gmax[grp][ri], a[grp][ri]);
      gs[grp][ri] = gmax[grp][ri] * beta[ri];
    }
  }
#pragma unroll
  for (int jn = 0; jn < D / 8; ++jn) {
#pragma unroll
    for (int grp = 0; grp < 2; ++grp) {
      const uint2 x = *reinterpret_cast<const uint2*>((grp ? v_sm1 : v_sm0) + jn * 8 * 64);
      float pacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint32_t(&ag)[2][4] = a[grp];
      pv_f16_8keys(pacc, ag[0][0], ag[1][0], ag[0][1], ag[1][1], ag[0][2], ag[1][2], ag[0][3], ag[1][3], x.x, x.y);
      o[jn][0] = fmaf(gs[grp][0], pacc[0], o[jn][0]);
      o[jn][1] = fmaf(gs[grp][0], pacc[1], o[jn][1]);
      o[jn][2] = fmaf(gs[grp][1], pacc[2], o[jn][2]);
      o[jn][3] = fmaf(gs[grp][1], pacc[3], o[jn][3]);
    }
  }
}

// P.V of the stage's two groups in INT8: codes rint(W * L / max) per 32-key group (code_bits),
// group scale max / L * beta; the MMAs start from kMagic (magic_value reads the sums).
template <int D, PvQuant PV>
__device__ __forceinline__ void prefill_pv_int8(const float (&wv)[2][2][8], const float (&gmax)[2][2],
                                                const float (&beta)[2], const unsigned char* v_sm0,
                                                const unsigned char* v_sm1, float (&o)[D / 8][4]) {
  constexpr float kLevels = PV == PvQuant::kU8 ? 255.0f : 127.0f;
  uint32_t pk[2][2][2];
  float gs[2][2];
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const float inv = code_inverse(gmax[grp][ri], kLevels);
      uint32_t cb[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) cb[k] = code_bits(__fmul_rn(wv[grp][ri][k], inv), kLevels);
      pk[grp][ri][0] = pack4(cb[0], cb[1], cb[2], cb[3]);
      pk[grp][ri][1] = pack4(cb[4], cb[5], cb[6], cb[7]);
      gs[grp][ri] = __fdiv_rn(gmax[grp][ri], kLevels) * beta[ri];
    }
  }
#pragma unroll
  for (int jn = 0; jn < D / 8; ++jn) {
#pragma unroll
    for (int grp = 0; grp < 2; ++grp) {
      const uint2 x = *reinterpret_cast<const uint2*>((grp ? v_sm1 : v_sm0) + jn * 8 * 64);
      int pacc[4];
      mma_i8_c<PV == PvQuant::kU8>(pacc, pk[grp][0][0], pk[grp][1][0], pk[grp][0][1], pk[grp][1][1], x.x, x.y, kMagic);
      o[jn][0] = fmaf(gs[grp][0], magic_value(pacc[0]), o[jn][0]);
      o[jn][1] = fmaf(gs[grp][0], magic_value(pacc[1]), o[jn][1]);
      o[jn][2] = fmaf(gs[grp][1], magic_value(pacc[2]), o[jn][2]);
      o[jn][3] = fmaf(gs[grp][1], magic_value(pacc[3]), o[jn][3]);
    }
  }
}

// One stage: scores, lazy rescaling, weights, then both groups' codes and P.V.
template <int D, PvQuant PV, bool MASK>
__device__ __forceinline__ void prefill_stage(const unsigned char* st, int kp0, const uint32_t (&qa)[2][D / 16],
                                              const float (&sq)[2], const PfRows& rows, float scale, float softcap,
                                              int g, int t, const int (&v_lane)[2], float (&o)[D / 8][4],
                                              float (&m_run)[2], float (&l_run)[2]) {
  float sc[2][16], mp[2], svv[16];
  prefill_scores<D, MASK>(st, kp0, qa, sq, rows, scale, softcap, g, t, sc, mp, svv);
  // Lazy rescaling (decode_warp_kernel): O and l move to a new reference max only when some
  // row's stage max passes it by more than kLazyRescale; codes do not depend on it.
  if (__any_sync(0xffffffffu, mp[0] > m_run[0] + kLazyRescale || mp[1] > m_run[1] + kLazyRescale)) {
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) rescale_row(m_run[ri], l_run[ri], mp[ri], o, 2 * ri);
  }
  float beta[2];
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) beta[ri] = mp[ri] == kPfNegInf ? 0.0f : fast_exp(mp[ri] - m_run[ri]);

  // Both groups' weights first, so that their four max reductions are in flight together; then
  // the codes; then the two groups' P.V MMAs interleaved (independent chains side by side).
  float wv[2][2][8], gmax[2][2], esum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      bool vis[8];  // masked keys: W = 0
#pragma unroll
      for (int k = 0; k < 8; ++k) vis[k] = !MASK || sc[ri][8 * grp + k] != kPfNegInf;
      group_weights8(sc[ri], svv, 8 * grp, vis, mp[ri], wv[grp][ri], esum[ri], gmax[grp][ri]);
    }
  }
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) gmax[grp][ri] = warp_max4(gmax[grp][ri]);
  }
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) l_run[ri] = fmaf(beta[ri], esum[ri], l_run[ri]);
  const unsigned char* v_sm0 = st + PCfg<D>::V_OFF + v_lane[0];
  const unsigned char* v_sm1 = st + PCfg<D>::V_OFF + v_lane[1];
  if constexpr (PV == PvQuant::kNone)
    prefill_pv_f16<D>(wv, gmax, beta, v_sm0, v_sm1, o);
  else
    prefill_pv_int8<D, PV>(wv, gmax, beta, v_sm0, v_sm1, o);
}

// O / l of the lane's two rows (the sink joins l with one split; the merge kernel adds it
// otherwise), or the split's partial O and its m, l.
template <int D>
__device__ __forceinline__ void prefill_write_out(const PagedAttentionParams& p, const PrefillTiling& tl, int split,
                                                  const PfRows& rows, const float (&o)[D / 8][4],
                                                  const float (&m_run)[2], const float (&l_run)[2], int t) {
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    float l = l_run[ri];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (rows.qtok[ri] < 0) continue;
    const float den = tl.nsplit == 1 ? add_sink(l, m_run[ri], p.head_sink, rows.qhead[ri], p.status) : l;
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    const int64_t row = static_cast<int64_t>(rows.qtok[ri]) * p.num_heads + rows.qhead[ri];
#pragma unroll
    for (int jn = 0; jn < D / 8; ++jn)
      store_row2<D>(p, row, tl.nsplit, split, 8 * jn + 2 * t, o[jn][2 * ri] * inv, o[jn][2 * ri + 1] * inv);
    if (tl.nsplit > 1 && t == 0) store_split_ml<D>(p, row, tl.nsplit, split, m_run[ri], l);
  }
}

template <int D, PvQuant PV>
__global__ void __launch_bounds__(kPfThreads, PCfg<D>::MIN_BLOCKS)
    prefill_kernel(PagedAttentionParams p, PrefillTiling tl) {
  using C = PCfg<D>;
  constexpr int NS = C::NS;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;

  PfWork w;
  if (!prefill_work(p, tl, tid, w)) return;
  PfRows rows;
  prefill_rows(p, tl, w, warp, g, rows);

  // Stages 0 .. NS-2 in flight before Q is quantized; block ids one stage ahead of the copies.
  const PfLoader<D> ld(p, w, smem, tid);
  int ids[4];
#pragma unroll
  for (int j = 0; j < NS - 1; ++j) {
    ld.raw_ids(j, ids);
    ld.issue(j, ids);
  }
  ld.raw_ids(NS - 1, ids);

  // Q: this lane's d slice of rows g and g+8 (bit-exact with quantize_rows).
  uint32_t qa[2][D / 16];
  float sq[2];
#pragma unroll
  for (int ri = 0; ri < 2; ++ri)
    if (!quantize_q_slice<D>(p, rows.qtok[ri], rows.qhead[ri], t, qa[ri], sq[ri])) atomicOr(p.status, kPaQueryNonFinite);

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {kPfNegInf, kPfNegInf}, l_run[2] = {0.0f, 0.0f};
  const float scale = p.scale;
  // V row g's bytes of keys 8t.. in each 32-key half (the halves are swapped when bit 1 of g is set).
  const int v_lane[2] = {g * 64 + 32 * ((g >> 1) & 1) + 8 * t, g * 64 + 32 * (1 ^ ((g >> 1) & 1)) + 8 * t};

  for (int j = 0; j < w.nst; ++j) {
    cp_async_wait<NS - 2>();  // this thread's copies of stage j have landed
    __syncthreads();          // everyone's; and every warp is done with stage j - 1's slot
    ld.issue(j + NS - 1, ids);
    ld.raw_ids(j + NS, ids);
    const int kp0 = w.k_lo + kPfKeys * j;
    if (kp0 >= rows.w_hi) continue;  // past every row of this warp (warp-uniform)
    if (kp0 + kPfKeys <= rows.w_first_lo) continue;  // before every row's window
    const unsigned char* st = smem + (j % NS) * C::STAGE;
    if (kp0 + kPfKeys <= rows.w_lo && kp0 >= rows.w_first_hi)
      prefill_stage<D, PV, false>(st, kp0, qa, sq, rows, scale, p.softcap, g, t, v_lane, o, m_run, l_run);
    else
      prefill_stage<D, PV, true>(st, kp0, qa, sq, rows, scale, p.softcap, g, t, v_lane, o, m_run, l_run);
  }
  cp_async_wait<0>();
  prefill_write_out<D>(p, tl, w.split, rows, o, m_run, l_run, t);
}

template <int D, PvQuant PV>
cudaError_t launch(const PagedAttentionParams& p, const PrefillTiling& tl, cudaStream_t stream) {
  const int64_t ctas = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * tl.nsplit * tl.n_qt;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (ctas == 0) return cudaSuccess;
  const cudaError_t attr =
      cudaFuncSetAttribute(prefill_kernel<D, PV>, cudaFuncAttributeMaxDynamicSharedMemorySize, PCfg<D>::BYTES);
  if (attr != cudaSuccess) return attr;
  prefill_kernel<D, PV><<<static_cast<unsigned>(ctas), kPfThreads, PCfg<D>::BYTES, stream>>>(p, tl);
  return cudaGetLastError();
}

template <int D>
cudaError_t launch_d(const PagedAttentionParams& p, const PrefillTiling& tl, cudaStream_t stream) {
  switch (p.pv_quant) {
    case PvQuant::kS8: return launch<D, PvQuant::kS8>(p, tl, stream);
    case PvQuant::kU8: return launch<D, PvQuant::kU8>(p, tl, stream);
    case PvQuant::kNone: return launch<D, PvQuant::kNone>(p, tl, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool paged_attention_prefill_applies(const PagedAttentionParams& p) {
  const char* force = std::getenv("ORT_OPS_PA_PREFILL");
  if (force != nullptr && std::strcmp(force, "general") == 0) return false;
  if (p.head_dim != 64 && p.head_dim != 128) return false;
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return false;
  const int G = p.num_heads / p.num_kv_heads;
  if (G != 1 && G != 2 && G != 4 && G != 8) return false;
  return static_cast<int64_t>(p.max_q_len) * G >= 32;
}

int paged_attention_prefill_ctas_per_sm(int head_dim, int smem_per_sm) {
  auto fit = [&](int by_regs, int bytes) { return std::max(1, std::min(by_regs, smem_per_sm / (bytes + 1024))); };
  return head_dim <= 64 ? fit(PCfg<64>::MIN_BLOCKS, PCfg<64>::BYTES) : fit(PCfg<128>::MIN_BLOCKS, PCfg<128>::BYTES);
}

cudaError_t launch_paged_attention_prefill(const PagedAttentionParams& p, const PrefillTiling& t, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_d<64>(p, t, stream);
    case 128: return launch_d<128>(p, t, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ort_ops
