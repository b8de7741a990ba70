// SPDX-License-Identifier: MIT
// QuantizeKVCache's device functions, shared with the kernels that write the paged cache the same
// way (RotaryQuantizeKVCache): the in-warp slot check and the quantize-and-store of one vector
// held by a warp. The arithmetic is the contract's, operation for operation
// (ort_ops/ops/_quant.py): amax = max|x|, scale = amax / 127, inv = min(127 / amax, FLT_MAX),
// q = clamp(rint(x * inv), -127, 127), all correctly rounded float32 (__fdiv_rn, __fmul_rn: no
// FMA contraction, no approximate division), so the codes are bit-exact.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "ops/quantize_kv_cache/cuda.cuh"

namespace ort_ops::kv_cache_device {

// Whether slot_mapping is bad (a slot past the cache, or a live slot twice), decided by one warp
// for T <= kQkvInlineCheckMax: lane l holds the slots of tokens l and l + 32 and compares each
// with every earlier token's (broadcast by shuffles).
__device__ __forceinline__ bool slots_bad_inline(const int64_t* slot_mapping, int num_tokens, int64_t num_slots,
                                                 int lane) {
  const int t = num_tokens;
  const int64_t a = lane < t ? slot_mapping[lane] : -1;
  const int64_t b = lane + 32 < t ? slot_mapping[lane + 32] : -1;
  bool bad = a >= num_slots || b >= num_slots;
  for (int j = 0; j < t; ++j) {
    const int64_t sa = __shfl_sync(0xffffffffu, a, j & 31), sb = __shfl_sync(0xffffffffu, b, j & 31);
    const int64_t sj = j < 32 ? sa : sb;
    if (sj < 0) continue;
    bad = bad || (j < lane && a == sj) || (j < lane + 32 && b == sj);
  }
  return __any_sync(0xffffffffu, bad);
}

// All or nothing: whether this launch must write no cache byte because slot_mapping is bad. For
// T <= kQkvInlineCheckMax every warp checks the slots itself (the warp with report set ORs
// kQkvSlotBad into *status); above, the check kernel (launch_kv_slot_check) has set the status
// bit and left its verdict in the first int of `workspace`. Called by whole warps.
__device__ __forceinline__ bool slots_bad(const int64_t* slot_mapping, int num_tokens, int64_t num_slots,
                                          const void* workspace, int* status, bool report, int lane) {
  if (num_tokens <= kQkvInlineCheckMax) {
    const bool bad = slots_bad_inline(slot_mapping, num_tokens, num_slots, lane);
    if (bad && report && lane == 0) atomicOr(status, kQkvSlotBad);
    return bad;
  }
  return *static_cast<const volatile int*>(workspace) != 0;
}

// Quantizes the D = p.head_dim values a warp holds (lane l: x[i] = element l + 32 i, zero past D)
// with the contract's rule and writes the codes and the scale of kv head `head` into `slot`: K
// (is_value false) to key_cache[blk, head, off, :], V to value_cache[blk, head, :, off] (token
// innermost). A vector with a NaN/Inf is not written: returns false and ORs kQkvNonFinite into
// *p.status. Called by whole warps.
template <int kPerLane>
__device__ __forceinline__ bool quantize_store(const float (&x)[kPerLane], bool is_value, int64_t slot, int head,
                                               const QuantizeKvCacheParams& p, int lane) {
  float amax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    finite = finite && isfinite(x[i]);
    amax = fmaxf(amax, fabsf(x[i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  finite = __all_sync(0xffffffffu, finite);
  if (!finite) {
    if (lane == 0) atomicOr(p.status, kQkvNonFinite);
    return false;
  }
  const int d_total = p.head_dim;
  const float scale = __fdiv_rn(amax, 127.0f);
  const float inv = amax > 0.0f ? fminf(__fdiv_rn(127.0f, amax), FLT_MAX) : 0.0f;  // saturated: DESIGN.md
  const int64_t blk = slot / p.block_size;
  const int off = static_cast<int>(slot % p.block_size);
  const int64_t bh = blk * p.num_kv_heads + head;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
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
  return true;
}

}  // namespace ort_ops::kv_cache_device
