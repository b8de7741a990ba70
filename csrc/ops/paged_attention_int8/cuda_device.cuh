// SPDX-License-Identifier: MIT
// PagedAttentionInt8 CUDA: device helpers shared by cuda.cu (general and decode kernels) and
// cuda_prefill.cu (the prefill kernel): cp.async, the mma.sync wrappers, exact s8 -> fp16, the
// exp and code-factor rules, warp reductions, Q quantization (bit-exact with quantize_rows) and
// the output store. Internal linkage: each including .cu gets its own inline copies.
#pragma once

#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#include "cuda/ptx.cuh"
#include "ops/paged_attention_int8/cuda.cuh"

namespace ort_ops {

// Shared memory per SM on sm_90 (228 KB). Only the kernels' compile-time launch-bound hints are
// checked against it; the launch arithmetic asks the device (DeviceLimits in cuda.cuh).
inline constexpr int kSm90SmemPerSm = 233472;

namespace {

// cp.async, the mma.sync wrappers and ex2.approx: csrc/cuda/ptx.cuh.
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::mma_f16;
using ptx::mma_i8;
using ptx::mma_i8_c;
// 16-byte cp.async to a shared-memory address already converted (the warp decode loop keeps them).
__device__ __forceinline__ void cp_async16_s(unsigned dst, const void* gmem, bool valid) {
  ptx::cp_async16(dst, gmem, valid);
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  ptx::cp_async16(ptx::smem_addr(smem), gmem, valid);
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

// exp(x) as __expf computes it in the normal range (ex2.approx of x * log2 e), with results
// below 2^-126 flushed to zero instead of __expf's extra range steps (~6 instructions an exp;
// such a weight is a zero code either way).
__device__ __forceinline__ float fast_exp(float x) { return ptx::ex2_approx_ftz(x * 1.4426950408889634f); }
// decode_warp_kernel: rescale O and l only when a row's max grows by more than this (natural
// log; e^5.5 ~ 245).
constexpr float kLazyRescale = 5.5f;

// Gemma 2's logit soft cap after the scale, DESIGN.md's float order: one division, tanh, one
// multiply (no FMA contraction); cap 0 leaves s as is.
__device__ __forceinline__ float apply_softcap(float s, float cap) {
  return cap > 0.0f ? __fmul_rn(cap, tanhf(__fdiv_rn(s, cap))) : s;
}

// The first key position a query at position pos sees: pos - window + 1 (>= 0); 0 without a window.
// (int64: pos comes from seq_lens before they are checked.)
__device__ __forceinline__ int window_first(int64_t pos, int window) {
  return window > 0 && pos - window + 1 > 0 ? static_cast<int>(pos - window + 1) : 0;
}

// The softmax denominator with the head's sink, relative to the row's max m (O and l are
// exp(s - m) sums): l + exp(sink - m). A sink ~88 above m makes it inf and the output 0, as in
// the reference (the true weights are then below e^-88). A NaN/Inf sink is flagged.
__device__ __forceinline__ float add_sink(float l, float m, const float* head_sink, int head, int* status) {
  if (head_sink == nullptr) return l;
  const float sink = head_sink[head];
  if (!isfinite(sink)) atomicOr(status, kPaSinkNonFinite);
  return l + expf(sink - m);
}

// A P-V group's code factor L / max W, 0 for an all-zero group. It saturates at FLT_MAX: a group
// whose max W is below L / FLT_MAX (~3.7e-37) would otherwise get inf, and 0 * inf would turn the
// group's zero weights into NaN codes (DESIGN.md, "L / max saturates"; the reference does the same).
__device__ __forceinline__ float code_inverse(float gmax, float levels) {
  return gmax > 0.0f ? fminf(__fdiv_rn(levels, gmax), 3.402823466e38f) : 0.0f;
}

__device__ __forceinline__ float warp_max4(float v) {  // over the 4 lanes of one g (t = 0..3)
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Four 32-bit words per 16-byte shared-memory read: w[0 .. 4N) from N consecutive uint4.
template <int N>
__device__ __forceinline__ void load_words(const unsigned char* src, uint32_t (&w)[4 * N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const uint4 v = reinterpret_cast<const uint4*>(src)[i];
    w[4 * i] = v.x;
    w[4 * i + 1] = v.y;
    w[4 * i + 2] = v.z;
    w[4 * i + 3] = v.w;
  }
}

// Lane quad index t's d slice of a K row (D/4 bytes, D/16 words): 16-byte reads, one 8-byte
// read at D 32 (the slice starts at 8t in a row whose stride is a multiple of 16: aligned).
template <int D>
__device__ __forceinline__ void load_k_slice(const unsigned char* src, uint32_t (&w)[D / 16]) {
  if constexpr (D >= 64) {
    load_words<D / 64>(src, w);
  } else {
    static_assert(D == 32, "a d slice is 16-byte words or, at D 32, one 8-byte word pair");
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x;
    w[1] = v.y;
  }
}

// Loads lane quad index t's d slice (t * D/4 .. +D/4) of query row (token, head), zeros when
// token < 0, and quantizes it bit-exactly as quantize_rows (the row's amax is reduced over the
// 4 lanes of one g, so all 32 lanes must call): packed s8 codes in qa, the row scale in sq.
// Returns false when the slice holds a NaN or Inf.
template <int D>
__device__ __forceinline__ bool quantize_q_slice(const PagedAttentionParams& p, int token, int head, int t,
                                                 uint32_t (&qa)[D / 16], float& sq) {
  float x[D / 4];
  if (token >= 0) {
    const int64_t base = (static_cast<int64_t>(token) * p.num_heads + head) * D + t * (D / 4);
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
  amax = warp_max4(amax);
  const float inv = amax > 0.0f ? fminf(__fdiv_rn(127.0f, amax), FLT_MAX) : 0.0f;  // saturated: DESIGN.md
  sq = __fdiv_rn(amax, 127.0f);
#pragma unroll
  for (int wd = 0; wd < D / 16; ++wd) {
    uint32_t packed = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const float q = fminf(fmaxf(rintf(__fmul_rn(x[4 * wd + b], inv)), -127.0f), 127.0f);
      packed |= (static_cast<uint32_t>(static_cast<int>(q)) & 0xffu) << (8 * b);
    }
    qa[wd] = packed;
  }
  return finite;
}

// Writes (v0, v1) at element d of output row `row` (dtype of the query).
__device__ __forceinline__ void store_out2(const PagedAttentionParams& p, int64_t row, int d, float v0, float v1) {
  if (p.query_fp16)
    *reinterpret_cast<__half2*>(static_cast<__half*>(p.output) + row * p.head_dim + d) = __floats2half2_rn(v0, v1);
  else
    *reinterpret_cast<float2*>(static_cast<float*>(p.output) + row * p.head_dim + d) = make_float2(v0, v1);
}

}  // namespace
}  // namespace ort_ops
