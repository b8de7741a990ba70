// SPDX-License-Identifier: MIT
#include "common/convert.h"

#include "common/half.h"

namespace ort_ops {

void half_to_float_scalar(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(in[i]);
}

void float_to_half_scalar(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_half(in[i]);
}

HalfToFloatFn half_to_float_fn(CpuIsa isa) {
  return isa >= CpuIsa::kAvx2 ? half_to_float_avx2 : half_to_float_scalar;
}

FloatToHalfFn float_to_half_fn(CpuIsa isa) {
  return isa >= CpuIsa::kAvx2 ? float_to_half_avx2 : float_to_half_scalar;
}

}  // namespace ort_ops
