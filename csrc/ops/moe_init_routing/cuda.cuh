// SPDX-License-Identifier: MIT
// MoeInitRouting on the GPU (spec: ort_ops/ops/moe_init_routing.py), raw pointers:
//   x [M, H] float32, float16 or int8 (elem_bytes 4, 2 or 1), expert_ids int32 [M, K],
//   num_experts E, x_scale float32 [M] or nullptr (int8 x's row scales)
//   -> sorted_x [M*K, H] (dtype of x), sorted_to_flat int32 [M*K], group_list int64 [E],
//   sorted_x_scale float32 [M*K] (x_scale of each sorted row; nullptr exactly when x_scale is);
//   workspace: moe_init_workspace_bytes(M*K, E) bytes.
// Stable sort of the flat (token, slot) pairs by expert: a radix sort (stable by construction)
// of the expert ids with the flat indices as values; group_list[e] = number of ids <= e.
// *err (an int the device can write: the op's mapped status word, cuda/device_status.h; never
// cleared here) gets bit 1 ORed in for an id outside [0, E) (clamped for the sort, so nothing
// runs out of bounds). The C entry below uses the workspace's first int instead, zeroed first.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ort_ops::moe_init_cuda {

constexpr int kErrBadExpert = 1;

size_t moe_init_workspace_bytes(int64_t total, int64_t num_experts);
cudaError_t launch_moe_init(const void* x, int elem_bytes, const int32_t* expert_ids,
                            void* sorted_x, int32_t* sorted_to_flat, int64_t* group_list,
                            void* workspace, int* err, int64_t m, int64_t k, int64_t h,
                            int64_t num_experts, cudaStream_t stream, const float* x_scale = nullptr,
                            float* sorted_x_scale = nullptr);

}  // namespace ort_ops::moe_init_cuda

extern "C" size_t ort_ops_moe_init_cuda_workspace_bytes(int64_t total, int64_t num_experts);
extern "C" int ort_ops_moe_init_cuda(const void* x, int elem_bytes, const int32_t* expert_ids,
                                     void* sorted_x, int32_t* sorted_to_flat, int64_t* group_list,
                                     void* workspace, int64_t m, int64_t k, int64_t h,
                                     int64_t num_experts, void* stream);
