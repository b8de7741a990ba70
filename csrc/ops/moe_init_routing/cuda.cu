// SPDX-License-Identifier: MIT
// MoeInitRouting CUDA: keys = expert ids (validated, clamped), values = flat indices, one
// cub radix sort over the bits E needs (stable), group ends by binary search in the sorted
// keys, then a row gather of x. See cuda.cuh. The workspace holds the error word, the key
// and value arrays (in and out) and cub's temporary storage.
#include "ops/moe_init_routing/cuda.cuh"

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>

#include "cuda/export.h"

namespace ort_ops::moe_init_cuda {
namespace {

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

int key_bits(int64_t e) {
  int b = 1;
  while ((int64_t{1} << b) < e) ++b;
  return b;
}

size_t cub_temp_bytes(int64_t total, int64_t e) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(total), 0,
                                  key_bits(e));
  return bytes;
}

__global__ void keys_kernel(const int32_t* ids, uint32_t* keys, int32_t* vals, int* err,
                            int64_t total, int64_t e) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t id = ids[i];
    if (id < 0 || id >= e) {
      atomicOr(err, kErrBadExpert);
      id = id < 0 ? 0 : static_cast<int32_t>(e - 1);
    }
    keys[i] = static_cast<uint32_t>(id);
    vals[i] = static_cast<int32_t>(i);
  }
}

__global__ void ends_kernel(const uint32_t* sorted_keys, int64_t total, int64_t* group_list,
                            int64_t e) {
  for (int64_t x = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; x < e;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t lo = 0, hi = total;  // first index with key > x
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (sorted_keys[mid] <= static_cast<uint64_t>(x)) lo = mid + 1; else hi = mid;
    }
    group_list[x] = lo;
  }
}

// One thread per 4-byte word (or 2- or 1-byte element when the row's bytes do not divide).
template <typename W>
__global__ void gather_kernel(const W* x, const int32_t* order, W* out, int64_t total, int64_t k,
                              int64_t words) {
  const int64_t n = total * words;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / words, w = idx % words;
    out[idx] = x[(order[i] / k) * words + w];
  }
}

// Rows of a multiple of 16 bytes: a CTA per sorted row (grid-stride), 16-byte copies.
__global__ void gather_rows16_kernel(const uint4* x, const int32_t* order, uint4* out, int64_t total, int64_t k,
                                     int64_t chunks) {
  for (int64_t i = blockIdx.x; i < total; i += gridDim.x) {
    const uint4* src = x + (order[i] / k) * chunks;
    uint4* dst = out + i * chunks;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = src[c];
  }
}

// sorted_x_scale[i] = x_scale[order[i] / k]: the row scales of int8 x follow their rows.
__global__ void gather_scale_kernel(const float* x_scale, const int32_t* order, float* out, int64_t total,
                                    int64_t k) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = x_scale[order[i] / k];
}

int blocks_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 16384)));
}

}  // namespace

size_t moe_init_workspace_bytes(int64_t total, int64_t e) {
  return 256 + 3 * align256(4 * static_cast<size_t>(total)) + align256(cub_temp_bytes(total, e));
}

