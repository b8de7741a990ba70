// SPDX-License-Identifier: MIT
// MoeFinalizeRouting CUDA kernels: (1) invert sorted_to_flat with atomicCAS (a repeat or an
// out-of-range index sets the error word), (2) one thread per output element gathers its K
// expert rows in slot order. See cuda.cuh.
#include "ops/moe_finalize_routing/cuda.cuh"

#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/export.h"

namespace ort_ops::moe_finalize_cuda {
namespace {

__device__ __forceinline__ float ld(const void* p, bool half, int64_t i) {
  return half ? __half2float(static_cast<const __half*>(p)[i]) : static_cast<const float*>(p)[i];
}

__global__ void invert_kernel(const int32_t* s2f, int32_t* inv, int* err, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t f = s2f[i];
    if (f < 0 || f >= total || atomicCAS(inv + f, -1, static_cast<int32_t>(i)) != -1)
      atomicOr(err, kErrNotPermutation);
  }
}

__global__ void gather_kernel(const void* eo, bool eo_half, const int32_t* inv, const void* tw,
                              bool tw_half, const void* res, bool res_half, float* out, int* err,
                              int64_t m, int64_t k, int64_t h) {
  const int64_t n = m * h;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / h, col = idx % h;
    float acc = res ? ld(res, res_half, idx) : 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = inv[row * k + j];
      if (r < 0) {  // a slot no sorted row maps to: already reported by invert_kernel
        atomicOr(err, kErrNotPermutation);
        continue;
      }
      const float prod = __fmul_rn(ld(tw, tw_half, row * k + j), ld(eo, eo_half, r * h + col));
      acc = __fadd_rn(acc, prod);
    }
    out[idx] = acc;
  }
}

int blocks_for(int64_t n) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 8192))); }

// The same sums for rows whose H is a multiple of 4: a CTA per output row (grid-stride), each
// thread 4 consecutive columns with one 16-byte (float32) or 8-byte (float16) load per row it
// reads, and the row's K (sorted row, weight) pairs loaded once per thread and reused for all
// its columns. Each column's arithmetic is gather_kernel's, in the same order (bit-exact).
template <typename T>
__device__ __forceinline__ float4 load4(const void* p, int64_t i) {  // elements i .. i+3
  if constexpr (sizeof(T) == 4) {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const __half*>(p) + i);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
  }
}

template <typename EO, typename RES>
__global__ void gather_rows4_kernel(const void* eo, const int32_t* inv, const void* tw, bool tw_half,
                                    const void* res, float* out, int* err, int64_t m, int64_t k, int64_t h) {
  for (int64_t row = blockIdx.x; row < m; row += gridDim.x) {
    for (int64_t c = 4 * static_cast<int64_t>(threadIdx.x); c < h; c += 4 * static_cast<int64_t>(blockDim.x)) {
      float4 acc = res ? load4<RES>(res, row * h + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t r = inv[row * k + j];
        if (r < 0) {  // a slot no sorted row maps to: already reported by invert_kernel
          atomicOr(err, kErrNotPermutation);
          continue;
        }
        const float w = ld(tw, tw_half, row * k + j);
        const float4 v = load4<EO>(eo, static_cast<int64_t>(r) * h + c);
        acc.x = __fadd_rn(acc.x, __fmul_rn(w, v.x));
        acc.y = __fadd_rn(acc.y, __fmul_rn(w, v.y));
        acc.z = __fadd_rn(acc.z, __fmul_rn(w, v.z));
        acc.w = __fadd_rn(acc.w, __fmul_rn(w, v.w));
      }
      *reinterpret_cast<float4*>(out + row * h + c) = acc;
    }
  }
}

template <typename EO>
cudaError_t launch_rows4(const void* eo, const int32_t* inv, const void* tw, bool tw_half, const void* res,
                         bool res_half, float* out, int* err, int64_t m, int64_t k, int64_t h, cudaStream_t stream) {
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (h / 4 + 31) / 32 * 32)));
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(m, 65535));
  if (res != nullptr && res_half)
    gather_rows4_kernel<EO, __half><<<grid, threads, 0, stream>>>(eo, inv, tw, tw_half, res, out, err, m, k, h);
  else
    gather_rows4_kernel<EO, float><<<grid, threads, 0, stream>>>(eo, inv, tw, tw_half, res, out, err, m, k, h);
  return cudaGetLastError();
}

}  // namespace

size_t moe_finalize_workspace_bytes(int64_t total) { return 16 + 4 * static_cast<size_t>(total); }

cudaError_t launch_moe_finalize(const void* expert_out, bool eo_half, const int32_t* sorted_to_flat,
                                const void* topk_weights, bool tw_half, const void* residual,
                                bool res_half, float* out, void* workspace, int* err, int64_t m,
                                int64_t k, int64_t h, cudaStream_t stream) {
  if (m < 0 || k < 0 || h < 0 || m * k > INT32_MAX) return cudaErrorInvalidValue;
  int32_t* inv = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + 16);
  const int64_t total = m * k;
  cudaError_t e = cudaSuccess;
  if (total > 0) e = cudaMemsetAsync(inv, 0xff, 4 * total, stream);  // -1
  if (e != cudaSuccess) return e;
  if (total > 0) {
    invert_kernel<<<blocks_for(total), 256, 0, stream>>>(sorted_to_flat, inv, err, total);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  auto aligned = [](const void* ptr, uintptr_t a) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % a == 0; };
  const bool vec4 = h % 4 == 0 && aligned(expert_out, eo_half ? 8 : 16) && aligned(out, 16) &&
                    aligned(residual, res_half ? 8 : 16);
  if (m * h > 0 && vec4) {
    e = eo_half ? launch_rows4<__half>(expert_out, inv, topk_weights, tw_half, residual, res_half, out, err, m, k, h,
                                       stream)
                : launch_rows4<float>(expert_out, inv, topk_weights, tw_half, residual, res_half, out, err, m, k, h,
                                      stream);
  } else if (m * h > 0) {
    gather_kernel<<<blocks_for(m * h), 256, 0, stream>>>(expert_out, eo_half, inv, topk_weights,
                                                          tw_half, residual, res_half, out, err,
                                                          m, k, h);
    e = cudaGetLastError();
  }
  return e;
}

}  // namespace ort_ops::moe_finalize_cuda

ORT_OPS_CUDA_EXPORT size_t ort_ops_moe_finalize_cuda_workspace_bytes(int64_t total) {
  return ort_ops::moe_finalize_cuda::moe_finalize_workspace_bytes(total);
}

ORT_OPS_CUDA_EXPORT int ort_ops_moe_finalize_cuda(const void* expert_out, int eo_half,
                                                  const int32_t* sorted_to_flat,
                                                  const void* topk_weights, int tw_half,
                                                  const void* residual, int res_half, float* out,
                                                  void* workspace, int64_t m, int64_t k, int64_t h,
                                                  void* stream) {
  // The error word is the workspace's first int here (zeroed first), read back by the caller.
  int* err = static_cast<int*>(workspace);
  const cudaError_t z = cudaMemsetAsync(err, 0, sizeof(int), static_cast<cudaStream_t>(stream));
  if (z != cudaSuccess) return static_cast<int>(z);
  return static_cast<int>(ort_ops::moe_finalize_cuda::launch_moe_finalize(
      expert_out, eo_half != 0, sorted_to_flat, topk_weights, tw_half != 0, residual,
      res_half != 0, out, workspace, err, m, k, h, static_cast<cudaStream_t>(stream)));
}
