// SPDX-License-Identifier: MIT
#pragma once

#include "common/op_base.h"

namespace ort_ops {
const CustomOp& paged_attention_int8_cuda_op();
}  // namespace ort_ops
