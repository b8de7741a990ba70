// SPDX-License-Identifier: MIT
// DynamicQuant's input checks, one copy for the CPU op (op.cc) and the CUDA-EP op
// (cuda_op.cc): x's presence, dtype and rank, and smooth_scale's dtype and shape. The
// non-finite rule is each device's (found while quantizing).
//
// Alphabet: K last dim of x; rows = product of x's leading dims.
#pragma once

#include <cstdint>
#include <vector>

#include "common/op_base.h"
#include "common/tensor.h"

namespace ort_ops::dynamic_quant {

inline constexpr const char* kOp = "DynamicQuant";

// The inputs in schema order; smooth_scale is optional.
struct Inputs {
  InputView x, smooth_scale;
};

struct Dims {
  int64_t K, rows;
  std::vector<int64_t> scale_shape;  // x's shape without its last dim
};

Inputs read_inputs(const Ort::KernelContext& ctx);

// Checks both inputs; returns the dims.
Dims validate_inputs(const Inputs& in);

// Inputs and outputs of the op, registered for every execution provider (register.cc).
const OpSignature& signature();

}  // namespace ort_ops::dynamic_quant
