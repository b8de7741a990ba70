// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant CUDA kernels: device code shared by the mma.sync kernel (cuda.cu)
// and the wgmma kernel (cuda_wgmma.cu): the exact float32 epilogue math of the contract, the
// device-side tile map built from group_list, the cross-CTA row-block handshake, the tail
// fill, and the cooperative launch. Spec: ort_ops/ops/_moe.py.
//
// Exactness: every float32 operation of the reference is done with an explicit _rn intrinsic
// in the reference's order (no FMA contraction), including the contract's polynomial exp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/grouped_matmul_swiglu_quant/cuda.cuh"

namespace ort_ops::gmsq_cuda::epi {

// The contract's float32 constants, rounded from double exactly as numpy's np.float32(...) does.
#define ORT_OPS_F32C(v) static_cast<float>(v)

// exp_f32 of ort_ops/ops/_moe.py, operation for operation (no FMA: each op rounds).
__device__ __forceinline__ float exp_f32(float v) {
  const float t = fminf(fmaxf(v, ORT_OPS_F32C(-87.0)), ORT_OPS_F32C(88.0));
  const float n = rintf(__fmul_rn(t, ORT_OPS_F32C(1.44269504088896341)));
  float r = __fsub_rn(t, __fmul_rn(n, ORT_OPS_F32C(0.693359375)));
  r = __fsub_rn(r, __fmul_rn(n, ORT_OPS_F32C(-2.12194440e-4)));
  float p = ORT_OPS_F32C(1.9875691500e-4);
  p = __fadd_rn(__fmul_rn(p, r), ORT_OPS_F32C(1.3981999507e-3));
  p = __fadd_rn(__fmul_rn(p, r), ORT_OPS_F32C(8.3334519073e-3));
  p = __fadd_rn(__fmul_rn(p, r), ORT_OPS_F32C(4.1665795894e-2));
  p = __fadd_rn(__fmul_rn(p, r), ORT_OPS_F32C(1.6666665459e-1));
  p = __fadd_rn(__fmul_rn(p, r), ORT_OPS_F32C(5.0000001201e-1));
  const float z = __fmul_rn(r, r);
  float y = __fmul_rn(p, z);
  y = __fadd_rn(y, r);
  y = __fadd_rn(y, 1.0f);
  // n in [-126, 127] and y in [0.7, 1.42]: 2^n is a normal float and y * 2^n is exact.
  return __fmul_rn(y, __int_as_float((static_cast<int>(n) + 127) << 23));
}
#undef ORT_OPS_F32C

// S = (a / (1 + exp_f32(-a))) * g.
__device__ __forceinline__ float swiglu_f32(float a, float g) {
  const float d = __fadd_rn(1.0f, exp_f32(-a));
  return __fmul_rn(__fdiv_rn(a, d), g);
}

// C plus the bias (one float32 add) when there is one; C itself otherwise (adding 0 would turn
// a -0 into +0, and GroupedMatmulDequant's output is compared bit for bit).
__device__ __forceinline__ float plus_bias(float c, const float* bias, int64_t i) {
  return bias != nullptr ? __fadd_rn(c, __ldg(bias + i)) : c;
}

// The activation as S = mul * (num / (1 + exp_f32(-arg))), the operands computed in the
// contract's order: "swiglu" num = arg = A, mul = G; "swiglu_oai" num = min(A, limit),
// arg = alpha * num, mul = min(max(G, -limit), limit) + 1. For finite A, G, fminf / fmaxf
// are numpy's minimum / maximum (a NaN A or G is refused by the caller before S counts).
struct ActTerms {
  float num, arg, mul;
};
__device__ __forceinline__ ActTerms act_terms(const GmsqParams& p, float a, float g) {
  if (p.activation == kGmsqActSwigluOai) {
    const float an = fminf(a, p.limit);
    const float gc = fminf(fmaxf(g, -p.limit), p.limit);
    return {an, __fmul_rn(p.alpha, an), __fadd_rn(gc, 1.0f)};
  }
  return {a, a, g};
}

// S of p.activation with the exact division: swiglu_f32 for "swiglu", the same operations on
// act_terms' operands for "swiglu_oai" ((g + 1) * s: the product commutes exactly).
__device__ __forceinline__ float activation_f32(const GmsqParams& p, float a, float g) {
  const ActTerms t = act_terms(p, a, g);
  const float d = __fadd_rn(1.0f, exp_f32(-t.arg));
  return __fmul_rn(__fdiv_rn(t.num, d), t.mul);
}

__device__ __forceinline__ int quant_code(float s, float inv) {
  const float q = rintf(__fmul_rn(s, inv));
  return static_cast<int>(fminf(fmaxf(q, -127.0f), 127.0f));
}

__device__ __forceinline__ int64_t warp_scan_add(int64_t v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}
__device__ __forceinline__ int64_t warp_scan_max(int64_t v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v = max(v, u);
  }
  return v;
}

