// SPDX-License-Identifier: MIT
// PagedAttentionInt8 kernels for NVIDIA tensor cores (sm_80+: mma.sync m16n8k32 s8/u8).
// Spec: ort_ops/ops/paged_attention_int8.py; launcher contract: cuda.cuh.
//
// One CTA (4 warps) = one row tile x one kv head x one split of the keys. A row tile is up to 16
// (query, q head) rows that read the same kv head: decode puts the GQA group of one query there,
// so every K/V byte read serves the whole group; prefill packs 16 / G queries x G heads. The
// split walks its key partitions (P keys each) in order:
//   phase 1  Q.K on m16n8k32 s8: lane (g, t) loads D/4 consecutive bytes of key row g of an
//            8-key tile (16-byte loads) and the A fragment holds the same d slice of Q; the d
//            order inside the MMA is a relabelling of the reduction axis, so the dot product
//            is unchanged. Scores (int32 * sQ * sK * scale, causal mask) go to shared memory.
//   phase 2  row max of the partition -> merge factors alpha = exp(M - M'), beta = exp(m_p - M')
//            (online softmax across the split's partitions).
//   phase 3  e = exp(s - m_p), W = e * sV, per 32-key group max -> codes rint(W * L / max),
//            group scale max / L * beta; l_p = sum e.
//   phase 4  P.V on m16n8k32 (s8 x s8 or u8 x s8): warp w owns D/4 output columns; lane (g, t)
//            loads V tokens 16t..16t+15 of column g (one 16-byte load of the token-innermost
//            layout) and swaps halves with lane t^2 so that MMA i consumes exactly keys
//            32i..32i+31 of the 64-key tile (fragment_map.h, proven by tests/test_fragments.py).
//            Each group's int32 sum is scaled by its own group scale (V scales were folded
//            into W in phase 3) and accumulated in float32.
// pv_quant none is the float P.V twin: the same kernel with W / max in fp16 on m16n8k16 and V
// codes converted to fp16 (exact), so INT8 and float P.V differ only in the P.V instruction.
// With more than one split per row tile, each split writes O / l, m, l and a merge kernel
// combines them by log-sum-exp; with one split the output is written directly.
// No full-precision copy of K or V exists anywhere: codes go from memory to the tensor cores.
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "ops/paged_attention_int8/cuda.cuh"
#include "ops/paged_attention_int8/fragment_map.h"

namespace ort_ops {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;           // rows of one MMA tile
constexpr int kMaxPartition = 1024; // larger partition_size values run as 1024 (speed only)
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
struct Layout {
  int pp;        // partition rounded up to a whole 64-key tile
  int s_stride;  // floats per score row; +8 keeps the float2 stores of a half-warp conflict-free
  int c_stride;  // bytes per code row; = 32 (int8) / 64 (fp16) mod 128: fragment reads conflict-free
  int g_stride;  // group scales per row
  int off_s, off_c, off_g, off_misc, bytes;
};

__host__ __device__ inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

__host__ __device__ inline Layout make_layout(int partition, bool fp16_codes) {
  Layout l;
  l.pp = round_up(partition, 64);
  l.s_stride = l.pp + 8;
  l.c_stride = fp16_codes ? round_up(2 * l.pp, 128) + 64 : round_up(l.pp, 128) + 32;
  l.g_stride = l.pp / 32;
  l.off_s = 0;
  l.off_c = l.off_s + kRows * l.s_stride * 4;
  l.off_g = l.off_c + kRows * l.c_stride;
  l.off_misc = l.off_g + kRows * l.g_stride * 4;
  // misc: red_max[4][16], red_sum[4][16], m, l, alpha, beta, mp (16 each), lim (16 ints)
  l.bytes = l.off_misc + (2 * kWarps * kRows + 6 * kRows) * 4;
  return l;
}

// ---- tensor-core wrappers ----
template <bool kU8>
__device__ __forceinline__ void mma_i8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kU8) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#endif
}