cudaError_t launch_moe_init(const void* x, int elem_bytes, const int32_t* expert_ids,
                            void* sorted_x, int32_t* sorted_to_flat, int64_t* group_list,
                            void* workspace, int* err, int64_t m, int64_t k, int64_t h, int64_t e,
                            cudaStream_t stream, const float* x_scale, float* sorted_x_scale) {
  if (m < 0 || k < 0 || h < 0 || e < 1 || e > (int64_t{1} << 31) || m * k > INT32_MAX ||
      (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) || (x_scale == nullptr) != (sorted_x_scale == nullptr))
    return cudaErrorInvalidValue;
  const int64_t total = m * k;
  char* ws = static_cast<char*>(workspace);
  const size_t arr = align256(4 * static_cast<size_t>(total));
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(ws + 256);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(ws + 256 + arr);
  int32_t* vals_in = reinterpret_cast<int32_t*>(ws + 256 + 2 * arr);
  void* temp = ws + 256 + 3 * arr;
  size_t temp_bytes = cub_temp_bytes(total, e);
  cudaError_t err_c = cudaSuccess;
  if (total > 0) {
    keys_kernel<<<blocks_for(total), 256, 0, stream>>>(expert_ids, keys_in, vals_in, err, total, e);
    if ((err_c = cudaGetLastError()) != cudaSuccess) return err_c;
    err_c = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in,
                                            sorted_to_flat, static_cast<int>(total), 0,
                                            key_bits(e), stream);
    if (err_c != cudaSuccess) return err_c;
  }
  ends_kernel<<<blocks_for(e), 256, 0, stream>>>(keys_out, total, group_list, e);
  if ((err_c = cudaGetLastError()) != cudaSuccess) return err_c;
  const int64_t row_bytes = h * elem_bytes;
  const bool aligned16 = reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(sorted_x) % 16 == 0;
  if (total > 0 && row_bytes > 0 && row_bytes % 16 == 0 && aligned16) {
    const int64_t chunks = row_bytes / 16;
    const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (chunks + 31) / 32 * 32)));
    gather_rows16_kernel<<<static_cast<unsigned>(std::min<int64_t>(total, 65535)), threads, 0, stream>>>(
        static_cast<const uint4*>(x), sorted_to_flat, static_cast<uint4*>(sorted_x), total, k, chunks);
    err_c = cudaGetLastError();
  } else if (total > 0 && row_bytes > 0) {
    if (row_bytes % 4 == 0)
      gather_kernel<<<blocks_for(total * (row_bytes / 4)), 256, 0, stream>>>(
          static_cast<const uint32_t*>(x), sorted_to_flat, static_cast<uint32_t*>(sorted_x), total,
          k, row_bytes / 4);
    else if (row_bytes % 2 == 0)
      gather_kernel<<<blocks_for(total * (row_bytes / 2)), 256, 0, stream>>>(
          static_cast<const uint16_t*>(x), sorted_to_flat, static_cast<uint16_t*>(sorted_x), total,
          k, row_bytes / 2);
    else
      gather_kernel<<<blocks_for(total * row_bytes), 256, 0, stream>>>(
          static_cast<const uint8_t*>(x), sorted_to_flat, static_cast<uint8_t*>(sorted_x), total, k,
          row_bytes);
    err_c = cudaGetLastError();
  }
  if (err_c == cudaSuccess && x_scale != nullptr && total > 0) {
    gather_scale_kernel<<<blocks_for(total), 256, 0, stream>>>(x_scale, sorted_to_flat, sorted_x_scale, total, k);
    err_c = cudaGetLastError();
  }
  return err_c;
}

}  // namespace ort_ops::moe_init_cuda

ORT_OPS_CUDA_EXPORT size_t ort_ops_moe_init_cuda_workspace_bytes(int64_t total, int64_t e) {
  return ort_ops::moe_init_cuda::moe_init_workspace_bytes(total, e);
}

ORT_OPS_CUDA_EXPORT int ort_ops_moe_init_cuda(const void* x, int elem_bytes,
                                              const int32_t* expert_ids, void* sorted_x,
                                              int32_t* sorted_to_flat, int64_t* group_list,
                                              void* workspace, int64_t m, int64_t k, int64_t h,
                                              int64_t e, void* stream) {
  // The error word is the workspace's first int here (zeroed first), read back by the caller.
  int* err = static_cast<int*>(workspace);
  const cudaError_t z = cudaMemsetAsync(err, 0, sizeof(int), static_cast<cudaStream_t>(stream));
  if (z != cudaSuccess) return static_cast<int>(z);
  return static_cast<int>(ort_ops::moe_init_cuda::launch_moe_init(
      x, elem_bytes, expert_ids, sorted_x, sorted_to_flat, group_list, workspace, err, m, k, h, e,
      static_cast<cudaStream_t>(stream)));
}
