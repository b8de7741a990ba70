// SPDX-License-Identifier: MIT
// SwiGLU on the GPU: y = silu(a) * b per row by the contract's float32 recipe (DESIGN.md
// "SwiGLU"; spec ort_ops/ops/swiglu.py), launcher on raw device pointers.
//   x   float32 or float16 [rows, 2n] (x_is_half selects): a = x[r, 0:n), b = x[r, n:2n)
//   y   same dtype [rows, n]
// Device pointers only and no host synchronization: safe inside a CUDA graph capture.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ort_ops::swiglu_cuda {

cudaError_t launch_swiglu(const void* x, bool x_is_half, void* y, int64_t rows, int64_t n,
                          cudaStream_t stream);

}  // namespace ort_ops::swiglu_cuda

// Plain C entry for tests (ctypes, torch tensors); returns a cudaError_t value.
extern "C" int ort_ops_swiglu_cuda(const void* x, int x_is_half, void* y, int64_t rows, int64_t n,
                                   void* stream);
