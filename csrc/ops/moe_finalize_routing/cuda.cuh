// SPDX-License-Identifier: MIT
// MoeFinalizeRouting on the GPU (spec: ort_ops/ops/moe_finalize_routing.py), raw pointers:
//   expert_out [M*K, H], topk_weights [M, K], residual [M, H] or nullptr: float32 or float16
//   each (the *_half flags); sorted_to_flat int32 [M*K]; out float32 [M, H];
//   workspace: moe_finalize_workspace_bytes(M*K) bytes (16 bytes, then the inverse permutation).
// out[m] = residual[m] + sum_j w[m, j] * expert_out[inv[m*K + j]], j ascending, each product
// and sum rounded to float32 (no FMA), as the reference. *err (an int the device can write: the
// op's mapped status word, cuda/device_status.h; never cleared here) gets bit 1 ORed in when
// sorted_to_flat is not a permutation of [0, M*K) (the kernel never reads out of bounds). The C
// entry below uses the workspace's first int instead, zeroed first.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ort_ops::moe_finalize_cuda {

constexpr int kErrNotPermutation = 1;

size_t moe_finalize_workspace_bytes(int64_t total);
cudaError_t launch_moe_finalize(const void* expert_out, bool eo_half, const int32_t* sorted_to_flat,
                                const void* topk_weights, bool tw_half, const void* residual,
                                bool res_half, float* out, void* workspace, int* err, int64_t m,
                                int64_t k, int64_t h, cudaStream_t stream);

}  // namespace ort_ops::moe_finalize_cuda

extern "C" size_t ort_ops_moe_finalize_cuda_workspace_bytes(int64_t total);
extern "C" int ort_ops_moe_finalize_cuda(const void* expert_out, int eo_half,
                                         const int32_t* sorted_to_flat, const void* topk_weights,
                                         int tw_half, const void* residual, int res_half,
                                         float* out, void* workspace, int64_t m, int64_t k,
                                         int64_t h, void* stream);
