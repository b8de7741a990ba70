// SPDX-License-Identifier: MIT
#pragma once

#include "common/op_base.h"

namespace ort_ops {
// MoeFinalizeRouting for ORT's CUDA execution provider (built with ORT_OPS_USE_CUDA).
const CustomOp& moe_finalize_routing_cuda_op();
}  // namespace ort_ops
