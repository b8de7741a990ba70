// SPDX-License-Identifier: MIT
#pragma once

#include "common/op_base.h"

namespace ort_ops {
const CustomOp& quantize_kv_cache_cuda_op();
}  // namespace ort_ops
