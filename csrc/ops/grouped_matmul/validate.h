// SPDX-License-Identifier: MIT
// Input checks of GroupedMatmulSwigluQuant and GroupedMatmulDequant, one copy for the CPU ops
// (driver.cc) and the CUDA-EP ops (grouped_matmul_swiglu_quant/cuda_op_common.h): presence,
// dtypes and shapes of x int8 [M, K], weight int8 [E, K, N], weight_scale [E, N], x_scale [M],
// group_list int64 [E], the optional bias float32 [E, N]. What only one device refuses stays in
// that device's file (DeviceChecks, or after validate_inputs); group_list's and the bias's values
// are checked where they live (CPU: host; CUDA: the kernel, which flags a non-finite product).
//
// Alphabet: M rows, K inner dim, N output columns, E experts.
#pragma once

#include <cstdint>

#include "common/op_base.h"
#include "common/tensor.h"
#include "ops/grouped_matmul/activation.h"

namespace ort_ops::grouped_matmul {

// The inputs in schema order.
struct Inputs {
  InputView x, weight, weight_scale, x_scale, group_list, bias;  // bias: optional input 5
};

struct Dims {
  int64_t m, k, n, e;
};

// A device's refusals of valid inputs, called where the shared checks reach them (so the first
// error a bad model meets does not depend on which file holds a check); nullptr: none.
struct DeviceChecks {
  // After weight's shape (and even N), before weight_scale's checks.
  void (*after_weight)(const char* op, const Dims& d) = nullptr;
};

Inputs read_inputs(const Ort::KernelContext& ctx);

// The attribute 'group_list_type': 0 (cumulative ends, the default) or 1 (counts), else an error
// naming `op`.
int64_t read_group_list_type(const char* op, const OrtKernelInfo* info);

// GroupedMatmulSwigluQuant's attributes 'activation' ("swiglu" default, "swiglu_oai"), 'alpha' and
// 'limit' (finite; limit > 0), else an error naming `op` and the attribute.
Act read_activation(const char* op, const OrtKernelInfo* info);

// Checks inputs 0..4's presence, dtype, rank and shape and the optional bias's dtype and shape;
// even_n: N must be even (SwiGLU pairs). Messages name `op`. Returns the dims.
Dims validate_inputs(const char* op, const Inputs& in, bool even_n, const DeviceChecks& device);

// Inputs and outputs of GroupedMatmulSwigluQuant, registered for every execution provider (register.cc).
const OpSignature& swiglu_quant_signature();

// Inputs and outputs of GroupedMatmulDequant, registered for every execution provider (register.cc).
const OpSignature& dequant_signature();

}  // namespace ort_ops::grouped_matmul