__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Four int8 codes -> two half2 (bytes 0,1 and 2,3), exactly: (b + 128) | 0x6400 is the half
// 1024 + b + 128; subtracting 1152 leaves b.
__device__ __forceinline__ void s8x4_to_half2x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = x ^ 0x80808080u;
  const uint32_t l = __byte_perm(u, 0x64646464u, 0x4140);
  const uint32_t h = __byte_perm(u, 0x64646464u, 0x4342);
  const __half2 bias = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
  __half2 lh = __hsub2(*reinterpret_cast<const __half2*>(&l), bias);
  __half2 hh = __hsub2(*reinterpret_cast<const __half2*>(&h), bias);
  lo = *reinterpret_cast<uint32_t*>(&lh);
  hi = *reinterpret_cast<uint32_t*>(&hh);
}

__device__ __forceinline__ float warp_max4(float v) {  // over the 4 lanes of one g (t = 0..3)
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

struct Work {
  int s, h, ht, qtile, split;
  int q_start, q_len, seq_len;
};

struct TileShape {
  int n_qt, n_ht, hpt, qpt, nsplit, ppc;
};

template <int D, PvQuant PV, bool ROWS16>
__global__ void __launch_bounds__(kThreads, D >= 256 ? 2 : 3) paged_attention_kernel(PagedAttentionParams p, TileShape ts) {
  constexpr int QW = D / 16;   // 32-bit words of one row's d slice per lane (D/4 bytes)
  constexpr int NT = D / 32;   // 8-column n-tiles per warp in P.V (warp owns D/4 columns)
  constexpr int KU = D >= 256 ? 2 : 4;  // key tiles loaded ahead in phase 1
  constexpr int VU = D >= 256 ? 1 : 2;  // 64-key V tiles loaded ahead in phase 4
  constexpr bool kF16 = PV == PvQuant::kNone;
  constexpr float kLevels = PV == PvQuant::kU8 ? 255.0f : 127.0f;
  constexpr int kRi = ROWS16 ? 2 : 1;

  extern __shared__ __align__(16) unsigned char smem[];
  const int partition = min(p.partition_size, kMaxPartition);
  const Layout lay = make_layout(partition, kF16);
  float* s_sm = reinterpret_cast<float*>(smem + lay.off_s);
  unsigned char* c_sm = smem + lay.off_c;
  float* g_sm = reinterpret_cast<float*>(smem + lay.off_g);
  float* red_max = reinterpret_cast<float*>(smem + lay.off_misc);
  float* red_sum = red_max + kWarps * kRows;
  float* row_m = red_sum + kWarps * kRows;
  float* row_l = row_m + kRows;
  float* row_alpha = row_l + kRows;
  float* row_beta = row_alpha + kRows;
  float* row_mp = row_beta + kRows;
  int* row_lim = reinterpret_cast<int*>(row_mp + kRows);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int Hq = p.num_heads, Hkv = p.num_kv_heads, B = p.block_size;
  const int G = Hq / Hkv;

  // ---- which work this CTA does ----
  Work w;
  {
    int64_t idx = blockIdx.x;
    w.qtile = static_cast<int>(idx % ts.n_qt);
    idx /= ts.n_qt;
    w.split = static_cast<int>(idx % ts.nsplit);
    idx /= ts.nsplit;
    w.ht = static_cast<int>(idx % ts.n_ht);
    idx /= ts.n_ht;
    w.h = static_cast<int>(idx % Hkv);
    w.s = static_cast<int>(idx / Hkv);
  }
  if (p.cu_seqlens_q != nullptr) {
    w.q_start = p.cu_seqlens_q[w.s];
    const int q_end = p.cu_seqlens_q[w.s + 1];
    w.q_len = q_end - w.q_start;
    const bool bad = w.q_start < 0 || w.q_len < 0 || q_end > p.num_tokens || w.q_len > p.max_q_len ||
                     (w.s == 0 && w.q_start != 0) || (w.s == p.num_seqs - 1 && q_end != p.num_tokens);
    if (bad) {
      if (tid == 0) atomicOr(p.status, kPaCuSeqlensBad);
      return;
    }
  } else {
    w.q_start = w.s;
    w.q_len = 1;
  }
  const int rows_used = ts.qpt * ts.hpt;
  if (w.qtile * ts.qpt >= w.q_len) return;
  w.seq_len = p.seq_lens[w.s];
  const int nparts_total = ts.nsplit * ts.ppc;
  if (w.seq_len < w.q_len || w.seq_len > p.max_blocks * B ||
      w.seq_len > static_cast<int64_t>(nparts_total) * partition) {
    if (tid == 0) atomicOr(p.status, kPaSeqLenOutOfRange);
    return;
  }
  const int last_q = min(w.q_len - 1, w.qtile * ts.qpt + ts.qpt - 1);
  const int key_hi = w.seq_len - w.q_len + last_q + 1;  // keys this tile can see: [0, key_hi)

  // Row r -> (query token, q head); rows past the tile or the group see no keys.
  auto row_info = [&](int r, int& token, int& head) -> int {
    token = -1;
    head = -1;
    if (r >= rows_used) return 0;
    const int qi = w.qtile * ts.qpt + r / ts.hpt;
    const int hl = w.ht * kRows + r % ts.hpt;
    if (qi >= w.q_len || hl >= G) return 0;
    token = w.q_start + qi;
    head = w.h * G + hl;
    return w.seq_len - w.q_len + qi + 1;
  };
  if (tid < kRows) {
    int tok, hd;
    row_lim[tid] = row_info(tid, tok, hd);
    row_m[tid] = kNegInf;
    row_l[tid] = 0.0f;
  }

  // ---- Q: quantize this lane's d slice of rows g and g+8 (bit-exact with quantize_rows) ----
  uint32_t qa[kRi][QW];
  float sq[kRi];
  int lim[kRi], qtok[kRi], qhead[kRi];
#pragma unroll
  for (int ri = 0; ri < kRi; ++ri) {
    lim[ri] = row_info(g + 8 * ri, qtok[ri], qhead[ri]);
    float x[D / 4];
    if (qtok[ri] >= 0) {
      const int64_t base = (static_cast<int64_t>(qtok[ri]) * Hq + qhead[ri]) * D + t * (D / 4);
      if (p.query_fp16) {
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const __half*>(p.query) + base);
#pragma unroll
        for (int i = 0; i < D / 32; ++i) {
          const uint4 v = src[i];
          const __half* hv = reinterpret_cast<const __half*>(&v);
#pragma unroll
          for (int j = 0; j < 8; ++j) x[8 * i + j] = __half2float(hv[j]);
        }
      } else {
        const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p.query) + base);
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
          const float4 v = src[i];
          x[4 * i] = v.x;
          x[4 * i + 1] = v.y;
          x[4 * i + 2] = v.z;
          x[4 * i + 3] = v.w;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 4; ++i) x[i] = 0.0f;
    }
    float amax = 0.0f;
    bool finite = true;
