# SPDX-License-Identifier: MIT
"""GroupedMatmulDequant: grouped INT8 GEMM with float32 dequantized output (the MoE down projection).

Alphabet: M rows, K reduction dim (the intermediate size), N output columns (hidden), E experts.

Inputs:
    x            int8 [M, K]       rows grouped by expert (GroupedMatmulSwigluQuant's y)
    weight       int8 [E, K, N]; [E, N, K] with weight_layout "ENK" (weight[e, n, k] = W_e[k, n]);
                 [E, ceil(N/16), K/4, 16, 4] with weight_layout "EN16K4"
                 (weight[e, n // 16, k // 4, n % 16, k % 4] = W_e[k, n], zeros for n >= N)
    weight_scale float32/float16 [E, N]
    x_scale      float32/float16 [M]
    group_list   int64 [E]         type 0: cumulative end rows; type 1: per-expert counts
    bias         float32 [E, N]    optional; added after the two scale multiplies
Output:
    y float32 [M, N]
Attributes: group_list_type (0 default, 1); weight_layout ("EKN" default, "ENK", "EN16K4"), as
GroupedMatmulSwigluQuant's (same checks and messages, ``ort_ops.ops._moe.weight_ekn``; N need not
be even). The layout changes where W_e[k, n] is stored, never the result. On the CPU with AMX,
"EN16K4" is read by the AMX panels as it is ("EKN" is packed into tile order on every Run);
without AMX each used expert is unpacked to [K, N] per Run; "ENK" is transposed per Run (CPU) and
refused on the CUDA EP, as is "EN16K4".

Exact float32 recipe (``ort_ops.ops._moe``): y[m, n] = (float32(acc) * x_scale[m]) * weight_scale[e, n]
with acc the int32 dot product, two float32 multiplies in this order, then, with the optional
bias, one float32 add: y[m, n] = y[m, n] + bias[e, n]; kernels match it bit for bit. Rows at or
past the last group end are zeros (no bias). Float overflow gives Inf as float math does. A bias
that is not float32 [E, N] or holds NaN / Inf is refused.
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops._moe import EKN, grouped_dequant_matmul, weight_ekn
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
        Arg("bias", ("float32",), optional=True, doc="[E, N] added after the scales"),
    ),
    outputs=(Arg("y", ("float32",), doc="[M, N]"),),
    attrs=(Attr("group_list_type", "int", 0, doc="0: cumulative end rows, 1: per-expert counts"),
           Attr("weight_layout", "string", EKN, doc='"EKN": weight [E, K, N]; "ENK": [E, N, K] (CPU only); '
                '"EN16K4": [E, ceil(N/16), K/4, 16, 4] (AMX B tiles; CPU only)')),
    doc=__doc__,
)


def reference(x, weight, weight_scale, x_scale, group_list, bias=None, group_list_type: int = 0,
              weight_layout: str = EKN) -> np.ndarray:
    """numpy GroupedMatmulDequant; returns y float32 [M, N] (zeros past the last group end)."""
    weight = weight_ekn(OP, x, weight, weight_layout, weight_scale)
    with np.errstate(over="ignore"):
        c, _ = grouped_dequant_matmul(OP, x, weight, weight_scale, x_scale, group_list, group_list_type, bias)
    return c
