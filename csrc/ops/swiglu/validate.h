// SPDX-License-Identifier: MIT
// SwiGLU's input checks, one copy for the CPU op (op.cc) and the CUDA-EP op (cuda_op.cc):
// x's presence, dtype, rank and even last dim.
//
// Alphabet: I output width (x's last dim is 2I); rows = product of x's leading dims.
#pragma once

#include <cstdint>
#include <vector>

#include "common/op_base.h"
#include "common/tensor.h"

namespace ort_ops::swiglu {

inline constexpr const char* kOp = "SwiGLU";

struct Inputs {
  InputView x;
};

struct Dims {
  int64_t I, rows;
  std::vector<int64_t> y_shape;  // x's shape with the last dim halved
};

Inputs read_inputs(const Ort::KernelContext& ctx);

// Checks x; returns the dims.
Dims validate_inputs(const Inputs& in);

// Inputs and outputs of the op, registered for every execution provider (register.cc).
const OpSignature& signature();

}  // namespace ort_ops::swiglu
