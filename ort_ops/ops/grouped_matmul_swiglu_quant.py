# SPDX-License-Identifier: MIT
"""GroupedMatmulSwigluQuant: grouped INT8 GEMM, dequantize, SwiGLU, per-row INT8 quantization.

The fused MoE gate/up projection of seed 004 (Ascend's op) with DESIGN.md's deviations.
Alphabet: M rows, K reduction dim, N = 2 * I output columns before SwiGLU, E experts.

Inputs:
    x            int8 [M, K]      rows sorted by expert (MoeInitRouting + DynamicQuant)
    weight       int8 [E, K, N]   columns [0, N/2) feed Swish (A), [N/2, N) the gate (G);
                 [E, N, K] with weight_layout "ENK" (weight[e, n, k] = W_e[k, n]);
                 [E, ceil(N/16), K/4, 16, 4] with weight_layout "EN16K4"
                 (weight[e, n // 16, k // 4, n % 16, k % 4] = W_e[k, n], zeros for n >= N)
    weight_scale float32/float16 [E, N]   per output channel
    x_scale      float32/float16 [M]      per row
    group_list   int64 [E]        type 0: cumulative end rows; type 1: per-expert counts
    bias         float32 [E, N]   optional; added to C after the two scale multiplies
Outputs:
    y        int8 [M, N/2]    S quantized per row by the contract's rule
    y_scale  float32 [M]
    y_offset float32 [M]      zeros (symmetric quantization)
Attributes: group_list_type (0 default, 1); weight_layout ("EKN" default: weight [E, K, N], the
contract's layout; "ENK": weight [E, N, K], each expert's matrix transposed, K-major; "EN16K4":
weight [E, ceil(N/16), K/4, 16, 4], K a multiple of 4: per tile of 16 columns, the columns' 4
consecutive k values together, all of K in order, so every 1 KB run is one AMX B tile (16 k quads
of 16 columns); CPU only, ``pack_en16k4``). The layout changes where W_e[k, n] is stored, never the
result. It is a speed choice per device: the CPU kernels read "EKN", and with AMX "EN16K4" without
packing it per Run (benchmarks/RESULTS_cpu.md; without AMX each used expert is unpacked to [K, N]
per Run); "ENK" costs them a transpose of each used expert per Run; "EN16K4" fails on the CUDA EP;
on the CUDA EP "ENK" is the Hopper wgmma kernel's operand (faster than the mma.sync kernel on "EKN"
for prefill, see benchmarks/NOTES_moe_cuda.md); other GPUs run "ENK" on the mma.sync kernel's
K-major path. activation ("swiglu" default; "swiglu_oai": gpt-oss's clamped SwiGLU) with
float attributes alpha (default 1.702) and limit (default 7.0), used by "swiglu_oai" only.

Exact float32 recipe (the spec every kernel matches bit for bit; see ``ort_ops.ops._moe``):

    acc = x[m] . W_e[:, n]                               int32
    C   = (float32(acc) * x_scale[m]) * weight_scale[e, n]
    C   = C + bias[e, n]                                 only when the bias input is given
    A, G = C[:, :N/2], C[:, N/2:]
    S   = (A / (1 + exp_f32(-A))) * G                    "swiglu"; exp_f32: _moe's Cephes polynomial
    a   = min(A, limit); g = min(max(G, -limit), limit)  "swiglu_oai":
    S   = (g + 1) * (a / (1 + exp_f32(-(alpha * a))))
    y, y_scale = quantize_rows(S)                        amax, inv = 127 / amax, rint(S * inv)

Rows at or past the last group end get y = 0, y_scale = 0. Errors (ValueError here, a failed
Run in the kernels): odd N, K > 131071 (int32 accumulation bound), mismatched shapes, a
decreasing group_list, one ending past M, a bias that is not float32 [E, N] or holds NaN / Inf,
an unknown activation, a non-finite alpha or limit, limit <= 0, and a non-finite C (after the
bias) or S in a row (no INT8 code represents it). Ascend's limits N <= 10240 and K <= 65536 do not apply.
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops._moe import (  # noqa: F401 (re-exported)
    ACTIVATIONS,
    EKN,
    OAI_ALPHA,
    OAI_LIMIT,
    WEIGHT_LAYOUTS,
    activation_f32,
    check_activation,
    grouped_dequant_matmul,
    pack_en16k4,
    swiglu_f32,
    swiglu_oai_f32,
)
from ort_ops.ops._moe import weight_ekn as _weight_ekn
from ort_ops.ops._quant import quantize_rows
from ort_ops.ops._schema import FLOAT_TYPES, Arg, Attr, OpSchema

OP = "GroupedMatmulSwigluQuant"

SCHEMA = OpSchema(
    name=OP,
    inputs=(
        Arg("x", ("int8",), doc="[M, K] codes, rows grouped by expert"),
        Arg("weight", ("int8",), doc="[E, K, N] per-expert weights (N = 2 * intermediate)"),
        Arg("weight_scale", FLOAT_TYPES, doc="[E, N] per output channel"),
        Arg("x_scale", FLOAT_TYPES, doc="[M] per row"),
        Arg("group_list", ("int64",), doc="[E] cumulative ends (type 0) or counts (type 1)"),
        Arg("bias", ("float32",), optional=True, doc="[E, N] added to C after the scales"),
    ),
    outputs=(
        Arg("y", ("int8",), doc="[M, N/2] SwiGLU output codes"),
        Arg("y_scale", ("float32",), doc="[M] per-row scale"),
        Arg("y_offset", ("float32",), doc="[M] zeros (symmetric)"),
    ),
    attrs=(Attr("group_list_type", "int", 0, doc="0: cumulative end rows, 1: per-expert counts"),
           Attr("weight_layout", "string", EKN, doc='"EKN": weight [E, K, N]; "ENK": [E, N, K] (K-major); '
                '"EN16K4": [E, ceil(N/16), K/4, 16, 4] (AMX B tiles; CPU only)'),
           Attr("activation", "string", "swiglu", doc='"swiglu": (A / (1 + exp(-A))) * G; "swiglu_oai": '
                "gpt-oss's clamped SwiGLU"),
           Attr("alpha", "float", OAI_ALPHA, doc='"swiglu_oai": the sigmoid\'s slope'),
           Attr("limit", "float", OAI_LIMIT, doc='"swiglu_oai": A clamped to <= limit, G to [-limit, limit]')),
    doc=__doc__,
)


def weight_ekn(x, weight, weight_layout: str = EKN, weight_scale=None):
    """``weight`` in the contract's [E, K, N] order (``ort_ops.ops._moe.weight_ekn``; N even for "ENK")."""
    return _weight_ekn(OP, x, weight, weight_layout, weight_scale, even_n=True)


