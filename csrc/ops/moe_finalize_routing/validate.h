// SPDX-License-Identifier: MIT
// MoeFinalizeRouting's input checks, one copy for the CPU op (op.cc) and the CUDA-EP op
// (cuda_op.cc): presence, dtypes and shapes of the four inputs. The permutation rule on
// sorted_to_flat's values stays with each device (the CPU checks it on the host, the CUDA
// kernel on the device, each with its own message).
//
// Alphabet: M tokens, K top-k, H hidden size.
#pragma once

#include <cstdint>

#include "common/op_base.h"
#include "common/tensor.h"

namespace ort_ops::moe_finalize_routing {

inline constexpr const char* kOp = "MoeFinalizeRouting";

// The inputs in schema order; residual is optional.
struct Inputs {
  InputView expert_out, sorted_to_flat, topk_weights, residual;
};

struct Dims {
  int64_t M, K, H, total;  // total = M * K
};

Inputs read_inputs(const Ort::KernelContext& ctx);

// Checks every input's presence, dtype, rank and shape; returns the dims.
Dims validate_inputs(const Inputs& in);

// Inputs and outputs of the op, registered for every execution provider (register.cc).
const OpSignature& signature();

}  // namespace ort_ops::moe_finalize_routing