#pragma unroll
    for (int i = 0; i < D / 4; ++i) {
      finite = finite && isfinite(x[i]);
      amax = fmaxf(amax, fabsf(x[i]));
    }
    if (!finite) atomicOr(p.status, kPaQueryNonFinite);
    amax = warp_max4(amax);
    const float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    sq[ri] = __fdiv_rn(amax, 127.0f);
#pragma unroll
    for (int wd = 0; wd < QW; ++wd) {
      uint32_t packed = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float q = fminf(fmaxf(rintf(__fmul_rn(x[4 * wd + b], inv)), -127.0f), 127.0f);
        packed |= (static_cast<uint32_t>(static_cast<int>(q)) & 0xffu) << (8 * b);
      }
      qa[ri][wd] = packed;
    }
  }
  __syncthreads();

  const int32_t* bt = p.block_tables + static_cast<int64_t>(w.s) * p.max_blocks;
  const int64_t blk_stride = static_cast<int64_t>(Hkv) * B * D;  // bytes per cache block (K or V)
  auto block_of = [&](int pos) -> int {  // block of a visible position, or -1 (flagged)
    const int b = bt[pos / B];
    if (b < 0 || b >= p.num_blocks) {
      atomicOr(p.status, kPaBlockOutOfRange);
      return -1;
    }
    return b;
  };

  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const int dbase = warp * (D / 4);

  const int nparts_cta = (key_hi + partition - 1) / partition;
  const int p_begin = w.split * ts.ppc;
  const int p_end = min(p_begin + ts.ppc, nparts_cta);
  for (int part = p_begin; part < p_end; ++part) {
    const int kp0 = part * partition;
    const int kend = min(kp0 + partition, key_hi);
    const int nkeys = kend - kp0;

    // ---- phase 1: scores ----
    float pmax[kRi];
#pragma unroll
    for (int ri = 0; ri < kRi; ++ri) pmax[ri] = kNegInf;
    const int n8 = (nkeys + 7) / 8;
    for (int base = warp; base < n8; base += kWarps * KU) {
      uint32_t kw[KU][QW];
      int kblk[KU];
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const int nt = base + u * kWarps;
        kblk[u] = -1;
        if (nt < n8) {
          const int tile0 = kp0 + nt * 8;  // 8 keys of one block (B % 16 == 0)
          kblk[u] = block_of(tile0);
          const int tok = tile0 + g;
          if (kblk[u] >= 0 && tok < kend) {
            const uint4* src = reinterpret_cast<const uint4*>(
                p.key_cache + kblk[u] * blk_stride + (static_cast<int64_t>(w.h) * B + tok % B) * D + t * (D / 4));
#pragma unroll
            for (int i = 0; i < D / 64; ++i) {
              const uint4 v = src[i];
              kw[u][4 * i] = v.x;
              kw[u][4 * i + 1] = v.y;
              kw[u][4 * i + 2] = v.z;
              kw[u][4 * i + 3] = v.w;
            }
          } else {
#pragma unroll
            for (int i = 0; i < QW; ++i) kw[u][i] = 0u;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        const int nt = base + u * kWarps;
        if (nt >= n8) break;  // warp-uniform
        int acc[4] = {0, 0, 0, 0};
#pragma unroll
        for (int c = 0; c < D / 32; ++c)
          mma_i8<false>(acc, qa[0][2 * c], ROWS16 ? qa[kRi - 1][2 * c] : 0u, qa[0][2 * c + 1],
                        ROWS16 ? qa[kRi - 1][2 * c + 1] : 0u, kw[u][2 * c], kw[u][2 * c + 1]);
        const int tokc = kp0 + nt * 8 + 2 * t;  // this lane's two score columns
        float2 sk = make_float2(0.0f, 0.0f);
        if (kblk[u] >= 0 && tokc < kend)
          sk = *reinterpret_cast<const float2*>(p.key_scale + (static_cast<int64_t>(kblk[u]) * Hkv + w.h) * B + tokc % B);
#pragma unroll
        for (int ri = 0; ri < kRi; ++ri) {
          const float s0 = tokc < lim[ri] ? ((static_cast<float>(acc[2 * ri]) * sq[ri]) * sk.x) * p.scale : kNegInf;
          const float s1 = tokc + 1 < lim[ri] ? ((static_cast<float>(acc[2 * ri + 1]) * sq[ri]) * sk.y) * p.scale : kNegInf;
          pmax[ri] = fmaxf(pmax[ri], fmaxf(s0, s1));
          *reinterpret_cast<float2*>(s_sm + (g + 8 * ri) * lay.s_stride + (tokc - kp0)) = make_float2(s0, s1);
        }
      }
    }
#pragma unroll
    for (int ri = 0; ri < kRi; ++ri) {
      const float m = warp_max4(pmax[ri]);
      if (t == 0) red_max[warp * kRows + g + 8 * ri] = m;
    }
    if (!ROWS16 && t == 0) red_max[warp * kRows + g + 8] = kNegInf;
    __syncthreads();

    // ---- phase 2: merge factors ----
    if (tid < kRows) {
      float mp = red_max[tid];
#pragma unroll
      for (int i = 1; i < kWarps; ++i) mp = fmaxf(mp, red_max[i * kRows + tid]);
      const float mo = row_m[tid];
      const float mn = fmaxf(mo, mp);
      row_alpha[tid] = mo == kNegInf ? 0.0f : expf(mo - mn);
      row_beta[tid] = mp == kNegInf ? 0.0f : expf(mp - mn);
      row_mp[tid] = mp;
      row_m[tid] = mn;
    }
    __syncthreads();

    // ---- phase 3: W = exp(s - m_p) * sV, per-group codes and scales ----
    const int nchunk = lay.pp / 4;  // 4 keys per thread per step; 8 threads = one 32-key group
    for (int r = 0; r < rows_used; ++r) {
      const float m = row_mp[r];
      const float beta = row_beta[r];
      const int lim_rel = min(row_lim[r], kend) - kp0;
      float lsum = 0.0f;
      for (int c0 = 0; c0 < nchunk; c0 += kThreads) {
        const int c = c0 + tid;
        const int k = 4 * c;  // key offset in the partition
        float wv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (k < lim_rel) {
          const float4 sc = *reinterpret_cast<const float4*>(s_sm + r * lay.s_stride + k);
          const int b = block_of(kp0 + k);
          float4 sv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          if (b >= 0)
            sv = *reinterpret_cast<const float4*>(p.value_scale + (static_cast<int64_t>(b) * Hkv + w.h) * B + (kp0 + k) % B);
          const float scv[4] = {sc.x, sc.y, sc.z, sc.w};
          const float svv[4] = {sv.x, sv.y, sv.z, sv.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (k + j < lim_rel) {
              const float e = expf(scv[j] - m);
              lsum += e;
              wv[j] = e * svv[j];
            }
          }
        }
        float gmax = fmaxf(fmaxf(wv[0], wv[1]), fmaxf(wv[2], wv[3]));
        gmax = fmaxf(gmax, __shfl_xor_sync(0xffffffffu, gmax, 1));
        gmax = fmaxf(gmax, __shfl_xor_sync(0xffffffffu, gmax, 2));
        gmax = fmaxf(gmax, __shfl_xor_sync(0xffffffffu, gmax, 4));
        if (c < nchunk) {
          if constexpr (kF16) {
            __half hv[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) hv[j] = __float2half_rn(gmax > 0.0f ? __fdiv_rn(wv[j], gmax) : 0.0f);
            *reinterpret_cast<uint2*>(c_sm + r * lay.c_stride + 2 * k) = *reinterpret_cast<const uint2*>(hv);
            if ((c & 7) == 0) g_sm[r * lay.g_stride + (c >> 3)] = gmax * beta;
          } else {
            const float inv = gmax > 0.0f ? __fdiv_rn(kLevels, gmax) : 0.0f;
            uint32_t packed = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float q = fminf(rintf(__fmul_rn(wv[j], inv)), kLevels);
              packed |= (static_cast<uint32_t>(q) & 0xffu) << (8 * j);
            }
            *reinterpret_cast<uint32_t*>(c_sm + r * lay.c_stride + k) = packed;
            if ((c & 7) == 0) g_sm[r * lay.g_stride + (c >> 3)] = __fdiv_rn(gmax, kLevels) * beta;
          }
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, off);
      if (lane == 0) red_sum[warp * kRows + r] = lsum;
    }
    __syncthreads();
    if (tid < rows_used) {
      float l = red_sum[tid];
#pragma unroll
      for (int i = 1; i < kWarps; ++i) l += red_sum[i * kRows + tid];
      row_l[tid] = row_alpha[tid] * row_l[tid] + row_beta[tid] * l;
    }

    // ---- phase 4: P.V on the tensor cores ----
    {
      const float al0 = row_alpha[g];
      const float al1 = ROWS16 ? row_alpha[g + 8] : 0.0f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        o[j][0] *= al0;
        o[j][1] *= al0;
        o[j][2] *= al1;
        o[j][3] *= al1;
      }
    }
    const int n64 = (nkeys + 63) / 64;
    for (int i0 = 0; i0 < n64; i0 += VU) {
      uint4 xv[VU][NT];
#pragma unroll
      for (int u = 0; u < VU; ++u) {
        const int ti = i0 + u;
        const int tok = kp0 + 64 * ti + 16 * t;  // 16 keys of one block (B % 16 == 0)
        const int b = (ti < n64 && tok < kend) ? block_of(tok) : -1;
        if (b >= 0) {
          const int8_t* src = p.value_cache + b * blk_stride + (static_cast<int64_t>(w.h) * D + dbase + g) * B + tok % B;
#pragma unroll
          for (int j = 0; j < NT; ++j) xv[u][j] = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(8 * j) * B);
        } else {
#pragma unroll
          for (int j = 0; j < NT; ++j) xv[u][j] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int u = 0; u < VU; ++u) {
        const int ti = i0 + u;
        if (ti >= n64) break;  // warp-uniform
        // A fragments and group scales of the tile's two groups (rows g and g+8).
        uint32_t a[2][kF16 ? 8 : 4];
        float gs[2][2];
#pragma unroll
        for (int grp = 0; grp < 2; ++grp) {
          const int tok0 = 64 * ti + 32 * grp + pv_token_base(t);
          gs[grp][0] = g_sm[g * lay.g_stride + 2 * ti + grp];
          gs[grp][1] = ROWS16 ? g_sm[(g + 8) * lay.g_stride + 2 * ti + grp] : 0.0f;
          if constexpr (kF16) {
            const uint4 r0 = *reinterpret_cast<const uint4*>(c_sm + g * lay.c_stride + 2 * tok0);
            uint4 r1 = make_uint4(0u, 0u, 0u, 0u);
            if (ROWS16) r1 = *reinterpret_cast<const uint4*>(c_sm + (g + 8) * lay.c_stride + 2 * tok0);
            // k16 MMA #1 takes keys tok0+0..3, #2 takes tok0+4..7 (slots 2t,2t+1 then 2t+8,2t+9).
            a[grp][0] = r0.x; a[grp][1] = r1.x; a[grp][2] = r0.y; a[grp][3] = r1.y;
            a[grp][4] = r0.z; a[grp][5] = r1.z; a[grp][6] = r0.w; a[grp][7] = r1.w;
          } else {
            const uint2 r0 = *reinterpret_cast<const uint2*>(c_sm + g * lay.c_stride + tok0);
            uint2 r1 = make_uint2(0u, 0u);
            if (ROWS16) r1 = *reinterpret_cast<const uint2*>(c_sm + (g + 8) * lay.c_stride + tok0);
            a[grp][0] = r0.x; a[grp][1] = r1.x; a[grp][2] = r0.y; a[grp][3] = r1.y;
          }
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 x = xv[u][j];
          // Lane t < 2 keeps x0,x1 (group 0) and receives the partner's x0,x1 (group 1); lane
          // t >= 2 receives the partner's x2,x3 (group 0) and keeps x2,x3 (group 1).
          const bool lo = t < 2;
          const uint32_t r0 = __shfl_xor_sync(0xffffffffu, lo ? x.z : x.x, kPvSwapXor);
          const uint32_t r1 = __shfl_xor_sync(0xffffffffu, lo ? x.w : x.y, kPvSwapXor);
          const uint32_t b[2][2] = {{lo ? x.x : r0, lo ? x.y : r1}, {lo ? r0 : x.z, lo ? r1 : x.w}};
#pragma unroll
          for (int grp = 0; grp < 2; ++grp) {
            if constexpr (kF16) {
              uint32_t h0, h1, h2, h3;
              s8x4_to_half2x2(b[grp][0], h0, h1);
              s8x4_to_half2x2(b[grp][1], h2, h3);
              float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              mma_f16(acc, a[grp][0], a[grp][1], a[grp][2], a[grp][3], h0, h1);
              mma_f16(acc, a[grp][4], a[grp][5], a[grp][6], a[grp][7], h2, h3);
              o[j][0] += gs[grp][0] * acc[0];
              o[j][1] += gs[grp][0] * acc[1];
              o[j][2] += gs[grp][1] * acc[2];
              o[j][3] += gs[grp][1] * acc[3];
            } else {
              int acc[4] = {0, 0, 0, 0};
              mma_i8<PV == PvQuant::kU8>(acc, a[grp][0], a[grp][1], a[grp][2], a[grp][3], b[grp][0], b[grp][1]);
              o[j][0] += gs[grp][0] * static_cast<float>(acc[0]);
              o[j][1] += gs[grp][0] * static_cast<float>(acc[1]);
              o[j][2] += gs[grp][1] * static_cast<float>(acc[2]);
              o[j][3] += gs[grp][1] * static_cast<float>(acc[3]);
            }
          }
        }
      }
    }
  }
  __syncthreads();

  // ---- write O / l (and m, l for the merge when the keys were split) ----
