// SPDX-License-Identifier: MIT
// PagedAttentionInt8 CUDA: the attention steps that more than one kernel runs the same way
// (cuda.cu's general and warp-decode kernels, cuda_prefill.cu's prefill kernel), each a
// __forceinline__ function named for its step, in the order a kernel runs them:
//   read_cu_seqlens  which query rows a sequence has (cu_seqlens_q checked)
//   qk_score         one score from an int32 Q.K dot: the reference's float32 order, soft cap
//   rescale_row      online softmax: move a row's O and l to a new running max
//   group_weights8   W = exp(s - m) * sV of a lane's 8 keys of one 32-key group, sum and max
//   codes8_f16       the float twin's P codes (W / max in fp16) of those 8 keys
//   codes4_rint      INT8 P codes of 4 keys, rint(W * L / max) packed in one word
//   pv_f16_8keys     P.V of 8 keys in fp16: V codes converted exactly, two m16n8k16
//   store_row2 / store_split_ml   the output (or a split's partial O and its m, l)
// The arithmetic of each is the reference's (ort_ops/ops/paged_attention_int8.py): same float32
// operations in the same order, so the kernels' codes and scores stay as DESIGN.md states them.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "ops/paged_attention_int8/cuda_device.cuh"

namespace ort_ops {
namespace {

// Query rows [q_start, q_start + q_len) of sequence s from cu_seqlens_q (not null; without it
// the layout is decode's, one row each). Returns false when cu_seqlens_q is not a valid prefix
// sum over num_tokens.
__device__ __forceinline__ bool read_cu_seqlens(const PagedAttentionParams& p, int s, int& q_start, int& q_len) {
  q_start = p.cu_seqlens_q[s];
  const int q_end = p.cu_seqlens_q[s + 1];
  q_len = q_end - q_start;
  const bool bad = q_start < 0 || q_len < 0 || q_end > p.num_tokens || q_len > p.max_q_len ||
                   (s == 0 && q_start != 0) || (s == p.num_seqs - 1 && q_end != p.num_tokens);
  return !bad;
}

// One score: ((dot * sQ) * sK) * scale in float32, then the soft cap (DESIGN.md's order; no FMA
// contraction can merge these multiplies: each rounds as the reference's does).
__device__ __forceinline__ float qk_score(float dot, float sq, float sk, float scale, float softcap) {
  return apply_softcap(((dot * sq) * sk) * scale, softcap);
}

// Online softmax: row max m_run -> max(m_run, mp); O (columns c0, c0 + 1 of every n-tile) and l
// scaled by exp(old - new) (0 while the row had no key).
template <int NT, int NC>
__device__ __forceinline__ void rescale_row(float& m_run, float& l_run, float mp, float (&o)[NT][NC], int c0) {
  const float mn = fmaxf(m_run, mp);
  const float alpha = m_run == -__builtin_huge_valf() ? 0.0f : fast_exp(m_run - mn);
  m_run = mn;
  l_run *= alpha;
#pragma unroll
  for (int jn = 0; jn < NT; ++jn) {
    o[jn][c0] *= alpha;
    o[jn][c0 + 1] *= alpha;
  }
}

// A lane's 8 keys of one 32-key W group: e = exp(s - mp) (ex2.approx: a few ulp, the W codes
// tolerate it), W = e * sV; invisible keys give W = 0 whatever their score or scale slot holds
// (past seq_len the slot may be anything). Adds the e to esum; gmax = the 8 keys' max W (>= 0).
template <int N>
__device__ __forceinline__ void group_weights8(const float (&s)[N], const float (&sv)[N], int off, const bool (&vis)[8],
                                               float mp, float (&w)[8], float& esum, float& gmax) {
  gmax = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float e = vis[k] ? fast_exp(s[off + k] - mp) : 0.0f;
    esum += e;
    w[k] = vis[k] ? e * sv[off + k] : 0.0f;
    gmax = fmaxf(gmax, w[k]);
  }
}

// pv_quant none: the 8 keys' W / max in fp16, as the A slots of two m16n8k16 (keys 0..3 in a[0],
// a[1]; keys 4..7 in a[2], a[3]). An all-zero group (gmax 0) gives zero codes.
__device__ __forceinline__ void codes8_f16(const float (&w)[8], float gmax, uint32_t (&a)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __half2 hv = __floats2half2_rn(gmax > 0.0f ? __fdiv_rn(w[2 * k], gmax) : 0.0f,
                                         gmax > 0.0f ? __fdiv_rn(w[2 * k + 1], gmax) : 0.0f);
    a[k] = *reinterpret_cast<const uint32_t*>(&hv);
  }
}

// INT8 P codes of 4 keys: rint(W * inv) (inv = code_inverse: L / max), at most L, byte k = key k.
// OR-ed into `packed` (0 or a word whose bytes are still free).
__device__ __forceinline__ uint32_t codes4_rint(const float* w, float inv, float levels) {
  uint32_t packed = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float q = fminf(rintf(__fmul_rn(w[k], inv)), levels);
    packed |= (static_cast<uint32_t>(q) & 0xffu) << (8 * k);
  }
  return packed;
}

// P.V of 8 keys on fp16 tensor cores: v03 / v47 are the s8 V codes of keys 0..3 / 4..7 (one
// output column), converted exactly to fp16; a0..a3 the A fragment of keys 0..3, a4..a7 of
// keys 4..7 (m16n8k16 slots 2t, 2t+1 then 2t+8, 2t+9). acc += P . V in float32.
__device__ __forceinline__ void pv_f16_8keys(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t a4, uint32_t a5, uint32_t a6, uint32_t a7, uint32_t v03,
                                             uint32_t v47) {
  uint32_t h0, h1, h2, h3;
  s8x4_to_half2x2(v03, h0, h1);
  s8x4_to_half2x2(v47, h2, h3);
  mma_f16(acc, a0, a1, a2, a3, h0, h1);
  mma_f16(acc, a4, a5, a6, a7, h2, h3);
}

// Output elements (d, d + 1) of row `row` (token * Hq + head): the final output with one split,
// else this split's slot of the float32 partial-output workspace [row][nsplit][D].
template <int D>
__device__ __forceinline__ void store_row2(const PagedAttentionParams& p, int64_t row, int nsplit, int split, int d,
                                           float v0, float v1) {
  if (nsplit == 1) {
    store_out2(p, row, d, v0, v1);
  } else {
    float* ws = static_cast<float*>(p.workspace);
    *reinterpret_cast<float2*>(ws + (row * nsplit + split) * D + d) = make_float2(v0, v1);
  }
}

// A split's (m, l) of row `row`, after the partial outputs in the workspace: the merge kernel
// weighs split i by l_i exp(m_i - max m).
template <int D>
__device__ __forceinline__ void store_split_ml(const PagedAttentionParams& p, int64_t row, int nsplit, int split, float m,
                                               float l) {
  float2* ml = reinterpret_cast<float2*>(static_cast<float*>(p.workspace) +
                                         static_cast<int64_t>(p.num_tokens) * p.num_heads * nsplit * D);
  ml[row * nsplit + split] = make_float2(m, l);
}

}  // namespace
}  // namespace ort_ops
