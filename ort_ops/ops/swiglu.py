# SPDX-License-Identifier: MIT
"""SwiGLU: the gated SiLU of a decoder MLP, ``y = silu(a) * b`` for ``x = [a | b]``.

Shapes: x [..., 2I] (rank >= 1; rows are all axes but the last), y [..., I], y of x's dtype.
With a = x[..., :I] and b = x[..., I:], widened to float32, every kernel computes in float32,
without fused multiply-adds, in this order (the "swiglu" recipe of ``ort_ops/ops/_moe.py``):

    e = exp_f32(-a)          _moe's polynomial exp, not libm's expf
    d = 1 + e
    s = a / d                IEEE float32 division (silu(a) = a * sigmoid(a)); NaN for a = -Inf
    y = s * b                then rounded once to x's dtype (float16: round to nearest even)

Non-finite values propagate as IEEE arithmetic takes them through these steps (exp_f32 clamps its
argument to [-87, 88], so it is finite for every non-NaN a): a = +Inf gives +Inf * b, a NaN a or
b gives NaN, a = 0 with b = +-Inf gives NaN. a = -Inf gives NaN: the division alone would give
-Inf (d is finite), but the graph this op replaces computes a * sigmoid(a) = -Inf * 0 = NaN
(torch's silu and ORT's com.microsoft.QuickGelu both do), so s is NaN there by rule.
An odd last dim is an error naming input 'x' and the width.
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops._moe import ONE, exp_f32
from ort_ops.ops._schema import FLOAT_TYPES, Arg, OpSchema

SCHEMA = OpSchema(
    name="SwiGLU",
    inputs=(Arg("x", FLOAT_TYPES, doc="[..., 2I] gate half a, then up half b"),),
    outputs=(Arg("y", FLOAT_TYPES, doc="[..., I] silu(a) * b, x's dtype"),),
    doc=__doc__,
)


def reference(x: np.ndarray) -> np.ndarray:
    """numpy SwiGLU.

    Args:
        x: float32/float16 [..., 2I], rank >= 1.

    Returns:
        y [..., I] of x's dtype.
    """
    SCHEMA.check_dtypes({"x": x})
    x = np.asarray(x)
    if x.ndim < 1:
        raise ValueError("SwiGLU: input 'x' must have rank >= 1, got rank 0")
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"SwiGLU: input 'x' must have an even last dim (2 * I), got {width}")
    half = width // 2
    v = x.astype(np.float32)
    a, b = v[..., :half], v[..., half:]
    # exp_f32 is specified for non-NaN input; where a is NaN, s = a / d is NaN whatever d is, so
    # exp_f32 is given 0 there (the kernels' clamp maps NaN to a finite value the same way).
    with np.errstate(invalid="ignore", over="ignore"):
        e = exp_f32(-np.where(np.isnan(a), np.float32(0), a))
        d = (ONE + e).astype(np.float32)
        s = np.where(a == -np.inf, np.float32(np.nan), a / d).astype(np.float32)
        y = (s * b).astype(np.float32)
        return y.astype(x.dtype)