def swiglu_rows(x, weight, weight_scale, x_scale, group_list, group_list_type: int = 0,
                weight_layout: str = EKN, bias=None, activation: str = "swiglu", alpha: float = OAI_ALPHA,
                limit: float = OAI_LIMIT):
    """The float32 SwiGLU output S [M, N/2] before quantization and the valid-row mask [M]."""
    check_activation(OP, activation, alpha, limit)
    weight = weight_ekn(x, weight, weight_layout, weight_scale)
    n = np.asarray(weight).shape[-1] if np.asarray(weight).ndim == 3 else 0
    if n % 2:
        raise ValueError(f"{OP}: input 'weight' must have an even N (last dim), got {n}")
    with np.errstate(over="ignore"):
        c, valid = grouped_dequant_matmul(OP, x, weight, weight_scale, x_scale, group_list, group_list_type, bias)
    bad = ~np.all(np.isfinite(c), axis=1) & valid
    if bad.any():
        r = int(np.argmax(bad))
        raise ValueError(f"{OP}: row {r}: the dequantized product is not finite; check inputs 'x_scale' and 'weight_scale'")
    h = n // 2
    s = np.zeros((c.shape[0], h), np.float32)
    if valid.any():
        with np.errstate(over="ignore"):
            s[valid] = activation_f32(c[valid, :h], c[valid, h:], activation, alpha, limit)
    bad = ~np.all(np.isfinite(s), axis=1) & valid
    if bad.any():
        r = int(np.argmax(bad))
        raise ValueError(f"{OP}: row {r}: the SwiGLU output overflows float32; check inputs 'x_scale' and 'weight_scale'")
    return s, valid


def reference(x, weight, weight_scale, x_scale, group_list, bias=None, group_list_type: int = 0,
              weight_layout: str = EKN, activation: str = "swiglu", alpha: float = OAI_ALPHA,
              limit: float = OAI_LIMIT):
    """numpy GroupedMatmulSwigluQuant (module docstring for shapes and the float32 recipe).

    Returns:
        (y int8 [M, N/2], y_scale float32 [M], y_offset float32 [M]).
    """
    s, valid = swiglu_rows(x, weight, weight_scale, x_scale, group_list, group_list_type, weight_layout,
                           bias, activation, alpha, limit)
    y, y_scale = quantize_rows(s, axis=-1)
    y[~valid] = 0
    y_scale[~valid] = 0
    return y, y_scale.astype(np.float32), np.zeros_like(y_scale, dtype=np.float32)
