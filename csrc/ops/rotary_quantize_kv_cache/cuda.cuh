// SPDX-License-Identifier: MIT
// RotaryQuantizeKVCache on the GPU: launcher on raw device pointers (no ORT headers). Spec:
// ort_ops/ops/rotary_quantize_kv_cache.py. Shapes (T tokens, Hq / Hkv heads, D head dim, R rotary
// width): qkv [T, (Hq + 2 Hkv) D] fp16 or fp32; cos/sin [T, R/2] of qkv's dtype; query [T, Hq, D]
// of qkv's dtype; slot_mapping and the caches as QuantizeKVCache (ops/quantize_kv_cache/cuda.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ops/quantize_kv_cache/cuda.cuh"

namespace ort_ops {

struct RotaryQuantizeKvParams {
  const void* qkv = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  void* query = nullptr;
  int num_heads = 0;     // Hq, a multiple of cache.num_kv_heads
  int rotary_half = 0;   // R / 2, 1 .. D / 2
  bool interleaved = false;
  // slot_mapping, the caches, their dims, status and workspace as QuantizeKVCache's launch takes
  // them (cache.key / cache.value unused: K and V come from qkv); cache.input_fp16 is qkv's dtype;
  // cache.head_dim 1..512; workspace: quantize_kv_cache_workspace_bytes(num_tokens) bytes.
  QuantizeKvCacheParams cache;
};

// One warp per (token, kv head): rotates the kv head's K (rounded to qkv's dtype), quantizes K
// and V with the contract's rule into the token's slot (bit-exact with the reference), and
// rotates the Hq / Hkv query heads of its group into `query` (every token, negative slots too).
// A bad slot_mapping (checked on the device before any cache write) leaves the caches untouched
// and sets kQkvSlotBad; a non-finite rotated K or V vector is left unwritten and sets
// kQkvNonFinite. No host synchronization. Returns the launch status.
cudaError_t launch_rotary_quantize_kv_cache(const RotaryQuantizeKvParams& p, cudaStream_t stream);

}  // namespace ort_ops

// Plain C entry for tests (ctypes, torch tensors); returns a cudaError_t value. `status` is 32
// bytes of device memory: the status word, then the slot check's scratch at byte 16.
extern "C" int ort_ops_cuda_rotary_quantize_kv_cache(const void* qkv, const void* cos, const void* sin, int fp16,
                                                     void* query, const void* slot_mapping, void* key_cache,
                                                     void* value_cache, void* key_scale, void* value_scale,
                                                     int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                                                     int rotary_half, int interleaved, int block_size,
                                                     long long num_slots, int* status, void* stream);
