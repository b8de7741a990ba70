# SPDX-License-Identifier: MIT
"""QuantizeKVCache: quantize new K/V tokens into the paged INT8 KV cache (DESIGN.md, "KV cache").

Alphabet: T new tokens, H = Hkv kv heads, D head dim, N cache blocks, B block size.

Inputs:
    key          float32/float16 [T, Hkv, D]
    value        float32/float16 [T, Hkv, D]
    slot_mapping int64 [T]            slot = block * B + offset; negative: skip the token
    key_cache    int8    [N, Hkv, B, D]
    value_cache  int8    [N, Hkv, D, B]   (token innermost)
    key_scale    float32 [N, Hkv, B]      per (token, kv head)
    value_scale  float32 [N, Hkv, B]
Outputs (same shapes and dtypes as the four caches):
    key_cache_out, value_cache_out, key_scale_out, value_scale_out

Each token's K and V vector of each kv head is quantized on its own with the contract's rule
(``ort_ops.ops._quant.quantize_rows``: amax / 127 scale, round half to even, codes in
[-127, 127]); codes and scales are bit-exact across the reference and every kernel. Slots must
be < N * B and the non-negative ones distinct (two writes to one slot would race in a parallel
kernel); non-finite K/V values of live tokens are refused (no INT8 code represents them); a
skipped token's K/V are never read.

In-place update (how a paged KV-cache runtime binds the op)
------------------------------------------------------------
The kernel writes only the T new slots, at a cost independent of the cache size, when each
output is the very buffer of its input. With onnxruntime's IOBinding, give the same OrtValue to
the input and to the output of the same cache::

    kc = ort.OrtValue.ortvalue_from_numpy(key_cache)      # likewise vc, ks, vs
    io = sess.io_binding()
    io.bind_cpu_input("key", key); io.bind_cpu_input("value", value)
    io.bind_cpu_input("slot_mapping", slots)
    for name, v in (("key_cache", kc), ("value_cache", vc), ("key_scale", ks), ("value_scale", vs)):
        io.bind_ortvalue_input(name, v)
        io.bind_ortvalue_output(name + "_out", v)
    sess.run_with_iobinding(io)    # kc ... vs now hold the new tokens; nothing else moved

(For a model whose graph feeds the same tensors onward, bind the graph inputs/outputs that
carry the caches the same way.) Any other binding (plain ``sess.run``, or outputs in fresh
buffers) copies the whole cache first and leaves the inputs untouched: correct, but the step
then costs a full cache copy.
"""

from __future__ import annotations

import numpy as np

from ort_ops.ops._quant import quantize_rows
from ort_ops.ops._schema import FLOAT_TYPES, Arg, OpSchema

OP = "QuantizeKVCache"

# slot_mapping and the four caches in, the four caches out: the arguments of every op that writes
# the paged cache as this one does (RotaryQuantizeKVCache too).
CACHE_INPUTS = (
    Arg("slot_mapping", ("int64",), doc="[T] cache slot of each token; negative: skip"),
    Arg("key_cache", ("int8",), doc="[N, Hkv, B, D]"),
    Arg("value_cache", ("int8",), doc="[N, Hkv, D, B] (token innermost)"),
    Arg("key_scale", ("float32",), doc="[N, Hkv, B]"),
    Arg("value_scale", ("float32",), doc="[N, Hkv, B]"),
)
CACHE_OUTPUTS = (
    Arg("key_cache_out", ("int8",), doc="[N, Hkv, B, D]"),
    Arg("value_cache_out", ("int8",), doc="[N, Hkv, D, B]"),
    Arg("key_scale_out", ("float32",), doc="[N, Hkv, B]"),
    Arg("value_scale_out", ("float32",), doc="[N, Hkv, B]"),
)

SCHEMA = OpSchema(
    name=OP,
    inputs=(
        Arg("key", FLOAT_TYPES, doc="[T, Hkv, D] new keys"),
        Arg("value", FLOAT_TYPES, doc="[T, Hkv, D] new values"),
        *CACHE_INPUTS,
    ),
    outputs=CACHE_OUTPUTS,
    doc=__doc__,
)


