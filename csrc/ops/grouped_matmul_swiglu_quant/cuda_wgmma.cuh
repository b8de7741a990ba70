// SPDX-License-Identifier: MIT
// GroupedMatmulSwigluQuant on Hopper INT8 tensor cores (wgmma.mma_async m64n256k32 s8.s8.s32,
// sm_90a only): the launcher prototype. Selected by launch_gmsq when weight_layout == 2 and
// config is kGmsqBm128, or auto with at least 32 rows an expert on average (below that,
// launch_gmsq runs the mma.sync kernel's K-major path, cuda.cu, which also runs on sm_80).
//
// Weight layout 2 (K-major): weight int8 [E, N, K], i.e. the contract's [E, K, N] transposed per
// expert (ort_ops.testing.moe_launchers.pack_weight_kmajor). 8-bit wgmma takes its B operand only
// K-major from shared memory; the kernel's TMA loads apply the 128-byte swizzle itself, so the
// global layout needs no tile packing. Every other input and output is GmsqParams' (cuda.cuh),
// same semantics, same error word, same workspace (gmsq_workspace_bytes).
#pragma once

#include <cuda_runtime.h>

#include "ops/grouped_matmul_swiglu_quant/cuda.cuh"

namespace ort_ops::gmsq_cuda {

// Same requirements as launch_gmsq (cuda.cuh) plus: a compute capability 9.x device
// (cudaErrorNotSupported otherwise), 16-byte aligned x and weight (TMA), E * N < 2^31.
// `config` is ignored here (128-row tiles: the ping-pong kernel's 64 outputs a warpgroup, or
// the cooperative kernel's 128 outputs when N/2 > 64 x SM count). K == 0 (or M, N, E == 0)
// runs the layout-0 launcher (no weight bytes in either layout).
cudaError_t launch_gmsq_wgmma(const GmsqParams& p, cudaStream_t stream);

}  // namespace ort_ops::gmsq_cuda
