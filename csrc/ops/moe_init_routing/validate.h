// SPDX-License-Identifier: MIT
// MoeInitRouting's checks, one copy for the CPU op (op.cc) and the CUDA-EP op (cuda_op.cc):
// the num_experts attribute, the inputs' presence, dtypes and shapes, and the expert id range.
// What only one device refuses (the CUDA EP's num_experts <= INT32_MAX) stays in that device's
// file; reading expert_ids into host memory is the caller's business.
//
// Alphabet: M tokens, H hidden size, K top-k, E experts.
#pragma once

#include <cstdint>

#include "common/op_base.h"
#include "common/tensor.h"

namespace ort_ops::moe_init_routing {

inline constexpr const char* kOp = "MoeInitRouting";

// The inputs in schema order.
struct Inputs {
  InputView x, expert_ids, x_scale;
};

struct Dims {
  int64_t M, H, K, total;  // total = M * K (<= INT32_MAX: sorted_to_flat is int32)
  int64_t elem_bytes;      // of x: 4, 2 or 1 (int8, with x_scale)
};

// Reads attribute num_experts; it must be given and >= 1.
int64_t read_num_experts(const OrtKernelInfo* info);

Inputs read_inputs(const Ort::KernelContext& ctx);

// Checks the inputs' presence, dtype, rank and shape (x_scale float32 [M] exactly when x is
// int8), and M * K; returns the dims.
Dims validate_inputs(const Inputs& in);

// Checks the total ids at `id` (host memory, [M, K] row-major) are in [0, num_experts).
void check_expert_ids(const int32_t* id, const Dims& d, int64_t num_experts);

// Inputs and outputs of the op, registered for every execution provider (register.cc).
const OpSignature& signature();

}  // namespace ort_ops::moe_init_routing