#pragma unroll
  for (int ri = 0; ri < kRi; ++ri) {
    if (qtok[ri] < 0) continue;
    const int r = g + 8 * ri;
    const float l = row_l[r];
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t row = static_cast<int64_t>(qtok[ri]) * Hq + qhead[ri];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int d = dbase + 8 * j + 2 * t;
      const float v0 = o[j][2 * ri] * inv, v1 = o[j][2 * ri + 1] * inv;
      if (ts.nsplit == 1) {
        if (p.query_fp16)
          *reinterpret_cast<__half2*>(static_cast<__half*>(p.output) + row * D + d) = __floats2half2_rn(v0, v1);
        else
          *reinterpret_cast<float2*>(static_cast<float*>(p.output) + row * D + d) = make_float2(v0, v1);
      } else {
        float* ws = static_cast<float*>(p.workspace);
        *reinterpret_cast<float2*>(ws + (row * ts.nsplit + w.split) * D + d) = make_float2(v0, v1);
      }
    }
    if (ts.nsplit > 1 && warp == 0 && t == 0) {
      float2* ml = reinterpret_cast<float2*>(static_cast<float*>(p.workspace) +
                                             static_cast<int64_t>(p.num_tokens) * Hq * ts.nsplit * D);
      ml[row * ts.nsplit + w.split] = make_float2(row_m[r], l);
    }
  }
}

