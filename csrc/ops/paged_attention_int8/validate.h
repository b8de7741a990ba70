// SPDX-License-Identifier: MIT
// PagedAttentionInt8's attribute and input checks, one copy for the CPU op (op.cc) and the
// CUDA-EP op (cuda_op.cc): attribute values and every input's dtype, rank and shape. What a
// device's kernels support (head dims, block sizes, qk_quant) stays in that device's file and is
// called through DeviceChecks; the values of block_tables, seq_lens and cu_seqlens_q are checked
// where they live (op.cc on the host, the CUDA kernels on the device).
//
// Alphabet: T query tokens, S sequences, Hq query heads, Hkv kv heads, D head dim, N cache
// blocks, B block size, M max blocks per sequence.
#pragma once

#include <cstdint>
#include <string>

#include "common/op_base.h"
#include "common/tensor.h"

namespace ort_ops::paged_attention_int8 {

inline constexpr const char* kOp = "PagedAttentionInt8";

struct Attrs {
  bool qk_s8 = true;             // qk_quant: "s8" (true) or "none"
  std::string pv_quant = "s8";   // "s8", "u8" or "none"
  int64_t partition_size = 256;  // a positive multiple of 32 (the W scale group)
  bool has_scale = false;
  float scale = 0.0f;  // finite when has_scale
  int64_t window = 0;    // > 0: a query at p sees keys p - window < k <= p; 0: no window
  float softcap = 0.0f;  // > 0: s = softcap * tanh(s / softcap) after the scale; 0: off

  // The softmax scale: the attribute, else 1 / sqrt(D).
  float softmax_scale(int64_t D) const;
};

// The inputs in schema order; cu_seqlens_q may be absent (decode), head_sink too (no sink).
struct Inputs {
  InputView query, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens,
      cu_seqlens_q, head_sink;
};

// The first key position any query of a sequence with seq_len keys and q_len query rows sees:
// that of its first query row (position seq_len - q_len); 0 without a window. Blocks wholly
// before it are never read (DESIGN.md).
inline int64_t first_visible(int64_t seq_len, int64_t q_len, int64_t window) {
  const int64_t f = seq_len - q_len - window + 1;
  return window > 0 && f > 0 ? f : 0;
}

struct Dims {
  int64_t T, Hq, D, N, Hkv, B, S, M;
};

// A device's refusals of valid configurations, called where the shared checks reach them (so
// the first error a bad model meets does not depend on which file holds a check); nullptr: none.
struct DeviceChecks {
  // After qk_quant and pv_quant are read and valid, before partition_size.
  void (*attrs)(const Attrs& a) = nullptr;
  // After key_cache's shape (D and B known), before the head counts.
  void (*head_dim_and_block_size)(int64_t D, int64_t B) = nullptr;
};

// Reads and checks the attributes (at session creation).
Attrs parse_attrs(const OrtKernelInfo* info, const DeviceChecks& device);

Inputs read_inputs(const Ort::KernelContext& ctx);

// Checks every input's dtype, rank and shape (head_sink: float32 [Hq]), and T == S without
// cu_seqlens_q; returns the dims.
Dims validate_inputs(const Inputs& in, const DeviceChecks& device);

// Inputs and outputs of the op, registered for every execution provider (register.cc).
const OpSignature& signature();

}  // namespace ort_ops::paged_attention_int8