def _check(key, value, slot_mapping, key_cache, value_cache, key_scale, value_scale) -> None:
    if key.ndim != 3:
        raise ValueError(f"{OP}: input 'key' must have rank 3, got shape {list(key.shape)}")
    t, hkv, d = key.shape
    if value.shape != key.shape:
        raise ValueError(f"{OP}: input 'value' must have shape {list(key.shape)}, got {list(value.shape)}")
    check_caches(OP, t, hkv, d, slot_mapping, key_cache, value_cache, key_scale, value_scale)


def check_caches(op: str, t: int, hkv: int, d: int, slot_mapping, key_cache, value_cache, key_scale,
                 value_scale) -> None:
    """The checks of slot_mapping and the four caches for T tokens of Hkv heads of D values, with
    messages naming ``op`` (shared with the ops that write the cache the same way)."""
    if slot_mapping.shape != (t,):
        raise ValueError(f"{op}: input 'slot_mapping' must have shape [{t}], got {list(slot_mapping.shape)}")
    if key_cache.ndim != 4:
        raise ValueError(f"{op}: input 'key_cache' must have rank 4, got shape {list(key_cache.shape)}")
    n, _, b, _ = key_cache.shape
    want = {"key_cache": (n, hkv, b, d), "value_cache": (n, hkv, d, b),
            "key_scale": (n, hkv, b), "value_scale": (n, hkv, b)}
    got = {"key_cache": key_cache, "value_cache": value_cache, "key_scale": key_scale,
           "value_scale": value_scale}
    for name, shape in want.items():
        if got[name].shape != shape:
            raise ValueError(f"{op}: input '{name}' must have shape {list(shape)}, got {list(got[name].shape)}")
    live = slot_mapping[slot_mapping >= 0]
    if live.size and live.max() >= n * b:
        bad = int(live.max())
        raise ValueError(f"{op}: input 'slot_mapping' must hold slots < {n * b} (num_blocks * block_size), got {bad}")
    if np.unique(live).size != live.size:
        raise ValueError(f"{op}: input 'slot_mapping' must not repeat a slot")


def reference(key: np.ndarray, value: np.ndarray, slot_mapping: np.ndarray, key_cache: np.ndarray,
              value_cache: np.ndarray, key_scale: np.ndarray, value_scale: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """numpy QuantizeKVCache; returns updated copies of the four caches (inputs untouched).

    Args:
        key, value: float32/float16 [T, Hkv, D].
        slot_mapping: int64 [T]; token t goes to block ``slot // B``, offset ``slot % B``.
        key_cache: int8 [N, Hkv, B, D]; value_cache: int8 [N, Hkv, D, B].
        key_scale, value_scale: float32 [N, Hkv, B].

    Returns:
        (key_cache_out, value_cache_out, key_scale_out, value_scale_out).
    """
    SCHEMA.check_dtypes({"key": key, "value": value, "slot_mapping": slot_mapping, "key_cache": key_cache,
                         "value_cache": value_cache, "key_scale": key_scale, "value_scale": value_scale})
    key, value = np.asarray(key), np.asarray(value)
    slot_mapping = np.asarray(slot_mapping).astype(np.int64)
    _check(key, value, slot_mapping, key_cache, value_cache, key_scale, value_scale)
    kc, vc = np.array(key_cache, np.int8), np.array(value_cache, np.int8)
    ks, vs = np.array(key_scale, np.float32), np.array(value_scale, np.float32)
    k32, v32 = key.astype(np.float32), value.astype(np.float32)
    # Only live tokens are read (the kernels never touch a skipped token's K/V either).
    live = slot_mapping >= 0
    if not (np.all(np.isfinite(k32[live])) and np.all(np.isfinite(v32[live]))):
        raise ValueError(f"{OP}: inputs 'key' and 'value' must be finite in live tokens (no INT8 code "
                         "represents NaN or Inf)")
    b = kc.shape[2]
    k32 = np.where(live[:, None, None], k32, np.float32(0))  # skipped rows: never stored
    v32 = np.where(live[:, None, None], v32, np.float32(0))
    kq, ksc = quantize_rows(k32, axis=-1)  # [T, Hkv, D], [T, Hkv]
    vq, vsc = quantize_rows(v32, axis=-1)
    for t, slot in enumerate(slot_mapping):
        if slot < 0:
            continue
        blk, off = divmod(int(slot), b)
        kc[blk, :, off, :] = kq[t]
        vc[blk, :, :, off] = vq[t]
        ks[blk, :, off] = ksc[t]
        vs[blk, :, off] = vsc[t]
    return kc, vc, ks, vs