// Combines the splits of each (token, head) row: weights l_i exp(m_i - max m).
template <int D>
__global__ void merge_splits_kernel(PagedAttentionParams p, int nsplit) {
  const int64_t row = blockIdx.x;
  const float* ws = static_cast<const float*>(p.workspace);
  const float2* ml = reinterpret_cast<const float2*>(ws + static_cast<int64_t>(p.num_tokens) * p.num_heads * nsplit * D);
  float mx = kNegInf;
  for (int i = 0; i < nsplit; ++i) {
    const float2 v = ml[row * nsplit + i];
    if (v.y > 0.0f) mx = fmaxf(mx, v.x);
  }
  const int d = 4 * threadIdx.x;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float wsum = 0.0f;
  for (int i = 0; i < nsplit; ++i) {
    const float2 v = ml[row * nsplit + i];
    if (!(v.y > 0.0f)) continue;
    const float wt = v.y * expf(v.x - mx);
    wsum += wt;
    const float4 x = *reinterpret_cast<const float4*>(ws + (row * nsplit + i) * D + d);
    acc.x += wt * x.x;
    acc.y += wt * x.y;
    acc.z += wt * x.z;
    acc.w += wt * x.w;
  }
  const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
  if (p.query_fp16) {
    __half2* out = reinterpret_cast<__half2*>(static_cast<__half*>(p.output) + row * D + d);
    out[0] = __floats2half2_rn(acc.x * inv, acc.y * inv);
    out[1] = __floats2half2_rn(acc.z * inv, acc.w * inv);
  } else {
    *reinterpret_cast<float4*>(static_cast<float*>(p.output) + row * D + d) =
        make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  }
}

