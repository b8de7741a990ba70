// SPDX-License-Identifier: MIT
// DynamicQuant on the GPU: per-row symmetric INT8 quantization of x * smooth_scale by the
// contract's rule (DESIGN.md; spec ort_ops/ops/dynamic_quant.py), launcher on raw pointers.
//   x      float32 or float16 [rows, K] (x_is_half selects), smooth float32 [K] or nullptr
//   y      int8 [rows, K], scale float32 [rows]
//   err    one int the device can write (the op's mapped status word, cuda/device_status.h):
//          bit 1 ORed in when a value (or product) is not finite; the outputs of such a row are
//          then meaningless. Never cleared here (the C entry below zeroes it first).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ort_ops::dynamic_quant_cuda {

constexpr int kErrNonFinite = 1;

cudaError_t launch_dynamic_quant(const void* x, bool x_is_half, const float* smooth, int8_t* y,
                                 float* scale, int* err, int64_t rows, int64_t k,
                                 cudaStream_t stream);

}  // namespace ort_ops::dynamic_quant_cuda

// Plain C entry for tests (ctypes, torch tensors); returns a cudaError_t value.
extern "C" int ort_ops_dynamic_quant_cuda(const void* x, int x_is_half, const float* smooth,
                                          int8_t* y, float* scale, int* err, int64_t rows,
                                          int64_t k, void* stream);
