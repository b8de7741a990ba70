# SPDX-License-Identifier: MIT
"""DynamicQuant: per-row symmetric INT8 quantization of ``x * smooth_scale``.

Shapes: x [..., K] (rank >= 1; rows are all axes but the last), smooth_scale [K] optional.
Outputs: y int8 [..., K], scale float32 [...].

Non-finite input (NaN or +-Inf in x, smooth_scale or their product) is an error: the kernel
fails the Run naming the row, since no INT8 code can represent it and a silent clamp would be
a wrong answer. The reference raises ValueError in the same cases.
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops._quant import quantize_rows
from ort_ops.ops._schema import FLOAT_TYPES, Arg, OpSchema

SCHEMA = OpSchema(
    name="DynamicQuant",
    inputs=(
        Arg("x", FLOAT_TYPES, doc="[..., K] activations"),
        Arg("smooth_scale", FLOAT_TYPES, optional=True, doc="[K] per-column factor applied first"),
    ),
    outputs=(
        Arg("y", ("int8",), doc="[..., K] codes"),
        Arg("scale", ("float32",), doc="[...] per-row scale"),
    ),
    doc=__doc__,
)


def reference(x: np.ndarray, smooth_scale: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """numpy DynamicQuant.

    Args:
        x: float32/float16 [..., K], rank >= 1.
        smooth_scale: float32/float16 [K] or None.

    Returns:
        (y int8 [..., K], scale float32 [...]).
    """
    SCHEMA.check_dtypes({"x": x, "smooth_scale": smooth_scale})
    x = np.asarray(x)
    if x.ndim < 1:
        raise ValueError("DynamicQuant: input 'x' must have rank >= 1, got rank 0")
    v = x.astype(np.float32)
    if smooth_scale is not None:
        s = np.asarray(smooth_scale).astype(np.float32)
        if s.shape != (x.shape[-1],):
            raise ValueError(f"DynamicQuant: input 'smooth_scale' must have shape [{x.shape[-1]}], got {list(s.shape)}")
        v = (v * s).astype(np.float32)
    if not np.all(np.isfinite(v)):
        raise ValueError("DynamicQuant: input 'x' has a non-finite value (NaN or Inf)")
    return quantize_rows(v, axis=-1)