int sm_count() {
  static int count = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
      return 132;
    return n;
  }();
  return count;
}

TileShape tile_shape(const PagedAttentionParams& p) {
  TileShape ts;
  const int G = p.num_heads / p.num_kv_heads;
  ts.hpt = std::min(G, kRows);
  ts.n_ht = (G + kRows - 1) / kRows;
  ts.qpt = std::max(1, std::min(kRows / ts.hpt, p.max_q_len));
  ts.n_qt = (p.max_q_len + ts.qpt - 1) / ts.qpt;
  const int partition = std::min(p.partition_size, kMaxPartition);
  const int nparts = std::max(1, (p.max_context + partition - 1) / partition);
  int nsplit = p.num_splits;
  if (nsplit <= 0) {
    // Enough CTAs for several waves (4 CTAs of 4 warps per SM x 4), splitting the keys only as
    // far as that needs: every extra split costs a partial output write and read.
    const int64_t base = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * ts.n_ht * ts.n_qt;
    const int64_t target = static_cast<int64_t>(sm_count()) * 16;
    nsplit = static_cast<int>(std::min<int64_t>(nparts, std::max<int64_t>(1, (target + base - 1) / base)));
  }
  nsplit = std::min(nsplit, nparts);
  ts.ppc = (nparts + nsplit - 1) / nsplit;
  ts.nsplit = (nparts + ts.ppc - 1) / ts.ppc;
  return ts;
}

