// SPDX-License-Identifier: MIT
// QuantizeKVCache kernel: one warp per (token, kv head, K or V) vector. The arithmetic is the
// contract's, operation for operation (ort_ops/ops/_quant.py): amax = max|x|, scale = amax / 127,
// inv = min(127 / amax, FLT_MAX), q = clamp(rint(x * inv), -127, 127), all correctly rounded float32 (__fdiv_rn,
// __fmul_rn: no FMA contraction, no approximate division), so the codes are bit-exact.
#include <cuda_fp16.h>

#include <cfloat>

#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "ops/quantize_kv_cache/cuda.cuh"

namespace ort_ops {
namespace {

constexpr int kMaxPerLane = 16;  // head_dim <= 512

__device__ __forceinline__ float load_elem(const void* base, int64_t i, bool fp16) {
  return fp16 ? __half2float(static_cast<const __half*>(base)[i]) : static_cast<const float*>(base)[i];
}

// Whether slot_mapping is bad (a slot past the cache, or a live slot twice), decided by one warp
// for T <= kQkvInlineCheckMax: lane l holds the slots of tokens l and l + 32 and compares each
// with every earlier token's (broadcast by shuffles).
__device__ bool slots_bad_inline(const QuantizeKvCacheParams& p, int lane) {
  const int t = p.num_tokens;
  const int64_t a = lane < t ? p.slot_mapping[lane] : -1;
  const int64_t b = lane + 32 < t ? p.slot_mapping[lane + 32] : -1;
  bool bad = a >= p.num_slots || b >= p.num_slots;
  for (int j = 0; j < t; ++j) {
    const int64_t sa = __shfl_sync(0xffffffffu, a, j & 31), sb = __shfl_sync(0xffffffffu, b, j & 31);
    const int64_t sj = j < 32 ? sa : sb;
    if (sj < 0) continue;
    bad = bad || (j < lane && a == sj) || (j < lane + 32 && b == sj);
  }
  return __any_sync(0xffffffffu, bad);
}

// The slot check for many tokens: CTA (i, j) compares tile i's slots with tile j's (j <= i), each
// against earlier tokens only; tile 0 also checks the range. Sets *verdict (device scratch, zeroed
// before) and the status bit.
constexpr int kCheckTile = 256;
__global__ void check_slots_kernel(const int64_t* slot_mapping, int num_tokens, int64_t num_slots, int* verdict,
                                   int* status) {
  if (blockIdx.y > blockIdx.x) return;
  __shared__ int64_t other[kCheckTile];
  const int i = blockIdx.x * kCheckTile + threadIdx.x;
  const int j0 = blockIdx.y * kCheckTile;
  if (j0 + static_cast<int>(threadIdx.x) < num_tokens) other[threadIdx.x] = slot_mapping[j0 + threadIdx.x];
  __syncthreads();
  if (i >= num_tokens) return;
  const int64_t s = slot_mapping[i];
  bool bad = blockIdx.y == 0 && s >= num_slots;
  const int jn = min(kCheckTile, min(num_tokens, i) - j0);  // earlier tokens of tile j only
  if (s >= 0)
    for (int j = 0; j < jn && !bad; ++j) bad = other[j] == s;
  if (bad) {
    atomicOr(verdict, 1);
    atomicOr(status, kQkvSlotBad);
  }
}

__global__ void quantize_kv_cache_kernel(QuantizeKvCacheParams p) {
  // Launched as a programmatic dependent (sm_90, decode-sized launches): wait for the previous
  // kernel's writes (the K/V this step projected) before any global read, then let the next
  // kernel (the attention, which waits for this grid in turn) become resident.
  ptx::griddep_wait();
  ptx::griddep_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t vec = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nvec = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * 2;
  if (vec >= nvec) return;
  // All or nothing: no vector is written when slot_mapping is bad.
  if (p.num_tokens <= kQkvInlineCheckMax) {
    if (slots_bad_inline(p, lane)) {
      if (vec == 0 && lane == 0) atomicOr(p.status, kQkvSlotBad);
      return;
    }
  } else if (*static_cast<const volatile int*>(p.workspace) != 0) {
    return;
  }
  const bool is_value = vec & 1;
  const int64_t th = vec >> 1;  // token * H + head
  const int token = static_cast<int>(th / p.num_kv_heads);
  const int head = static_cast<int>(th % p.num_kv_heads);
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // skipped token (padding)
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
  const float inv = amax > 0.0f ? fminf(__fdiv_rn(127.0f, amax), FLT_MAX) : 0.0f;  // saturated: DESIGN.md
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

size_t quantize_kv_cache_workspace_bytes(int64_t num_tokens) {
  return num_tokens > kQkvInlineCheckMax ? 16 : 0;
}

cudaError_t launch_quantize_kv_cache(const QuantizeKvCacheParams& p, cudaStream_t stream) {
  if (p.head_dim <= 0 || p.head_dim > 32 * kMaxPerLane || p.block_size <= 0 || p.status == nullptr)
    return cudaErrorInvalidValue;
  const int64_t nvec = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * 2;
  if (nvec == 0) return cudaSuccess;
  if (p.num_tokens > kQkvInlineCheckMax) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    int* verdict = static_cast<int*>(p.workspace);
    cudaError_t err = cudaMemsetAsync(verdict, 0, sizeof(int), stream);
    if (err != cudaSuccess) return err;
    const unsigned tiles = static_cast<unsigned>((p.num_tokens + kCheckTile - 1) / kCheckTile);
    check_slots_kernel<<<dim3(tiles, tiles), kCheckTile, 0, stream>>>(p.slot_mapping, p.num_tokens, p.num_slots,
                                                                      verdict, p.status);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  constexpr int kThreads = 256;
  const int64_t blocks = (nvec * 32 + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  // Decode-sized launches (the in-kernel slot check) captured into a CUDA graph are programmatic
  // dependents of the previous kernel (cuda/launch.cuh); the check-kernel path is already ordered
  // behind its own launches.
  if (p.num_tokens <= kQkvInlineCheckMax && cuda_util::dependent_launch_pays(stream))
    return cuda_util::launch_dependent(quantize_kv_cache_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                                       stream, p);
  quantize_kv_cache_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ort_ops
