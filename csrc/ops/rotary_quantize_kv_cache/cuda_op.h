// SPDX-License-Identifier: MIT
#pragma once

#include "common/op_base.h"

namespace ort_ops {
// RotaryQuantizeKVCache for ORT's CUDA execution provider (built with ORT_OPS_USE_CUDA).
const CustomOp& rotary_quantize_kv_cache_cuda_op();
}  // namespace ort_ops
