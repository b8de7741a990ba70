// SPDX-License-Identifier: MIT
// float16 <-> float32 for the scalar paths, through ORT's own Float16_t (round to nearest even).
#pragma once

#include <cstdint>

#include "onnxruntime_cxx_api.h"

namespace ort_ops {

inline float half_to_float(uint16_t bits) { return Ort::Float16_t::FromBits(bits).ToFloat(); }
inline uint16_t float_to_half(float v) { return Ort::Float16_t(v).val; }

}  // namespace ort_ops
