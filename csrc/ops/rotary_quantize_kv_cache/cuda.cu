// SPDX-License-Identifier: MIT
// RotaryQuantizeKVCache kernel: one warp per (token, kv head). Lane l holds head elements
// l + 32 i. Each rotated element needs its pair partner (rotate_half: d +- R/2; interleaved:
// d ^ 1), which another lane or register holds, so it is read again from global memory (an L1
// hit: the warp has just loaded the same row). The rotation is the contract's, every product and
// sum correctly rounded float32 (__fmul_rn, __fadd_rn, __fsub_rn: no FMA contraction), then y is
// rounded to qkv's dtype; K and V go through QuantizeKVCache's device functions
// (ops/quantize_kv_cache/cuda_device.cuh), so query, codes and scales are bit-exact.
#include "ops/rotary_quantize_kv_cache/cuda.cuh"

#include <cuda_fp16.h>

#include "cuda/export.h"
#include "cuda/float_convert.cuh"
#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "ops/quantize_kv_cache/cuda_device.cuh"

namespace ort_ops {
namespace {

using cuda_util::from_f32;
using cuda_util::to_f32;

// Rotates head `x` (D values of T) into y[i] = element lane + 32 i (0 past D), float32 not yet
// rounded to T: for d < R, with i the angle index and partner the pair's other element,
//   first of the pair:  y = x[d] c[i] - x[partner] s[i]
//   second of the pair: y = x[d] c[i] + x[partner] s[i]
// and y = x[d] for d >= R. `cs` holds the lane's (c, s) per register.
template <typename T, int kPerLane>
__device__ __forceinline__ void rotate_head(const T* __restrict__ x, const float2 (&cs)[kPerLane], int head_dim,
                                            int half, bool interleaved, int lane, float (&y)[kPerLane]) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    y[i] = 0.0f;
    if (d >= head_dim) continue;
    const float v = to_f32(x[d]);
    if (d >= 2 * half) {
      y[i] = v;
      continue;
    }
    const bool first = interleaved ? (d & 1) == 0 : d < half;
    const int partner = interleaved ? (d ^ 1) : (first ? d + half : d - half);
    const float w = to_f32(x[partner]);
    const float vc = __fmul_rn(v, cs[i].x), ws = __fmul_rn(w, cs[i].y);
    y[i] = first ? __fsub_rn(vc, ws) : __fadd_rn(vc, ws);
  }
}

template <typename T, int kPerLane>
__global__ void rotary_quantize_kv_cache_kernel(RotaryQuantizeKvParams p) {
  // As QuantizeKVCache's kernel: a programmatic dependent in captured decode steps, so wait for
  // the projection's writes before any global read and let the attention become resident.
  ptx::griddep_wait();
  ptx::griddep_launch_dependents();
  const QuantizeKvCacheParams& c = p.cache;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (warp >= static_cast<int64_t>(c.num_tokens) * c.num_kv_heads) return;
  const int token = static_cast<int>(warp / c.num_kv_heads);
  const int kv_head = static_cast<int>(warp % c.num_kv_heads);
  const int D = c.head_dim, half = p.rotary_half;
  const int group = p.num_heads / c.num_kv_heads;
  const int64_t width = static_cast<int64_t>(p.num_heads + 2 * c.num_kv_heads) * D;
  const T* row = static_cast<const T*>(p.qkv) + static_cast<int64_t>(token) * width;

  // The lane's angles: element d < R uses index d % (R/2) (rotate_half) or d / 2 (interleaved).
  float2 cs[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + 32 * i;
    cs[i] = make_float2(1.0f, 0.0f);
    if (d < 2 * half) {
      const int a = p.interleaved ? d >> 1 : (d < half ? d : d - half);
      cs[i] = make_float2(to_f32(static_cast<const T*>(p.cos)[static_cast<int64_t>(token) * half + a]),
                          to_f32(static_cast<const T*>(p.sin)[static_cast<int64_t>(token) * half + a]));
    }
  }

  // The query heads of this kv head's group: every token.
  float y[kPerLane];
  for (int g = 0; g < group; ++g) {
    const int h = kv_head * group + g;
    rotate_head<T, kPerLane>(row + h * D, cs, D, half, p.interleaved, lane, y);
    T* q = static_cast<T*>(p.query) + (static_cast<int64_t>(token) * p.num_heads + h) * D;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + 32 * i < D) q[lane + 32 * i] = from_f32<T>(y[i]);
  }

  // The cache: nothing of the launch when slot_mapping is bad, nothing of a skipped token.
  if (kv_cache_device::slots_bad(c.slot_mapping, c.num_tokens, c.num_slots, c.workspace, c.status, warp == 0, lane))
    return;
  const int64_t slot = c.slot_mapping[token];
  if (slot < 0) return;
  rotate_head<T, kPerLane>(row + (p.num_heads + kv_head) * D, cs, D, half, p.interleaved, lane, y);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) y[i] = to_f32(from_f32<T>(y[i]));  // K as stored in qkv's dtype
  kv_cache_device::quantize_store(y, /*is_value=*/false, slot, kv_head, c, lane);
  const T* v = row + (p.num_heads + c.num_kv_heads + kv_head) * D;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) y[i] = lane + 32 * i < D ? to_f32(v[lane + 32 * i]) : 0.0f;
  kv_cache_device::quantize_store(y, /*is_value=*/true, slot, kv_head, c, lane);
}

