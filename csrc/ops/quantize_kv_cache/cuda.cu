// SPDX-License-Identifier: MIT
// QuantizeKVCache kernel: one warp per (token, kv head, K or V) vector. The arithmetic is the
// contract's, operation for operation (ort_ops/ops/_quant.py): amax = max|x|, scale = amax / 127,
// inv = 127 / amax, q = clamp(rint(x * inv), -127, 127), all correctly rounded float32 (__fdiv_rn,
// __fmul_rn: no FMA contraction, no approximate division), so the codes are bit-exact.
#include <cuda_fp16.h>

#include "ops/quantize_kv_cache/cuda.cuh"

namespace ort_ops {
namespace {

constexpr int kMaxPerLane = 16;  // head_dim <= 512

__device__ __forceinline__ float load_elem(const void* base, int64_t i, bool fp16) {
  return fp16 ? __half2float(static_cast<const __half*>(base)[i]) : static_cast<const float*>(base)[i];
}

__global__ void quantize_kv_cache_kernel(QuantizeKvCacheParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t vec = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nvec = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * 2;
  if (vec >= nvec) return;
  const bool is_value = vec & 1;
  const int64_t th = vec >> 1;  // token * H + head
  const int token = static_cast<int>(th / p.num_kv_heads);
  const int head = static_cast<int>(th % p.num_kv_heads);
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // skipped token (padding)
  if (slot >= p.num_slots) {
    if (lane == 0 && !is_value) atomicOr(p.status, kQkvSlotOutOfRange);
    return;
  }
  const int d_total = p.head_dim;
  const void* src = is_value ? p.value : p.key;
  const int64_t row = th * d_total;
  float x[kMaxPerLane];
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    x[i] = d < d_total ? load_elem(src, row + d, p.input_fp16) : 0.0f;
    finite = finite && isfinite(x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  finite = __all_sync(0xffffffffu, finite);
  if (!finite) {
    if (lane == 0) atomicOr(p.status, kQkvNonFinite);
    return;
  }
  const float scale = __fdiv_rn(amax, 127.0f);
  const float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  const int64_t blk = slot / p.block_size;
  const int off = static_cast<int>(slot % p.block_size);
  const int64_t bh = blk * p.num_kv_heads + head;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d >= d_total) break;
    const float q = fminf(fmaxf(rintf(__fmul_rn(x[i], inv)), -127.0f), 127.0f);
    const int8_t code = static_cast<int8_t>(q);
    if (is_value)
      p.value_cache[(bh * d_total + d) * p.block_size + off] = code;  // token innermost
    else
      p.key_cache[(bh * p.block_size + off) * d_total + d] = code;
  }
  if (lane == 0) (is_value ? p.value_scale : p.key_scale)[bh * p.block_size + off] = scale;
}

}  // namespace

cudaError_t launch_quantize_kv_cache(const QuantizeKvCacheParams& p, cudaStream_t stream) {
  if (p.head_dim <= 0 || p.head_dim > 32 * kMaxPerLane || p.block_size <= 0 || p.status == nullptr)
    return cudaErrorInvalidValue;
  const int64_t nvec = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * 2;
  if (nvec == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (nvec * 32 + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  quantize_kv_cache_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ort_ops
