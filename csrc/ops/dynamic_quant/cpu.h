// SPDX-License-Identifier: MIT
// DynamicQuant CPU kernels: one float32 row in, INT8 codes and the row scale out, by the
// contract's rule (DESIGN.md). Every variant gives the same codes bit for bit.
#pragma once

#include <cstdint>

#include "common/cpu_features.h"

namespace ort_ops::dynamic_quant {

// Quantizes x[0..k) (times smooth[0..k) when smooth != nullptr). Returns false, writing
// nothing, if a value (or product) is NaN or +-Inf.
using QuantizeRowFn = bool (*)(const float* x, const float* smooth, int64_t k, int8_t* y,
                               float* scale);

bool quantize_row_scalar(const float* x, const float* smooth, int64_t k, int8_t* y, float* scale);
bool quantize_row_avx2(const float* x, const float* smooth, int64_t k, int8_t* y, float* scale);

inline QuantizeRowFn quantize_row_fn(CpuIsa isa) {
  return isa >= CpuIsa::kAvx2 ? quantize_row_avx2 : quantize_row_scalar;
}

}  // namespace ort_ops::dynamic_quant