template <typename T, int kPerLane>
cudaError_t launch_typed(const RotaryQuantizeKvParams& p, cudaStream_t stream) {
  constexpr int kThreads = 128;  // 4 warps: small grids at decode still spread over the SMs
  const int64_t warps = static_cast<int64_t>(p.cache.num_tokens) * p.cache.num_kv_heads;
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  auto* kernel = rotary_quantize_kv_cache_kernel<T, kPerLane>;
  // Decode-sized launches captured into a CUDA graph are programmatic dependents of the previous
  // kernel (cuda/launch.cuh); the check-kernel path is already ordered behind its own launches.
  if (p.cache.num_tokens <= kQkvInlineCheckMax && cuda_util::dependent_launch_pays(stream))
    return cuda_util::launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream, p);
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The register count per lane: the smallest power of two with 32 * kPerLane >= D.
template <typename T>
cudaError_t launch_for_head_dim(const RotaryQuantizeKvParams& p, cudaStream_t stream) {
  const int d = p.cache.head_dim;
  if (d <= 32) return launch_typed<T, 1>(p, stream);
  if (d <= 64) return launch_typed<T, 2>(p, stream);
  if (d <= 128) return launch_typed<T, 4>(p, stream);
  if (d <= 256) return launch_typed<T, 8>(p, stream);
  return launch_typed<T, 16>(p, stream);
}

}  // namespace

cudaError_t launch_rotary_quantize_kv_cache(const RotaryQuantizeKvParams& p, cudaStream_t stream) {
  const QuantizeKvCacheParams& c = p.cache;
  if (c.head_dim <= 0 || c.head_dim > 512 || c.block_size <= 0 || c.status == nullptr || c.num_kv_heads <= 0 ||
      p.num_heads <= 0 || p.num_heads % c.num_kv_heads != 0 || p.rotary_half < 1 || 2 * p.rotary_half > c.head_dim)
    return cudaErrorInvalidValue;
  if (c.num_tokens == 0) return cudaSuccess;
  if (c.num_tokens > kQkvInlineCheckMax) {
    const cudaError_t err =
        launch_kv_slot_check(c.slot_mapping, c.num_tokens, c.num_slots, c.workspace, c.status, stream);
    if (err != cudaSuccess) return err;
  }
  return c.input_fp16 ? launch_for_head_dim<__half>(p, stream) : launch_for_head_dim<float>(p, stream);
}

}  // namespace ort_ops

ORT_OPS_CUDA_EXPORT int ort_ops_cuda_rotary_quantize_kv_cache(
    const void* qkv, const void* cos, const void* sin, int fp16, void* query, const void* slot_mapping,
    void* key_cache, void* value_cache, void* key_scale, void* value_scale, int num_tokens, int num_heads,
    int num_kv_heads, int head_dim, int rotary_half, int interleaved, int block_size, long long num_slots,
    int* status, void* stream) {
  ort_ops::RotaryQuantizeKvParams p;
  p.qkv = qkv;
  p.cos = cos;
  p.sin = sin;
  p.query = query;
  p.num_heads = num_heads;
  p.rotary_half = rotary_half;
  p.interleaved = interleaved != 0;
  p.cache = ort_ops::kv_cache_params(slot_mapping, key_cache, value_cache, key_scale, value_scale, num_tokens,
                                     num_kv_heads, head_dim, block_size, num_slots, status,
                                     reinterpret_cast<char*>(status) + 16);
  p.cache.input_fp16 = fp16 != 0;
  return static_cast<int>(ort_ops::launch_rotary_quantize_kv_cache(p, static_cast<cudaStream_t>(stream)));
}
