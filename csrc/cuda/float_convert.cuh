// SPDX-License-Identifier: MIT
// float32 <-> the kernels' activation element types (float32, float16), for kernels templated on
// the element type: to_f32 widens exactly, from_f32 rounds to nearest even (float16).
#pragma once

#include <cuda_fp16.h>

namespace ort_ops::cuda_util {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

}  // namespace ort_ops::cuda_util
