// SPDX-License-Identifier: MIT
// Host-side facts about the CUDA build (no CUDA headers needed by the includer).
#pragma once

#include <string>

namespace ort_ops {
// "cudart <version>" of the toolkit the library was built with.
std::string cuda_runtime_summary();
}  // namespace ort_ops

// Runs one INT8 tensor-core MMA (m16n8k32 u8 x s8 -> s32, all-255 x all-127) on device
// `device` and writes D[0][0] to *out (1,036,320 when the instruction works). Returns a
// cudaError_t value (0 = success). Proves the toolchain built a working sm_80/sm_90a kernel.
extern "C" int ort_ops_cuda_selftest(int device, int* out);
