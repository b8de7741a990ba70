// SPDX-License-Identifier: MIT
// Row conversions shared by the ops (float16 activations are widened to float32 before any
// arithmetic: DESIGN.md's rule is float32 throughout).
#pragma once

#include <cstdint>

#include "common/cpu_features.h"

namespace ort_ops {

using HalfToFloatFn = void (*)(const uint16_t* in, float* out, int64_t n);
using FloatToHalfFn = void (*)(const float* in, uint16_t* out, int64_t n);

void half_to_float_scalar(const uint16_t* in, float* out, int64_t n);
void float_to_half_scalar(const float* in, uint16_t* out, int64_t n);
void half_to_float_avx2(const uint16_t* in, float* out, int64_t n);
void float_to_half_avx2(const float* in, uint16_t* out, int64_t n);

HalfToFloatFn half_to_float_fn(CpuIsa isa);
FloatToHalfFn float_to_half_fn(CpuIsa isa);

}  // namespace ort_ops
