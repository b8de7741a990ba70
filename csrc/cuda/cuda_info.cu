// SPDX-License-Identifier: MIT
// The toolchain proof: one mma.sync m16n8k32 u8 x s8 kernel (sm_80+), built for every arch in
// ORT_OPS_CUDA_ARCHS, and the build facts reported by ort_ops_build_info().
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/cuda_info.h"
#include "cuda/ptx.cuh"

#include "cuda/export.h"

namespace {

__global__ void mma_u8s8_probe(int* out) {
  // Every A byte 255 (u8), every B byte 127 (s8): D = 32 * 255 * 127 in each element.
  const uint32_t a = 0xFFFFFFFFu;
  const uint32_t b = 0x7F7F7F7Fu;
  int d[4] = {0, 0, 0, 0};
  ort_ops::ptx::mma_i8<true>(d, a, a, a, a, b, b);
  if (threadIdx.x == 0) *out = d[0];
}

}  // namespace

namespace ort_ops {
std::string cuda_runtime_summary() {
  return "cudart " + std::to_string(CUDART_VERSION / 1000) + "." +
         std::to_string((CUDART_VERSION % 1000) / 10);
}
}  // namespace ort_ops

ORT_OPS_CUDA_EXPORT int ort_ops_cuda_selftest(int device, int* out) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  int* d_out = nullptr;
  if ((err = cudaMalloc(&d_out, sizeof(int))) != cudaSuccess) return static_cast<int>(err);
  mma_u8s8_probe<<<1, 32>>>(d_out);
  err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpy(out, d_out, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(d_out);
  return static_cast<int>(err);
}