// Tile map, run by one whole warp: ends_s[0..E] = sanitized cumulative group ends (clamped to
// [0, M], non-decreasing) and blk_s[0..E] = prefix of ceil(rows_e / bm) row blocks, both in
// shared memory. An invalid group_list sets kErrGroupList in *err and is clamped so nothing
// runs out of bounds. The caller synchronizes before reading the arrays.
__device__ __forceinline__ void build_tile_map(const int64_t* group_list, int group_list_type,
                                               int M, int E, int bm, int lane, int* ends_s,
                                               int* blk_s, int* err) {
  const int per = (E + 31) / 32;
  const int e0 = min(E, lane * per);
  const int e1 = min(E, e0 + per);
  // The loops below are not unrolled. Code size is time here: every kernel runs this map first,
  // from instructions that are cold between a model's layers, and unrolled these loops were
  // about a thousand instructions of each kernel (benchmarks/NOTES_moe_cuda.md).
  bool bad = false;
  int64_t run = 0;  // lane-local running sum (counts) or max (ends)
#pragma unroll 1
  for (int e = e0; e < e1; ++e) {
    int64_t v = group_list[e];
    if (v < 0) bad = true;
    v = (v < 0 ? int64_t{0} : v);
    if (group_list_type == 1) {
      run += (v < M ? v : int64_t{M});
    } else {
      if (v < run) bad = true;  // decreasing inside this lane's chunk
      run = max(run, v);
    }
  }
  int64_t incl, excl;
  if (group_list_type == 1) {
    incl = warp_scan_add(run, lane);
    excl = incl - run;
  } else {
    incl = warp_scan_max(run, lane);
    excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0;
  }
  int64_t acc = excl;
#pragma unroll 1
  for (int e = e0; e < e1; ++e) {
    int64_t v = (group_list[e] < 0 ? int64_t{0} : group_list[e]);
    if (group_list_type == 1) {
      acc += (v < M ? v : int64_t{M});
    } else {
      if (v < acc) bad = true;  // decreasing across a chunk boundary
      acc = max(acc, v);
    }
    if (acc > M) bad = true;
    ends_s[e + 1] = static_cast<int>((acc < M ? acc : int64_t{M}));
  }
  if (lane == 0) ends_s[0] = 0;
  if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(err, kErrGroupList);
  __syncwarp();
  int64_t nb = 0;
  for (int e = e0; e < e1; ++e) nb += (ends_s[e + 1] - ends_s[e] + bm - 1) / bm;
  const int64_t nb_incl = warp_scan_add(nb, lane);
  int64_t b = nb_incl - nb;
#pragma unroll 1
  for (int e = e0; e < e1; ++e) {
    b += (ends_s[e + 1] - ends_s[e] + bm - 1) / bm;
    blk_s[e + 1] = static_cast<int>(b);
  }
  if (lane == 0) blk_s[0] = 0;
}

// The expert owning row block rb: the last e with blk_s[e] <= rb (blk_s is non-decreasing).
__device__ __forceinline__ int expert_of_block(const int* blk_s, int E, int rb) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (blk_s[mid] <= rb) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Arrive on a row block's counter and wait until `expected` CTAs arrived (one thread calls it
// after the CTA's amax atomics are fenced; the peers are co-resident by the cooperative launch).
__device__ __forceinline__ void arrive_and_wait(int* cnt, int expected) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(cnt) : "memory");
  int seen = 0;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(cnt) : "memory");
    if (seen >= expected) break;
    __nanosleep(32);
  }
}

// Rows at or past the last group end: codes 0, scale 0 (the contract's deviation from Ascend),
// written grid-stride by thread `tid` of `nthreads` in total.
__device__ __forceinline__ void zero_tail_rows(int8_t* y, float* y_scale, int M, int half,
                                               int rows_end, int64_t tid, int64_t nthreads) {
  const int tail = M - rows_end;
  if (tail <= 0) return;
  const int chunks = half / 16;
  const int64_t total = static_cast<int64_t>(tail) * chunks;
  for (int64_t i = tid; i < total; i += nthreads) {
    const int64_t r = rows_end + i / chunks;
    *reinterpret_cast<uint4*>(y + r * half + (i % chunks) * 16) = make_uint4(0, 0, 0, 0);
  }
  for (int64_t i = rows_end + tid; i < M; i += nthreads) y_scale[i] = 0.0f;
}

// Host side: a cooperative launch (co-residency of the whole grid, which the cross-CTA row max
// relies on) through cudaLaunchKernelEx, which stream capture records as a cooperative node.
struct CooperativeLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  CooperativeLaunch(unsigned grid, unsigned threads, size_t smem, cudaStream_t stream) {
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  CooperativeLaunch(const CooperativeLaunch&) = delete;  // cfg.attrs points into this object
  CooperativeLaunch& operator=(const CooperativeLaunch&) = delete;
};

}  // namespace ort_ops::gmsq_cuda::epi
