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

  // The softmax scale: the attribute, else 1 / sqrt(D).
  float softmax_scale(int64_t D) const;
};

// The inputs in schema order; cu_seqlens_q may be absent (decode).
struct Inputs {
  InputView query, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens,
      cu_seqlens_q;
};

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

// Checks every input's dtype, rank and shape, and T == S without cu_seqlens_q; returns the dims.
Dims validate_inputs(const Inputs& in, const DeviceChecks& device);

// Inputs and outputs of the op, registered for every execution provider (register.cc).
const OpSignature& signature();

}  // namespace ort_ops::paged_attention_int8
