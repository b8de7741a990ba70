# SPDX-License-Identifier: MIT
"""RotaryQuantizeKVCache: a decoder layer's attention prologue as one op (DESIGN.md,
"RotaryQuantizeKVCache"): Split of the joined QKV projection, rotary embedding of Q and K, and
QuantizeKVCache of the rotated K and of V.

Alphabet: T tokens, Hq query heads, Hkv kv heads, D head dim, R rotary width, N cache blocks,
B block size.

Inputs:
    qkv          float32/float16 [T, (Hq + 2 Hkv) D]  per token: Q heads, then K heads, then V heads
    cos, sin     qkv's dtype [T, R / 2]             row t: token t's angles (2 <= R <= D, R even)
    slot_mapping int64 [T]                          negative: the token's K/V are not stored
    key_cache, value_cache, key_scale, value_scale  as QuantizeKVCache
Attributes: num_heads (Hq), kv_num_heads (Hkv), interleaved (0: rotate_half, 1: pairs).
Outputs:
    query        qkv's dtype [T, Hq, D]              the rotated Q of every token
    key_cache_out, value_cache_out, key_scale_out, value_scale_out   as QuantizeKVCache

The rotation of a head x (widened to float32) with c = cos[t], s = sin[t] (float32), i < R / 2:

    interleaved = 0:  y[i] = x[i] c[i] - x[i + R/2] s[i]      y[i + R/2] = x[i + R/2] c[i] + x[i] s[i]
    interleaved = 1:  y[2i] = x[2i] c[i] - x[2i+1] s[i]       y[2i+1] = x[2i+1] c[i] + x[2i] s[i]
    y[j] = x[j] for j >= R

every product rounded to float32, then the sum or difference (no fused multiply-add), then y
rounded to qkv's dtype. The rotated K (so rounded, widened back) and V go through QuantizeKVCache's
rule and slots: the op is Split -> rotate -> QuantizeKVCache bit for bit, and this reference is
written as that chain (it calls ``quantize_kv_cache.reference`` for the caches).
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops import quantize_kv_cache
from ort_ops.ops._schema import FLOAT_TYPES, Arg, Attr, OpSchema

OP = "RotaryQuantizeKVCache"

SCHEMA = OpSchema(
    name=OP,
    inputs=(
        Arg("qkv", FLOAT_TYPES, doc="[T, (Hq + 2 Hkv) D] joined Q/K/V projection"),
        Arg("cos", FLOAT_TYPES, doc="[T, R/2] per-token rotary cos, qkv's dtype"),
        Arg("sin", FLOAT_TYPES, doc="[T, R/2] per-token rotary sin, qkv's dtype"),
        *quantize_kv_cache.CACHE_INPUTS,
    ),
    outputs=(
        Arg("query", FLOAT_TYPES, doc="[T, Hq, D] rotated Q, qkv's dtype"),
        *quantize_kv_cache.CACHE_OUTPUTS,
    ),
    attrs=(
        Attr("num_heads", "int", doc="Hq, > 0"),
        Attr("kv_num_heads", "int", doc="Hkv, > 0, divides Hq"),
        Attr("interleaved", "int", 0, doc="0: rotate_half halves; 1: adjacent pairs"),
    ),
    doc=__doc__,
)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: int) -> np.ndarray:
    """The contract's rotation of heads ``x`` float32 [T, H, D] by ``cos``/``sin`` float32
    [T, R/2]; float32 [T, H, D], not yet rounded to the input dtype."""
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    y = x.copy()
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2] = (a * c).astype(np.float32) - (b * s).astype(np.float32)
        y[..., 1:2 * half:2] = (b * c).astype(np.float32) + (a * s).astype(np.float32)
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        y[..., :half] = (a * c).astype(np.float32) - (b * s).astype(np.float32)
        y[..., half:2 * half] = (b * c).astype(np.float32) + (a * s).astype(np.float32)
    return y


def _check(qkv, cos, sin, num_heads, kv_num_heads, interleaved) -> tuple[int, int, int]:
    """Shapes, dtypes and attributes; returns (T, D, R)."""
    if num_heads is None or int(num_heads) <= 0:
        raise ValueError(f"{OP}: attribute 'num_heads' must be > 0, got {num_heads}")
    if kv_num_heads is None or int(kv_num_heads) <= 0:
        raise ValueError(f"{OP}: attribute 'kv_num_heads' must be > 0, got {kv_num_heads}")
    if num_heads % kv_num_heads:
        raise ValueError(f"{OP}: attribute 'num_heads' must be a multiple of 'kv_num_heads' ({kv_num_heads}), "
                         f"got {num_heads}")
    if interleaved not in (0, 1):
        raise ValueError(f"{OP}: attribute 'interleaved' must be 0 or 1, got {interleaved}")
    if qkv.ndim != 2:
        raise ValueError(f"{OP}: input 'qkv' must have rank 2, got shape {list(qkv.shape)}")
    t, width = qkv.shape
    heads = num_heads + 2 * kv_num_heads
    if width % heads or width == 0:
        raise ValueError(f"{OP}: input 'qkv' must have a last dim (num_heads + 2 * kv_num_heads) * head_dim = "
                         f"{heads} * head_dim with head_dim > 0, got {width}")
    d = width // heads
    for name, v in (("cos", cos), ("sin", sin)):
        if v.dtype != qkv.dtype:
            raise ValueError(f"{OP}: input '{name}' must have the dtype of 'qkv' ({qkv.dtype.name}), got {v.dtype.name}")
    if cos.ndim != 2 or cos.shape[0] != t or not 1 <= cos.shape[1] <= d // 2:
        raise ValueError(f"{OP}: input 'cos' must have shape [{t}, R/2] with 1 <= R/2 <= head_dim/2 = {d // 2}, "
                         f"got {list(cos.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"{OP}: input 'sin' must have shape {list(cos.shape)}, got {list(sin.shape)}")
    return t, d, 2 * cos.shape[1]


def reference(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, slot_mapping: np.ndarray, key_cache: np.ndarray,
              value_cache: np.ndarray, key_scale: np.ndarray, value_scale: np.ndarray, *, num_heads: int,
              kv_num_heads: int, interleaved: int = 0
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """numpy RotaryQuantizeKVCache; returns (query, updated copies of the four caches).

    Args:
        qkv: float32/float16 [T, (Hq + 2 Hkv) D].
        cos, sin: qkv's dtype [T, R/2].
        slot_mapping: int64 [T]; key_cache ... value_scale: as ``quantize_kv_cache.reference``.
        num_heads, kv_num_heads, interleaved: the attributes.

    Returns:
        (query [T, Hq, D] of qkv's dtype, key_cache_out, value_cache_out, key_scale_out, value_scale_out).
    """
    SCHEMA.check_dtypes({"qkv": qkv, "cos": cos, "sin": sin, "slot_mapping": slot_mapping, "key_cache": key_cache,
                         "value_cache": value_cache, "key_scale": key_scale, "value_scale": value_scale})
    qkv, cos, sin = np.asarray(qkv), np.asarray(cos), np.asarray(sin)
    slot_mapping = np.asarray(slot_mapping).astype(np.int64)
    t, d, _ = _check(qkv, cos, sin, num_heads, kv_num_heads, interleaved)
    quantize_kv_cache.check_caches(OP, t, kv_num_heads, d, slot_mapping, key_cache, value_cache, key_scale,
                                   value_scale)
    # Split, then rotate Q and K in float32 and round them to the input dtype.
    x = qkv.reshape(t, num_heads + 2 * kv_num_heads, d).astype(np.float32)
    c32, s32 = cos.astype(np.float32), sin.astype(np.float32)
    with np.errstate(over="ignore"):  # float16 rounding of |y| > 65504 is Inf, as the kernels give
        query = rotate(x[:, :num_heads], c32, s32, interleaved).astype(qkv.dtype)
        key = rotate(x[:, num_heads:num_heads + kv_num_heads], c32, s32, interleaved).astype(qkv.dtype)
    value = qkv.reshape(t, num_heads + 2 * kv_num_heads, d)[:, num_heads + kv_num_heads:]
    live = slot_mapping >= 0
    for name, v in (("K (after rotation)", key), ("V", value)):
        bad = ~np.all(np.isfinite(v.astype(np.float32)), axis=-1) & live[:, None]
        if bad.any():
            tok, head = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{OP}: input 'qkv' must be finite in the {name} of a live token, got NaN or Inf "
                             f"in token {tok}, kv head {head}")
    caches = quantize_kv_cache.reference(np.ascontiguousarray(key), np.ascontiguousarray(value), slot_mapping,
                                         key_cache, value_cache, key_scale, value_scale)
    return (query, *caches)
