// SPDX-License-Identifier: MIT
// SwiGLU CUDA kernel: one pass over x, a grid-stride loop over chunks of VEC output elements.
// A chunk never crosses a row (n % VEC == 0 on the vector path), so its a and b halves are two
// 16-byte loads and its output one 16-byte store when x and y are 16-byte aligned; otherwise
// VEC = 1. Bit-exact with the numpy reference: the float32 math is GroupedMatmulSwigluQuant's
// epi::swiglu_f32 (explicit _rn intrinsics in the recipe's order, the contract's exp_f32).
#include "ops/swiglu/cuda.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/export.h"
#include "cuda/float_convert.cuh"
#include "ops/grouped_matmul_swiglu_quant/epilogue.cuh"

namespace ort_ops::swiglu_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // enough to fill any current GPU; the loop strides past it

// The recipe plus its rule for a = -Inf (exp_f32 clamps, so a / d alone would give -Inf; the
// replaced graph computes a * sigmoid(a) = -Inf * 0 = NaN).
__device__ __forceinline__ float swiglu_value(float a, float b) {
  return a == -INFINITY ? __int_as_float(0x7fc00000) : gmsq_cuda::epi::swiglu_f32(a, b);
}

// VEC elements of T as one aligned load / store unit (16 bytes on the vector paths).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

using cuda_util::from_f32;
using cuda_util::to_f32;

// chunks = rows * n / VEC; chunk c is row c / (n / VEC), columns VEC * (c % (n / VEC)) onwards.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const T* __restrict__ x,
                                                          T* __restrict__ y, int64_t chunks,
                                                          int64_t n) {
  using P = Pack<T, VEC>;
  const int64_t per_row = n / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < chunks;
       c += stride) {
    const int64_t r = c / per_row;
    const int64_t col = (c - r * per_row) * VEC;
    const T* xr = x + r * 2 * n + col;
    const P a = *reinterpret_cast<const P*>(xr);
    const P b = *reinterpret_cast<const P*>(xr + n);
    P out;
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.v[i] = from_f32<T>(swiglu_value(to_f32(a.v[i]), to_f32(b.v[i])));
    *reinterpret_cast<P*>(y + r * n + col) = out;
  }
}

template <typename T, int VEC>
cudaError_t launch_typed(const void* x, void* y, int64_t rows, int64_t n, cudaStream_t stream) {
  const int64_t chunks = rows * (n / VEC);
  const int blocks = static_cast<int>(std::min<int64_t>((chunks + kThreads - 1) / kThreads, kMaxBlocks));
  swiglu_kernel<T, VEC><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y),
                                                          chunks, n);
  return cudaGetLastError();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

cudaError_t launch_swiglu(const void* x, bool x_is_half, void* y, int64_t rows, int64_t n,
                          cudaStream_t stream) {
  if (rows < 0 || n < 0) return cudaErrorInvalidValue;
  if (rows == 0 || n == 0) return cudaSuccess;
  const int vec = x_is_half ? 8 : 4;  // 16 bytes of either type
  const bool vector = n % vec == 0 && aligned16(x) && aligned16(y);
  if (x_is_half)
    return vector ? launch_typed<__half, 8>(x, y, rows, n, stream)
                  : launch_typed<__half, 1>(x, y, rows, n, stream);
  return vector ? launch_typed<float, 4>(x, y, rows, n, stream)
                : launch_typed<float, 1>(x, y, rows, n, stream);
}

}  // namespace ort_ops::swiglu_cuda

ORT_OPS_CUDA_EXPORT int ort_ops_swiglu_cuda(const void* x, int x_is_half, void* y, int64_t rows,
                                            int64_t n, void* stream) {
  return static_cast<int>(ort_ops::swiglu_cuda::launch_swiglu(x, x_is_half != 0, y, rows, n,
                                                               static_cast<cudaStream_t>(stream)));
}
