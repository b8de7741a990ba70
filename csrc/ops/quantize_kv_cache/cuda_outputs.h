// SPDX-License-Identifier: MIT
// The cache outputs of a CUDA-EP op that writes the paged cache as QuantizeKVCache does (its own
// CUDA op and RotaryQuantizeKVCache's): outputs first_output .. first_output + 3 (key_cache,
// value_cache, key_scale, value_scale) are made and each gets a device-to-device copy of its
// input cache on `stream`, unless it is the input's own buffer (IOBinding in place: then only the
// T new slots are written); the slot check's scratch is allocated when T needs it. No host
// synchronization.
#pragma once

#include <cuda_runtime.h>

#include <optional>

#include "common/op_base.h"
#include "cuda/ort_cuda.h"
#include "ops/quantize_kv_cache/cuda.cuh"
#include "ops/quantize_kv_cache/validate.h"

namespace ort_ops::quantize_kv_cache {

class CudaCacheOutputs {
 public:
  CudaCacheOutputs(const char* op, Ort::KernelContext& ctx, const Caches& in, size_t first_output, const Dims& d,
                   cudaStream_t stream, int* status);

  // The launch's cache params: slot_mapping, the four outputs, the dims, status and workspace
  // (key, value and input_fp16 are the caller's).
  const QuantizeKvCacheParams& params() const { return params_; }

 private:
  QuantizeKvCacheParams params_;
  std::optional<cuda_util::OrtCudaScratch> scratch_;  // only for the check kernel (T > kQkvInlineCheckMax)
};

}  // namespace ort_ops::quantize_kv_cache
