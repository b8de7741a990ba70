# SPDX-License-Identifier: MIT
"""The contract's INT8 quantization rule (DESIGN.md, Conventions), in plain numpy.

    amax = max|x|, scale = amax / 127, q = clamp(rint(x * min(127 / amax, FLT_MAX)), -127, 127)

All arithmetic is float32, ``rint`` rounds half to even, ``amax == 0`` gives scale 0 and q 0.
The factor saturates at FLT_MAX: for 0 < amax < 127 / FLT_MAX (~3.7e-37) ``127 / amax`` is +Inf
and the row's zeros would become NaN codes (0 * Inf); saturated, zeros stay 0.
Every kernel produces these codes bit for bit, so the order of float32 operations here is part
of the spec: ``inv = 127 / amax`` first, then one float32 multiply per element (never fused
into an FMA, never ``x / scale``).
"""

from __future__ import annotations

import numpy as np

QMAX = np.float32(127.0)


def quantize_rows(x: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-vector INT8 quantization along ``axis``.

    Args:
        x: float array (any float dtype; converted to float32 first).
        axis: the axis each scale covers.

    Returns:
        (q int8 with x's shape, scale float32 with ``axis`` removed).
    """
    x32 = np.asarray(x).astype(np.float32)
    amax = np.max(np.abs(x32), axis=axis, keepdims=True) if x32.shape[axis] else np.zeros(
        x32.shape[:axis % x32.ndim] + (1,) + x32.shape[axis % x32.ndim + 1:], np.float32)
    amax = amax.astype(np.float32)
    scale = (amax / QMAX).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(amax > 0, QMAX / np.where(amax > 0, amax, np.float32(1)), np.float32(0)).astype(np.float32)
    inv = np.minimum(inv, np.finfo(np.float32).max)
    q = np.clip(np.rint((x32 * inv).astype(np.float32)), -127, 127).astype(np.int8)
    return q, np.squeeze(scale, axis=axis)


def dequantize_rows(q: np.ndarray, scale: np.ndarray, axis: int = -1) -> np.ndarray:
    """float32 values ``q * scale`` with ``scale`` broadcast along ``axis``."""
    return q.astype(np.float32) * np.expand_dims(np.asarray(scale, np.float32), axis)


def quantize_expert_weights(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel INT8 expert weights (the MoE ops' offline rule, DESIGN.md "MoE"):
    W float [E, K, N] -> (int8 [E, K, N], scale float32 [E, N]), ``quantize_rows`` over K:
    scale = max_k |W[e, k, n]| / 127, q = rint(W * (127 / amax)).

    One expert at a time: each expert's scales cover its own rows only, so the codes are those of
    the whole array at once, while the float32 temporaries are one expert's (a model's expert
    weights are gigabytes, often read from a memory-mapped file).
    """
    w = np.asarray(w)
    if w.ndim != 3:
        return quantize_rows(np.asarray(w, np.float32), axis=1)
    q = np.empty(w.shape, np.int8)
    scale = np.empty((w.shape[0], w.shape[2]), np.float32)
    for e in range(w.shape[0]):
        q[e], scale[e] = quantize_rows(w[e], axis=0)
    return q, scale
