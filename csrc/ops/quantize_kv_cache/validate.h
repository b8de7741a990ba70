// SPDX-License-Identifier: MIT
// QuantizeKVCache's input checks, one copy for the CPU op (op.cc) and the CUDA-EP op
// (cuda_op.cc): dtypes, ranks and shapes of the seven inputs, and the slot rule. What only one
// device refuses stays in that device's file (DeviceChecks, or after validate_inputs); reading
// slot_mapping into host memory is the caller's business.
//
// Alphabet: T tokens, H kv heads, D head dim, N cache blocks, B block size.
#pragma once

#include <cstdint>

#include "common/op_base.h"
#include "common/tensor.h"

namespace ort_ops::quantize_kv_cache {

inline constexpr const char* kOp = "QuantizeKVCache";

// slot_mapping and the four caches: the inputs every op that writes the paged cache takes.
struct Caches {
  InputView slot_mapping, key_cache, value_cache, key_scale, value_scale;
};

// The inputs in schema order.
struct Inputs {
  InputView key, value, slot_mapping, key_cache, value_cache, key_scale, value_scale;
  Caches caches() const { return Caches{slot_mapping, key_cache, value_cache, key_scale, value_scale}; }
};

struct Dims {
  int64_t T, H, D, N, B;
};

// A device's refusals of valid inputs, called where the shared checks reach them (so the first
// error a bad model meets does not depend on which file holds a check); nullptr: none.
struct DeviceChecks {
  // After the dtype checks of key and value (both float32 or float16), before slot_mapping's.
  void (*key_value_dtypes)(const InputView& key, const InputView& value) = nullptr;
};

Inputs read_inputs(const Ort::KernelContext& ctx);

// Checks every input's dtype, rank and shape; returns the dims.
Dims validate_inputs(const Inputs& in, const DeviceChecks& device);

// The cache checks, with messages naming `op`, for the ops that write the cache as this one does
// (RotaryQuantizeKVCache): the dtypes of the five inputs, then (after the op's own rank checks)
// their shapes for T tokens of H kv heads of D values. Returns the dims.
void check_cache_dtypes(const char* op, const Caches& c);
Dims check_cache_shapes(const char* op, const Caches& c, int64_t T, int64_t H, int64_t D);

// Checks the T slots at `slot` (host memory): each < N * B (a negative one skips its token) and
// no live slot twice. Returns how many are live. Messages name `op`.
int64_t check_slots(const char* op, const int64_t* slot, const Dims& d);

// Inputs and outputs of the op, registered for every execution provider (register.cc).
const OpSignature& signature();

}  // namespace ort_ops::quantize_kv_cache
