# SPDX-License-Identifier: MIT
"""MoeFinalizeRouting: un-sort the expert outputs and take each token's weighted sum.

Alphabet: M tokens, H hidden size, K top-k slots per token.

Inputs:
    expert_out     float32/float16 [M*K, H]   row i belongs to flat pair sorted_to_flat[i]
    sorted_to_flat int32 [M*K]                a permutation of [0, M*K) (MoeInitRouting's)
    topk_weights   float32/float16 [M, K]
    residual       float32/float16 [M, H]     optional (e.g. a shared expert's output)
Output:
    out float32 [M, H]

Exact float32 recipe: with row(m, j) = i such that sorted_to_flat[i] = m*K + j,

    acc = residual[m] (or 0)
    for j in 0..K-1:  acc = acc + (topk_weights[m, j] * expert_out[row(m, j)])   (no FMA)

so kernels match the reference bit for bit. A sorted_to_flat that is not a permutation is an
error naming it.
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops._schema import FLOAT_TYPES, Arg, OpSchema

OP = "MoeFinalizeRouting"

SCHEMA = OpSchema(
    name=OP,
    inputs=(
        Arg("expert_out", FLOAT_TYPES, doc="[M*K, H] expert outputs in sorted order"),
        Arg("sorted_to_flat", ("int32",), doc="[M*K] from MoeInitRouting"),
        Arg("topk_weights", FLOAT_TYPES, doc="[M, K] routing weights"),
        Arg("residual", FLOAT_TYPES, optional=True, doc="[M, H] added first"),
    ),
    outputs=(Arg("out", ("float32",), doc="[M, H]"),),
    doc=__doc__,
)


def _f32(name, a, shape):
    a = np.asarray(a)
    if a.dtype not in (np.float32, np.float16):
        raise ValueError(f"{OP}: input '{name}' must be float32 or float16, got {a.dtype}")
    if a.shape != tuple(shape):
        raise ValueError(f"{OP}: input '{name}' must have shape {list(shape)}, got {list(a.shape)}")
    return a.astype(np.float32)


def reference(expert_out, sorted_to_flat, topk_weights, residual=None) -> np.ndarray:
    """numpy MoeFinalizeRouting; returns out float32 [M, H]."""
    tw = np.asarray(topk_weights)
    if tw.ndim != 2:
        raise ValueError(f"{OP}: input 'topk_weights' must have rank 2, got rank {tw.ndim}")
    m, k = tw.shape
    eo = np.asarray(expert_out)
    if eo.ndim != 2:
        raise ValueError(f"{OP}: input 'expert_out' must have rank 2, got rank {eo.ndim}")
    h = eo.shape[1]
    eo = _f32("expert_out", eo, (m * k, h))
    tw = _f32("topk_weights", tw, (m, k))
    s2f = np.asarray(sorted_to_flat)
    if s2f.dtype != np.int32:
        raise ValueError(f"{OP}: input 'sorted_to_flat' must be int32, got {s2f.dtype}")
    if s2f.shape != (m * k,):
        raise ValueError(f"{OP}: input 'sorted_to_flat' must have shape [{m * k}], got {list(s2f.shape)}")
    inv = np.full(m * k, -1, np.int64)
    for i, f in enumerate(s2f.tolist()):
        if not 0 <= f < m * k or inv[f] >= 0:
            raise ValueError(f"{OP}: input 'sorted_to_flat' must be a permutation of [0, {m * k}), got {f} at index {i}")
        inv[f] = i
    acc = _f32("residual", residual, (m, h)) if residual is not None else np.zeros((m, h), np.float32)
    rows = inv.reshape(m, k)
    for j in range(k):
        prod = (tw[:, j:j + 1] * eo[rows[:, j]]).astype(np.float32)
        acc = (acc + prod).astype(np.float32)
    return acc
