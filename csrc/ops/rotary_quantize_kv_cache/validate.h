// SPDX-License-Identifier: MIT
// RotaryQuantizeKVCache's attribute and input checks, one copy for the CPU op (op.cc) and the
// CUDA-EP op (cuda_op.cc). The checks of slot_mapping and the caches are QuantizeKVCache's
// (ops/quantize_kv_cache/validate.h), with messages naming this op.
//
// Alphabet: T tokens, Hq query heads, Hkv kv heads, D head dim, R rotary width (half = R / 2).
#pragma once

#include <cstdint>

#include "common/op_base.h"
#include "common/tensor.h"
#include "ops/quantize_kv_cache/validate.h"

namespace ort_ops::rotary_quantize_kv_cache {

inline constexpr const char* kOp = "RotaryQuantizeKVCache";

struct Attrs {
  int64_t num_heads = 0;     // Hq
  int64_t kv_num_heads = 0;  // Hkv
  bool interleaved = false;
};

// Reads and checks the attributes (num_heads and kv_num_heads required, > 0, Hq % Hkv == 0;
// interleaved 0 or 1).
Attrs read_attrs(const OrtKernelInfo* info);

// The inputs in schema order.
struct Inputs {
  InputView qkv, cos, sin;
  quantize_kv_cache::Caches caches;
};

struct Dims {
  int64_t T, Hq, Hkv, D, half;
  quantize_kv_cache::Dims cache;  // T, Hkv, D, N, B
};

Inputs read_inputs(const Ort::KernelContext& ctx);

// Checks every input's dtype, rank and shape against the attributes; returns the dims.
Dims validate_inputs(const Inputs& in, const Attrs& a);

// Inputs and outputs of the op, registered for every execution provider (register.cc).
const OpSignature& signature();

}  // namespace ort_ops::rotary_quantize_kv_cache
