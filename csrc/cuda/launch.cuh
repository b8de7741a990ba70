// SPDX-License-Identifier: MIT
// Launching a kernel as a programmatic dependent of the stream's previous kernel (sm_90's
// griddepcontrol), only while a CUDA graph is being captured: on replay the grid becomes resident
// while the previous kernel drains; launched eagerly at small batches the host's launch rate
// decides and the attribute buys nothing, so eager launches stay plain. The kernel must execute
// griddepcontrol.wait before reading anything the previous kernel may have written.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace ort_ops::cuda_util {

// Whether a launch on `stream` now should be a programmatic dependent one.
inline bool dependent_launch_pays(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  int device = 0, major = 0;
  return cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusActive &&
         cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch.
template <typename... KArgs, typename... Args>
cudaError_t launch_dependent(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace ort_ops::cuda_util