template <int D, PvQuant PV>
cudaError_t launch_d_pv(const PagedAttentionParams& p, const TileShape& ts, cudaStream_t stream) {
  const int rows_used = ts.qpt * ts.hpt;
  const Layout lay = make_layout(std::min(p.partition_size, kMaxPartition), PV == PvQuant::kNone);
  const int64_t ctas = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * ts.n_ht * ts.nsplit * ts.n_qt;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (ctas == 0) return cudaSuccess;
  auto kernel = rows_used > 8 ? paged_attention_kernel<D, PV, true> : paged_attention_kernel<D, PV, false>;
  if (lay.bytes > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lay.bytes);
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(ctas), kThreads, lay.bytes, stream>>>(p, ts);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || ts.nsplit == 1) return err;
  merge_splits_kernel<D><<<static_cast<unsigned>(static_cast<int64_t>(p.num_tokens) * p.num_heads), D / 4, 0, stream>>>(
      p, ts.nsplit);
  return cudaGetLastError();
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
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    return "head_dim must be one of {64, 128, 256} on CUDA";
  if (p.block_size < 16 || p.block_size % 16 != 0)
    return "block_size must be a multiple of 16 on CUDA (16-byte V loads within one block)";
  if (p.partition_size <= 0 || p.partition_size % 32 != 0) return "partition_size must be a positive multiple of 32";
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) return "query heads must be a multiple of kv heads";
  if (p.max_q_len < 1) return "max_q_len must be >= 1";
  if (p.status == nullptr) return "a status word is required";
  return nullptr;
}

int paged_attention_num_splits(const PagedAttentionParams& p) { return tile_shape(p).nsplit; }

size_t paged_attention_workspace_bytes(const PagedAttentionParams& p) {
  const TileShape ts = tile_shape(p);
  if (ts.nsplit == 1) return 0;
  const size_t rows = static_cast<size_t>(p.num_tokens) * p.num_heads * ts.nsplit;
  return rows * p.head_dim * sizeof(float) + rows * 2 * sizeof(float);
}

cudaError_t launch_paged_attention_int8(const PagedAttentionParams& p, cudaStream_t stream) {
  if (paged_attention_unsupported(p) != nullptr) return cudaErrorInvalidValue;
  if (p.num_tokens == 0 || p.num_seqs == 0) return cudaSuccess;
  const TileShape ts = tile_shape(p);
  if (ts.nsplit > 1 && p.workspace == nullptr) return cudaErrorInvalidValue;
  switch (p.head_dim) {
    case 64: return launch_d<64>(p, ts, stream);
    case 128: return launch_d<128>(p, ts, stream);
    case 256: return launch_d<256>(p, ts, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace ort_ops
