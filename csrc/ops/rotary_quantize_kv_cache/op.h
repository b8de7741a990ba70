// SPDX-License-Identifier: MIT
#pragma once

#include "common/op_base.h"

namespace ort_ops {
const CustomOp& rotary_quantize_kv_cache_cpu_op();
}  // namespace ort_ops
