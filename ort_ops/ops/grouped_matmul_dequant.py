# SPDX-License-Identifier: MIT
"""GroupedMatmulDequant: grouped INT8 GEMM with float32 dequantized output (the MoE down projection).

Alphabet: M rows, K reduction dim (the intermediate size), N output columns (hidden), E experts.

Inputs:
    x            int8 [M, K]       rows grouped by expert (GroupedMatmulSwigluQuant's y)
    weight       int8 [E, K, N]
    weight_scale float32/float16 [E, N]
    x_scale      float32/float16 [M]
    group_list   int64 [E]         type 0: cumulative end rows; type 1: per-expert counts
Output:
    y float32 [M, N]
Attribute: group_list_type (0 default, 1).

Exact float32 recipe (``ort_ops.ops._moe``): y[m, n] = (float32(acc) * x_scale[m]) * weight_scale[e, n]
with acc the int32 dot product, two float32 multiplies in this order; kernels match it bit for
bit. Rows at or past the last group end are zeros. Float overflow gives Inf as float math does.
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops._moe import grouped_dequant_matmul
from ort_ops.ops._schema import FLOAT_TYPES, Arg, Attr, OpSchema

OP = "GroupedMatmulDequant"

SCHEMA = OpSchema(
    name=OP,
    inputs=(
        Arg("x", ("int8",), doc="[M, K] codes, rows grouped by expert"),
        Arg("weight", ("int8",), doc="[E, K, N] per-expert weights"),
        Arg("weight_scale", FLOAT_TYPES, doc="[E, N] per output channel"),
        Arg("x_scale", FLOAT_TYPES, doc="[M] per row"),
        Arg("group_list", ("int64",), doc="[E] cumulative ends (type 0) or counts (type 1)"),
    ),
    outputs=(Arg("y", ("float32",), doc="[M, N]"),),
    attrs=(Attr("group_list_type", "int", 0, doc="0: cumulative end rows, 1: per-expert counts"),),
    doc=__doc__,
)


def reference(x, weight, weight_scale, x_scale, group_list, group_list_type: int = 0) -> np.ndarray:
    """numpy GroupedMatmulDequant; returns y float32 [M, N] (zeros past the last group end)."""
    with np.errstate(over="ignore"):
        c, _ = grouped_dequant_matmul(OP, x, weight, weight_scale, x_scale, group_list, group_list_type)
    return c
