// SPDX-License-Identifier: MIT
// QuantizeKVCache on the GPU: launcher on raw device pointers (no ORT headers). Spec:
// ort_ops/ops/quantize_kv_cache.py. Shapes (T new tokens, H kv heads, D head dim, N blocks,
// B block size): key/value [T, H, D] fp16 or fp32; slot_mapping int64 [T]; key_cache int8
// [N, H, B, D]; value_cache int8 [N, H, D, B]; key_scale/value_scale float32 [N, H, B].
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ort_ops {

// Bits the kernels OR into *status (the op's mapped status word, cuda/device_status.h; never
// cleared on the device).
enum QuantizeKvStatus : int {
  // A slot >= N * B, or a live (>= 0) slot given to two tokens: nothing of the launch is written.
  kQkvSlotBad = 1,
  kQkvNonFinite = 2,  // a K or V vector holds NaN/Inf: its codes are not written, the others are
};

// Up to this many tokens every warp of the write kernel checks all slots itself (T^2 / 2
// comparisons in registers); more tokens get a check kernel first, whose verdict the write kernel
// reads (the launch needs quantize_kv_cache_workspace_bytes(T) of device scratch then).
inline constexpr int kQkvInlineCheckMax = 64;

struct QuantizeKvCacheParams {
  const void* key = nullptr;
  const void* value = nullptr;
  bool input_fp16 = false;
  const int64_t* slot_mapping = nullptr;
  int8_t* key_cache = nullptr;
  int8_t* value_cache = nullptr;
  float* key_scale = nullptr;
  float* value_scale = nullptr;
  int num_tokens = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // 1..512
  int block_size = 0;
  int64_t num_slots = 0;  // N * B
  int* status = nullptr;  // required
  void* workspace = nullptr;  // quantize_kv_cache_workspace_bytes(num_tokens) bytes (when non-zero)
};

// The cache part of the params (all but key, value and input_fp16) from raw pointers, for the C
// entries that tests call through ctypes.
inline QuantizeKvCacheParams kv_cache_params(const void* slot_mapping, void* key_cache, void* value_cache,
                                             void* key_scale, void* value_scale, int num_tokens, int num_kv_heads,
                                             int head_dim, int block_size, long long num_slots, int* status,
                                             void* workspace) {
  QuantizeKvCacheParams p;
  p.slot_mapping = static_cast<const int64_t*>(slot_mapping);
  p.key_cache = static_cast<int8_t*>(key_cache);
  p.value_cache = static_cast<int8_t*>(value_cache);
  p.key_scale = static_cast<float*>(key_scale);
  p.value_scale = static_cast<float*>(value_scale);
  p.num_tokens = num_tokens;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.num_slots = num_slots;
  p.status = status;
  p.workspace = workspace;
  return p;
}

size_t quantize_kv_cache_workspace_bytes(int64_t num_tokens);

// For T > kQkvInlineCheckMax: enqueues the slot check (range, no live slot twice) whose verdict
// the writing kernels read from the first int of `workspace` (quantize_kv_cache_workspace_bytes(T)
// bytes of device scratch) before writing anything (cuda_device.cuh, slots_bad); a bad
// slot_mapping also sets kQkvSlotBad in *status.
cudaError_t launch_kv_slot_check(const int64_t* slot_mapping, int num_tokens, int64_t num_slots, void* workspace,
                                 int* status, cudaStream_t stream);

// Quantizes each (token, kv head) K and V vector with the contract's rule (bit-exact with
// ort_ops.ops._quant.quantize_rows) and writes the codes and scales into its slot. The slots are
// checked on the device before anything is written (range, no live slot twice): a bad
// slot_mapping leaves the caches untouched and sets kQkvSlotBad. Returns the launch status.
cudaError_t launch_quantize_kv_cache(const QuantizeKvCacheParams& p, cudaStream_t stream);

}  // namespace ort_ops
