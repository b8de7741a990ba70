// SPDX-License-Identifier: MIT
// The contract's float32 exp and SwiGLU constants (ort_ops/ops/_moe.py), written as hex floats
// so C++ and numpy hold the very same float32 values (decimal literals may round differently
// through double). Scalar versions here; SIMD versions in simd_ymm.h use the same constants.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace ort_ops::grouped_matmul {

constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.63p-1f;       // 9 significant bits: n * kLn2Hi is exact for |n| <= 127
constexpr float kLn2Lo = -0x1.bd0106p-13f;
constexpr float kExpLo = -87.0f;           // keeps 2^n and the result normal
constexpr float kExpHi = 88.0f;            // keeps the result finite
constexpr float kP0 = 0x1.a0d2cep-13f;     // Cephes expf minimax coefficients
constexpr float kP1 = 0x1.6e879cp-10f;
constexpr float kP2 = 0x1.111210p-7f;
constexpr float kP3 = 0x1.555382p-5f;
constexpr float kP4 = 0x1.555554p-3f;
constexpr float kP5 = 0.5f;

// exp_f32 of _moe.py for a finite v; one float32 operation per step, in the spec's order (the
// library is compiled with -ffp-contract=off, so no step fuses into an FMA).
inline float exp_f32_scalar(float v) {
  const float t = std::fmin(std::fmax(v, kExpLo), kExpHi);
  const float n = std::nearbyint(t * kLog2e);  // round half to even (default rounding mode)
  float r = t - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kP0;
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  const float z = r * r;
  float y = p * z;
  y = y + r;
  y = y + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  return y * pow2;  // exact: a power of two times y, the result stays normal
}

}  // namespace ort_ops::grouped_matmul
