// SPDX-License-Identifier: MIT
// DynamicQuant CUDA kernel: one block per row (grid-stride), two passes over the row (the max,
// then the codes; the second pass reads the row back from L1/L2). Bit-exact with the numpy
// reference: float32 product x * smooth (one rounding, no FMA), inv = 127 / amax, one float32
// multiply and round-half-to-even per element.
#include "ops/dynamic_quant/cuda.cuh"

#include <cuda_fp16.h>

#include <cfloat>
#include <algorithm>

#include "cuda/export.h"

namespace ort_ops::dynamic_quant_cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_f32(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const __half* p, int64_t i) { return __half2float(p[i]); }

template <typename T>
__global__ void __launch_bounds__(kThreads) dynamic_quant_kernel(const T* x, const float* smooth,
                                                                 int8_t* y, float* scale,
                                                                 int* err, int64_t rows,
                                                                 int64_t k) {
  __shared__ float red[kThreads / 32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * k;
    float m = 0.0f;
    bool bad = false;
    for (int64_t i = threadIdx.x; i < k; i += kThreads) {
      float v = load_f32(xr, i);
      if (smooth) v = __fmul_rn(v, smooth[i]);
      if (!isfinite(v)) bad = true;
      m = fmaxf(m, fabsf(v));
    }
    if (bad) atomicOr(err, kErrNonFinite);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    float amax = red[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, red[w]);
    const float inv = amax > 0.0f ? fminf(__fdiv_rn(127.0f, amax), FLT_MAX) : 0.0f;  // saturated: DESIGN.md
    int8_t* yr = y + r * k;
    for (int64_t i = threadIdx.x; i < k; i += kThreads) {
      float v = load_f32(xr, i);
      if (smooth) v = __fmul_rn(v, smooth[i]);
      const float q = rintf(__fmul_rn(v, inv));
      yr[i] = static_cast<int8_t>(fminf(fmaxf(q, -127.0f), 127.0f));
    }
    if (threadIdx.x == 0) scale[r] = __fdiv_rn(amax, 127.0f);
    __syncthreads();  // red is reused by the next row
  }
}

}  // namespace

cudaError_t launch_dynamic_quant(const void* x, bool x_is_half, const float* smooth, int8_t* y,
                                 float* scale, int* err, int64_t rows, int64_t k,
                                 cudaStream_t stream) {
  if (rows < 0 || k < 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>(rows, 65535));
  if (x_is_half)
    dynamic_quant_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const __half*>(x), smooth, y,
                                                          scale, err, rows, k);
  else
    dynamic_quant_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(x), smooth, y,
                                                          scale, err, rows, k);
  return cudaGetLastError();
}

}  // namespace ort_ops::dynamic_quant_cuda

ORT_OPS_CUDA_EXPORT int ort_ops_dynamic_quant_cuda(const void* x, int x_is_half,
                                                   const float* smooth, int8_t* y, float* scale,
                                                   int* err, int64_t rows, int64_t k,
                                                   void* stream) {
  const cudaError_t e = cudaMemsetAsync(err, 0, sizeof(int), static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return static_cast<int>(e);
  return static_cast<int>(ort_ops::dynamic_quant_cuda::launch_dynamic_quant(
      x, x_is_half != 0, smooth, y, scale, err, rows, k, static_cast<cudaStream_t>(stream)));
}
