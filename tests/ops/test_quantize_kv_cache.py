# SPDX-License-Identifier: MIT
"""QuantizeKVCache on the CPU EP against ort_ops.reference.quantize_kv_cache (bit-exact caches).

Covers the copy path (inputs untouched), the in-place path through a real onnxruntime IOBinding
(outputs bound to the inputs' OrtValues: only the new slots change, untouched slots keep their
old bytes), skipped tokens, and bad input.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from ort_ops import reference
from ort_ops.ops import quantize_kv_cache
from ort_ops.ops._run import make_session, run_single_op
from tests.conftest import use_isa

SCHEMA = quantize_kv_cache.SCHEMA
CACHE_NAMES = ("key_cache", "value_cache", "key_scale", "value_scale")
ISAS = ["scalar", "avx2"]  # the row quantizer has these two variants; VNNI levels use AVX2


def _caches(rng, n, h, b, d):
    """Random old cache contents: any byte that changes unexpectedly shows up."""
    return {"key_cache": rng.integers(-127, 128, (n, h, b, d), dtype=np.int8),
            "value_cache": rng.integers(-127, 128, (n, h, d, b), dtype=np.int8),
            "key_scale": rng.uniform(0.1, 2.0, (n, h, b)).astype(np.float32),
            "value_scale": rng.uniform(0.1, 2.0, (n, h, b)).astype(np.float32)}


def _inputs(rng, t, h, d, n, b, dtype=np.float32, skip=0.2):
    slots = rng.choice(n * b, size=t, replace=False).astype(np.int64)
    slots[rng.random(t) < skip] = -1
    scale = rng.uniform(0.01, 10.0)
    return {"key": (rng.standard_normal((t, h, d)) * scale).astype(dtype),
            "value": (rng.standard_normal((t, h, d)) * scale).astype(dtype),
            "slot_mapping": slots, **_caches(rng, n, h, b, d)}


def _assert_exact(got, want):
    for name, g, w in zip(CACHE_NAMES, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        bad = np.argwhere(g != w)
        assert bad.size == 0, f"{name}: {len(bad)} elements differ, first at {bad[:3].tolist()}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d,b", [(64, 8), (80, 16), (128, 32), (96, 256), (256, 64)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_matches_reference(monkeypatch, rng, isa, d, b, dtype):
    use_isa(monkeypatch, isa)
    ins = _inputs(rng, 13, 3, d, 5, b, dtype)
    before = {k: v.copy() for k, v in ins.items()}
    _assert_exact(run_single_op(SCHEMA, ins), reference.quantize_kv_cache(**ins))
    for k, v in before.items():  # the copy path leaves every input untouched
        np.testing.assert_array_equal(ins[k], v, err_msg=k)


def test_edge_rows(rng):
    """All-zero rows (scale 0, codes 0), one huge value, tiny values, exact ties."""
    ins = _inputs(rng, 4, 2, 64, 2, 16, skip=0.0)
    ins["key"][0] = 0.0
    ins["value"][1] = 0.0
    ins["value"][1, 1, 7] = -1e30
    ins["key"][2] *= 1e-30
    ins["key"][3, 0, :] = np.linspace(-127, 127, 64).astype(np.float32)
    ins["key"][3, 0, 0] = 127.0
    ins["key"][3, 0, 1:5] = [0.5, 1.5, 2.5, -2.5]  # amax 127: true ties round half to even
    got = run_single_op(SCHEMA, ins)
    _assert_exact(got, reference.quantize_kv_cache(**ins))
    blk, off = divmod(int(ins["slot_mapping"][3]), 16)
    np.testing.assert_array_equal(got[0][blk, 0, off, 1:5], [0, 2, 2, -2])


def _bound_session(ins, same_buffers: bool, schema=SCHEMA, **attrs):
    """Runs ``schema`` (QuantizeKVCache, or another op that writes the cache the same way) through
    IOBinding: the cache outputs bound to the inputs' own OrtValues when same_buffers, to fresh
    zero buffers otherwise; the other inputs bound from host memory. Returns (the caches' input
    OrtValues, the separate output OrtValues, the other outputs as numpy by name)."""
    sess = make_session(schema, ins, **attrs)
    io = sess.io_binding()
    for name in schema.input_names():
        if name not in CACHE_NAMES:
            io.bind_cpu_input(name, ins[name])
    others = [name for name in schema.output_names() if name[:-len("_out")] not in CACHE_NAMES]
    for name in others:
        io.bind_output(name)
    values = {name: ort.OrtValue.ortvalue_from_numpy(ins[name]) for name in CACHE_NAMES}
    outs = {}
    for name in CACHE_NAMES:
        io.bind_ortvalue_input(name, values[name])
        if same_buffers:
            io.bind_ortvalue_output(name + "_out", values[name])
        else:
            outs[name] = ort.OrtValue.ortvalue_from_numpy(np.zeros_like(ins[name]))
            io.bind_ortvalue_output(name + "_out", outs[name])
    sess.run_with_iobinding(io)
    return values, outs, dict(zip(others, io.copy_outputs_to_cpu()[:len(others)]))


def test_in_place_through_iobinding(rng):
    """Outputs bound to the input OrtValues: only the new slots change, in the same buffers."""
    ins = _inputs(rng, 9, 2, 128, 6, 16)
    want = reference.quantize_kv_cache(**ins)
    old = {name: ins[name].copy() for name in CACHE_NAMES}
    values, _, _ = _bound_session(ins, same_buffers=True)
    ptrs = {name: values[name].data_ptr() for name in CACHE_NAMES}
    got = [values[name].numpy() for name in CACHE_NAMES]
    _assert_exact(got, want)
    assert all(values[n].data_ptr() == ptrs[n] for n in CACHE_NAMES)
    # Untouched slots keep their old bytes; the written ones are exactly the live slots.
    written = np.zeros(6 * 16, bool)
    written[ins["slot_mapping"][ins["slot_mapping"] >= 0]] = True
    changed = np.any(got[0].transpose(0, 2, 1, 3).reshape(6 * 16, -1) != old["key_cache"].transpose(0, 2, 1, 3).reshape(6 * 16, -1), axis=1)
    assert not np.any(changed & ~written)
    np.testing.assert_array_equal(got[2].transpose(0, 2, 1).reshape(6 * 16, -1)[~written],
                                  old["key_scale"].transpose(0, 2, 1).reshape(6 * 16, -1)[~written])


def test_separate_output_buffers_copy(rng):
    """Outputs bound to fresh buffers: a full copy plus the new slots; the inputs are untouched."""
    ins = _inputs(rng, 7, 2, 64, 4, 8)
    old = {name: ins[name].copy() for name in CACHE_NAMES}
    values, outs, _ = _bound_session(ins, same_buffers=False)
    _assert_exact([outs[n].numpy() for n in CACHE_NAMES], reference.quantize_kv_cache(**ins))
    for name in CACHE_NAMES:
        np.testing.assert_array_equal(values[name].numpy(), old[name], err_msg=name)


def test_failed_run_leaves_bound_cache_untouched(rng):
    ins = _inputs(rng, 5, 1, 64, 3, 8, skip=0.0)
    ins["value"][4, 0, 3] = np.nan
    old = {name: ins[name].copy() for name in CACHE_NAMES}
    with pytest.raises(Exception, match=r"QuantizeKVCache: input 'value' must be finite, got NaN or Inf in token 4"):
        _bound_session(ins, same_buffers=True)
    for name in CACHE_NAMES:
        np.testing.assert_array_equal(ins[name], old[name], err_msg=name)


def test_skipped_token_is_not_read(rng):
    """A skipped token's K/V (slot < 0) are never read, so NaN there is no error: the op and the
    reference both leave its values out and store the live tokens."""
    ins = _inputs(rng, 4, 2, 64, 3, 8, skip=0.0)
    clean = reference.quantize_kv_cache(**dict(ins, slot_mapping=np.where(np.arange(4) == 1, -1, ins["slot_mapping"])))
    ins["slot_mapping"][1] = -1
    ins["key"][1, 0, 5] = np.nan
    ins["value"][1, 1, 7] = np.inf
    want = reference.quantize_kv_cache(**ins)
    _assert_exact(want, clean)
    _assert_exact(run_single_op(SCHEMA, ins), want)


def test_no_tokens_and_all_skipped(rng):
    ins = _inputs(rng, 3, 2, 64, 2, 8)
    ins["slot_mapping"][:] = -1
    _assert_exact(run_single_op(SCHEMA, ins), [ins[n] for n in CACHE_NAMES])
    empty = dict(ins, key=ins["key"][:0], value=ins["value"][:0], slot_mapping=ins["slot_mapping"][:0])
    _assert_exact(run_single_op(SCHEMA, empty), [ins[n] for n in CACHE_NAMES])


@pytest.mark.parametrize("slot", [16, 1000])
def test_slot_out_of_range(rng, slot):
    ins = _inputs(rng, 3, 1, 64, 2, 8, skip=0.0)
    ins["slot_mapping"][1] = slot
    with pytest.raises(Exception, match=rf"QuantizeKVCache: input 'slot_mapping' must hold slots < 16 \(num_blocks \* block_size\), got slot_mapping\[1\] = {slot}"):
        run_single_op(SCHEMA, ins)
    with pytest.raises(ValueError, match="slot_mapping"):
        reference.quantize_kv_cache(**ins)


def test_repeated_slot(rng):
    ins = _inputs(rng, 3, 1, 64, 2, 8, skip=0.0)
    ins["slot_mapping"][:] = [5, 9, 5]
    with pytest.raises(Exception, match=r"QuantizeKVCache: input 'slot_mapping' must not repeat a slot, got slot 5 twice"):
        run_single_op(SCHEMA, ins)


@pytest.mark.parametrize("name,shape,expected", [
    ("value", (3, 1, 32), r"input 'value' must have shape \[3, 1, 64\], got \[3, 1, 32\]"),
    ("slot_mapping", (4,), r"input 'slot_mapping' must have shape \[3\], got \[4\]"),
    ("key_cache", (2, 2, 8, 64), r"input 'key_cache' must have shape \[2, 1, 8, 64\], got \[2, 2, 8, 64\]"),
    ("value_cache", (2, 1, 8, 64), r"input 'value_cache' must have shape \[2, 1, 64, 8\], got \[2, 1, 8, 64\]"),
    ("key_scale", (2, 1, 16), r"input 'key_scale' must have shape \[2, 1, 8\], got \[2, 1, 16\]"),
    ("value_scale", (3, 1, 8), r"input 'value_scale' must have shape \[2, 1, 8\], got \[3, 1, 8\]"),
])
def test_shape_disagreements(rng, name, shape, expected):
    ins = _inputs(rng, 3, 1, 64, 2, 8)
    ins[name] = np.zeros(shape, ins[name].dtype)
    with pytest.raises(Exception, match="QuantizeKVCache: " + expected):
        run_single_op(SCHEMA, ins)


def test_wrong_dtypes(rng):
    ins = _inputs(rng, 3, 1, 64, 2, 8)
    with pytest.raises(Exception, match=r"QuantizeKVCache: input 'key' must be float32 or float16, got float64"):
        run_single_op(SCHEMA, dict(ins, key=ins["key"].astype(np.float64)))
    # Fixed-dtype inputs are refused by ORT at session creation, naming the input and the op.
    with pytest.raises(Exception, match=r"\(slot_mapping\) of operator \(QuantizeKVCache\)"):
        run_single_op(SCHEMA, dict(ins, slot_mapping=ins["slot_mapping"].astype(np.int32)))
    with pytest.raises(Exception, match=r"\(value_cache\) of operator \(QuantizeKVCache\)"):
        run_single_op(SCHEMA, dict(ins, value_cache=ins["value_cache"].astype(np.uint8)))
