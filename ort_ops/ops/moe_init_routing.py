# SPDX-License-Identifier: MIT
"""MoeInitRouting: sort the (token, slot) pairs of a top-k routing by expert.

Alphabet: M tokens, H hidden size, K top-k slots per token, E experts.

Inputs:  x float32/float16/int8 [M, H], expert_ids int32 [M, K] (each in [0, E)),
         x_scale float32 [M] (optional: required with int8 x, refused with float x)
Outputs: sorted_x [M*K, H] (dtype of x), sorted_to_flat int32 [M*K], group_list int64 [E],
         sorted_x_scale float32 [M*K] (optional: x_scale of each sorted row; [0] without x_scale)
Attribute: num_experts (E, required, >= 1).

int8 x with its row scales is the lean chain's form: DynamicQuant runs on the M token rows
before routing, and the int8 rows and their scales are gathered, instead of gathering M*K float
rows and quantizing each copy. Quantization is per row, so both give the same codes and scales
bit for bit.

Sorted row i holds the pair whose flat index is f = sorted_to_flat[i] = m * K + j: a stable
sort of the M*K pairs by expert id (ties keep flat order), sorted_x[i] = x[f // K] (copied
bit for bit), and group_list[e] is the cumulative end row of expert e (group_list_type 0).
An id outside [0, E) is an error naming 'expert_ids'.
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops._schema import FLOAT_TYPES, Arg, Attr, OpSchema

OP = "MoeInitRouting"

SCHEMA = OpSchema(
    name=OP,
    inputs=(
        Arg("x", FLOAT_TYPES, doc="[M, H] tokens"),
        Arg("expert_ids", ("int32",), doc="[M, K] chosen experts per token"),
        Arg("x_scale", ("float32",), optional=True, doc="[M] row scales of int8 x"),
    ),
    outputs=(
        Arg("sorted_x", FLOAT_TYPES, doc="[M*K, H] token rows grouped by expert"),
        Arg("sorted_to_flat", ("int32",), doc="[M*K] flat (token * K + slot) index of each sorted row"),
        Arg("group_list", ("int64",), doc="[E] cumulative end row per expert"),
        Arg("sorted_x_scale", ("float32",), optional=True, doc="[M*K] x_scale of each sorted row ([0] without x_scale)"),
    ),
    attrs=(Attr("num_experts", "int", None, doc="E (required)"),),
    doc=__doc__,
)


def reference(x, expert_ids, num_experts: int, x_scale=None):
    """numpy MoeInitRouting.

    Returns:
        (sorted_x [M*K, H] dtype of x, sorted_to_flat int32 [M*K], group_list int64 [E]), and
        sorted_x_scale float32 [M*K] fourth when ``x_scale`` is given.
    """
    x = np.asarray(x)
    ids = np.asarray(expert_ids)
    if x.dtype not in (np.float32, np.float16, np.int8):
        raise ValueError(f"{OP}: input 'x' must be float32 or float16 or int8, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{OP}: input 'x' must have rank 2, got rank {x.ndim}")
    if (x.dtype == np.int8) != (x_scale is not None):
        raise ValueError(f"{OP}: input 'x_scale' must be given exactly when 'x' is int8 (its row scales)")
    if x_scale is not None:
        x_scale = np.asarray(x_scale)
        if x_scale.dtype != np.float32 or x_scale.shape != (x.shape[0],):
            raise ValueError(f"{OP}: input 'x_scale' must be float32 [{x.shape[0]}], got {x_scale.dtype} "
                             f"{list(x_scale.shape)}")
    if ids.dtype != np.int32:
        raise ValueError(f"{OP}: input 'expert_ids' must be int32, got {ids.dtype}")
    if ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{OP}: input 'expert_ids' must have shape [{x.shape[0]}, K], got {list(ids.shape)}")
    if num_experts < 1:
        raise ValueError(f"{OP}: attribute 'num_experts' must be >= 1, got {num_experts}")
    m, k = ids.shape
    if m * k > 2**31 - 1:
        raise ValueError(f"{OP}: M * K must be <= {2**31 - 1} (sorted_to_flat is int32), got {m * k}")
    flat = ids.reshape(-1)
    bad = (flat < 0) | (flat >= num_experts)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{OP}: input 'expert_ids' must be in [0, {num_experts}), got {int(flat[i])} at token {i // k}, slot {i % k}")
    order = np.argsort(flat, kind="stable").astype(np.int32)
    sorted_x = x[order // k] if k else np.zeros((0, x.shape[1]), x.dtype)
    group_list = np.cumsum(np.bincount(flat, minlength=num_experts)).astype(np.int64)
    if x_scale is not None:
        return sorted_x, order, group_list, x_scale[order // k] if k else np.zeros(0, np.float32)
    return sorted_x, order, group_list
