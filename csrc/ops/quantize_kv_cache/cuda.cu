// SPDX-License-Identifier: MIT
// QuantizeKVCache kernel: one warp per (token, kv head, K or V) vector, quantized and stored by
// the shared device functions (cuda_device.cuh: the contract's rule, bit-exact), behind the slot
// check (in-warp for few tokens, the check kernel below for many).
#include <cuda_fp16.h>

#include "cuda/launch.cuh"
#include "cuda/ptx.cuh"
#include "ops/quantize_kv_cache/cuda.cuh"
#include "ops/quantize_kv_cache/cuda_device.cuh"

namespace ort_ops {
namespace {

constexpr int kMaxPerLane = 16;  // head_dim <= 512

__device__ __forceinline__ float load_elem(const void* base, int64_t i, bool fp16) {
  return fp16 ? __half2float(static_cast<const __half*>(base)[i]) : static_cast<const float*>(base)[i];
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
  if (kv_cache_device::slots_bad(p.slot_mapping, p.num_tokens, p.num_slots, p.workspace, p.status, vec == 0, lane))
    return;
  const bool is_value = vec & 1;
  const int64_t th = vec >> 1;  // token * H + head
  const int token = static_cast<int>(th / p.num_kv_heads);
  const int head = static_cast<int>(th % p.num_kv_heads);
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0) return;  // skipped token (padding)
  const void* src = is_value ? p.value : p.key;
  const int64_t row = th * p.head_dim;
  float x[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    x[i] = d < p.head_dim ? load_elem(src, row + d, p.input_fp16) : 0.0f;
  }
  kv_cache_device::quantize_store(x, is_value, slot, head, p, lane);
}

}  // namespace

size_t quantize_kv_cache_workspace_bytes(int64_t num_tokens) {
  return num_tokens > kQkvInlineCheckMax ? 16 : 0;
}

cudaError_t launch_kv_slot_check(const int64_t* slot_mapping, int num_tokens, int64_t num_slots, void* workspace,
                                 int* status, cudaStream_t stream) {
  if (workspace == nullptr) return cudaErrorInvalidValue;
  int* verdict = static_cast<int*>(workspace);
  cudaError_t err = cudaMemsetAsync(verdict, 0, sizeof(int), stream);
  if (err != cudaSuccess) return err;
  const unsigned tiles = static_cast<unsigned>((num_tokens + kCheckTile - 1) / kCheckTile);
  check_slots_kernel<<<dim3(tiles, tiles), kCheckTile, 0, stream>>>(slot_mapping, num_tokens, num_slots, verdict,
                                                                    status);
  return cudaGetLastError();
}

cudaError_t launch_quantize_kv_cache(const QuantizeKvCacheParams& p, cudaStream_t stream) {
  if (p.head_dim <= 0 || p.head_dim > 32 * kMaxPerLane || p.block_size <= 0 || p.status == nullptr)
    return cudaErrorInvalidValue;
  const int64_t nvec = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads * 2;
  if (nvec == 0) return cudaSuccess;
  if (p.num_tokens > kQkvInlineCheckMax) {
    const cudaError_t err =
        launch_kv_slot_check(p.slot_mapping, p.num_tokens, p.num_slots, p.workspace, p.status, stream);
    if (err != cudaSuccess) return err;
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
