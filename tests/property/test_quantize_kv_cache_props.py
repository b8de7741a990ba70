# SPDX-License-Identifier: MIT
"""QuantizeKVCache on the CPU EP against ort_ops.reference.quantize_kv_cache, caches bound in place
through IOBinding (the runtime's binding): random head dims, kv heads, block sizes, token counts
(0, 1, many), skipped tokens (negative slots), float32/float16 values from tiny to huge, every
ISA variant; the four caches equal the reference's bit for bit, so every slot not written keeps
its old bytes. Invalid inputs (slots out of range, repeated slots, NaN/Inf, shapes that disagree,
wrong dtypes and ranks, misaligned buffers) are refused naming the op and the input, with the
bound caches unchanged byte for byte."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ort_ops import reference
from ort_ops.ops import quantize_kv_cache
from tests.property import _harness as h
from tests.property import _strategies as S

SCHEMA = quantize_kv_cache.SCHEMA
CACHES = ("key_cache", "value_cache", "key_scale", "value_scale")
IN_PLACE = {c + "_out": c for c in CACHES}


def _caches(rng, n, hkv, b, d):
    """Random old contents: any byte that changes unexpectedly shows up."""
    return {"key_cache": rng.integers(-128, 128, (n, hkv, b, d), dtype=np.int8),
            "value_cache": rng.integers(-128, 128, (n, hkv, d, b), dtype=np.int8),
            "key_scale": rng.uniform(0.0, 2.0, (n, hkv, b)).astype(np.float32),
            "value_scale": rng.uniform(0.0, 2.0, (n, hkv, b)).astype(np.float32)}


@st.composite
def geometry(draw):
    d = draw(st.sampled_from([1, 8, 64, 80, 96, 128, 256, 33]))
    hkv = draw(st.integers(1, 4))
    b = draw(st.sampled_from([1, 8, 16, 32, 64, 256, 3]))
    n = draw(st.integers(1, 6))
    return d, hkv, b, n


@st.composite
def valid_inputs(draw):
    d, hkv, b, n = draw(geometry())
    t = draw(st.integers(0, min(n * b, 40)))
    rng = np.random.default_rng(draw(S.seeds))
    dtype = draw(S.float_dtypes)
    slots = rng.choice(n * b, size=t, replace=False).astype(np.int64)
    skip = rng.random(t) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    slots[skip] = -rng.integers(1, 2**40, int(skip.sum()))  # any negative slot means "skip"
    key = S.floats(rng, (t, hkv, d), dtype, draw(S.regimes))
    value = S.floats(rng, (t, hkv, d), dtype, draw(S.regimes))
    return {"key": key, "value": value, "slot_mapping": slots, **_caches(rng, n, hkv, b, d)}, draw(S.isas())


@given(valid_inputs())
def test_in_place_matches_reference(case):
    ins, isa = case
    want = reference.quantize_kv_cache(**ins)  # copies: the inputs stay as they were
    ptrs = {c: ins[c].ctypes.data for c in CACHES}
    got = h.run(SCHEMA, ins, in_place=IN_PLACE, isa=isa)
    for c, g, w in zip(CACHES, got, want):
        assert g.ctypes.data == ptrs[c]  # written in the bound buffer itself
        assert g.tobytes() == w.tobytes(), f"{c}: {int(np.sum(g != w))} elements differ from the reference"


INVALID = ("slot_high", "slot_repeat", "nonfinite", "value_shape", "slots_shape", "cache_shape", "scale_shape",
           "key_rank", "cache_rank", "key_dtype", "slots_dtype", "cache_dtype", "scale_dtype", "misaligned")


@st.composite
def invalid_inputs(draw):
    d, hkv, b, n = draw(geometry())
    t = draw(st.integers(1, min(n * b, 12)))
    rng = np.random.default_rng(draw(S.seeds))
    dtype = draw(S.float_dtypes)
    slots = rng.choice(n * b, size=t, replace=False).astype(np.int64)
    ins = {"key": S.floats(rng, (t, hkv, d), dtype, "normal"),
           "value": S.floats(rng, (t, hkv, d), dtype, "normal"),
           "slot_mapping": slots, **_caches(rng, n, hkv, b, d)}
    kind = draw(st.sampled_from(INVALID))
    i = draw(st.integers(0, t - 1))
    bad = "slot_mapping"
    if kind == "slot_high":
        slots[i] = draw(st.one_of(st.just(n * b), st.integers(n * b, 2**63 - 1)))
    elif kind == "slot_repeat":
        if t == 1:
            ins["key"], ins["value"] = (np.concatenate([a, a]) for a in (ins["key"], ins["value"]))
            ins["slot_mapping"] = np.array([slots[0], slots[0]])
        else:
            slots[i] = slots[(i + 1) % t]
    elif kind == "nonfinite":
        bad = draw(st.sampled_from(["key", "value"]))
        ins[bad][i].flat[draw(st.integers(0, hkv * d - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif kind == "value_shape":
        bad = "value"
        ins["value"] = S.floats(rng, (t, hkv, d + 1), dtype, "normal")
    elif kind == "slots_shape":
        ins["slot_mapping"] = np.concatenate([slots, slots[:1] * 0 - 1])
    elif kind == "cache_shape":
        bad = draw(st.sampled_from(["value_cache", "key_cache"]))
        shape = list(ins[bad].shape)
        shape[draw(st.integers(1, 3))] += 1
        ins[bad] = np.zeros(shape, np.int8)
        if bad == "key_cache":  # the key cache defines N and B; a wrong Hkv or D names it, or the K/V
            bad = ["key_cache", "key", "value_cache", "key_scale", "value_scale"]  # that disagree with it
    elif kind == "scale_shape":
        bad = draw(st.sampled_from(["key_scale", "value_scale"]))
        ins[bad] = np.zeros((n + 1, hkv, b), np.float32)
    elif kind == "key_rank":
        bad = "key"
        ins["key"] = ins["key"].reshape(t, hkv * d)
    elif kind == "cache_rank":
        bad = "key_cache"
        ins["key_cache"] = ins["key_cache"].reshape(n, hkv * b, d)
    elif kind == "misaligned":  # int8 caches are aligned at any address
        bad = draw(st.sampled_from(["key", "value", "slot_mapping", "key_scale", "value_scale"]))
        ins[bad] = S.misaligned(ins[bad])
    elif kind == "key_dtype":
        bad = "key"
        ins["key"] = ins["key"].astype(np.float64)
    elif kind == "slots_dtype":
        ins["slot_mapping"] = slots.astype(np.int32)
    elif kind == "cache_dtype":
        bad = "value_cache"
        ins["value_cache"] = ins["value_cache"].view(np.uint8)
    else:
        bad = "key_scale"
        ins["key_scale"] = ins["key_scale"].astype(np.float16)
    return ins, bad, draw(S.isas()), kind != "misaligned"


@given(invalid_inputs())
def test_invalid_refused_caches_unchanged(case):
    ins, bad, isa, ref_refuses = case  # numpy has no notion of a misaligned buffer: the reference takes it
    # A cache whose dtype is wrong cannot share its buffer with the output: bind only the others.
    in_place = {o: i for o, i in IN_PLACE.items() if ins[i].dtype == (np.int8 if "cache" in i else np.float32)}
    h.assert_refused(SCHEMA, ins, {}, bad, in_place=in_place, isa=isa,
                     reference=reference.quantize_kv_cache if ref_refuses else None)
