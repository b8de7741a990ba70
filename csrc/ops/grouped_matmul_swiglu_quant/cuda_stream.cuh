// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant / GroupedMatmulDequant for decode (a few rows an expert): the
// weight-stream kernel pair of cuda_stream.cu, for weight_layout 0 ([E, K, N]) and 2 ([E, N, K],
// GroupedMatmulSwigluQuant only, as launch_gmsq). Selected by launch_gmsq / launch_gmd for
// config kGmsqStream, and by auto at few rows an expert on average. Same
// inputs, outputs, error word and bits as the tiled kernel (cuda.cuh); the workspace is
// gmsq_workspace_bytes(m, n, e), which includes this kernel's int32 partial sums when
// gmsq_stream_workspace_bytes(m, n) is non-zero (the shape is eligible); the same bytes serve
// both layouts.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/grouped_matmul_swiglu_quant/cuda.cuh"

namespace ort_ops::gmsq_cuda {

// Bytes of the stream kernels' workspace (error word, int32 sums [M, N], one partial tile per
// owner: 16 x 256 per CTA of the [E, K, N] stream, 16 x 16 per warp of the K-major one) for an
// M x N problem on the current device; 0 when the shape is not eligible (M * N <= 2^24,
// N/2 <= 24576) or the device cannot be queried.
size_t gmsq_stream_workspace_bytes(int64_t m, int64_t n);

// Enqueues the op (dequant: GroupedMatmulDequant) as two kernels, no memset: the weight stream
// and the epilogue, the latter a programmatic dependent launch on sm_90. cudaErrorInvalidValue
// when gmsq_stream_workspace_bytes(p.m, p.n) is 0. p.m, p.n, p.e > 0 (launch_gmsq handles 0).
cudaError_t launch_gmsq_stream(const GmsqParams& p, bool dequant, cudaStream_t stream);

}  // namespace ort_ops::gmsq_cuda
