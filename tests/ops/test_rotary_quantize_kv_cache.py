# SPDX-License-Identifier: MIT
"""RotaryQuantizeKVCache on the CPU EP against ort_ops.reference.rotary_quantize_kv_cache (query and
caches bit-exact), the reference against the un-fused chain it replaces (a numpy Split + rotation +
QuantizeKVCache written here independently: exact; ORT's stock Split -> com.microsoft.RotaryEmbedding
-> QuantizeKVCache: within the bound of tests/tolerances.py), the in-place IOBinding path, and every
refusal.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from ort_ops import reference
from ort_ops._domain import DOMAIN, OPSET_VERSION
from ort_ops.ops import quantize_kv_cache, rotary_quantize_kv_cache
from ort_ops.ops._run import make_session, run_single_op
from ort_ops.ops._schema import IR_VERSION, ONNX_OPSET
from tests.conftest import use_isa
from tests.ops import test_quantize_kv_cache as qkv_tests
from tests.tolerances import (ROTARY_QKV_CODE_STEPS, ROTARY_QKV_F16_QUERY_ULPS, ROTARY_QKV_F32_QUERY_REL_OPERANDS,
                              ROTARY_QKV_SCALE_ULPS)

SCHEMA = rotary_quantize_kv_cache.SCHEMA
CACHE_NAMES = ("key_cache", "value_cache", "key_scale", "value_scale")
OUT_NAMES = ("query",) + CACHE_NAMES


def _inputs(rng, t, hq, hkv, d, half, n=6, b=16, dtype=np.float32, skip=0.2):
    """Random QKV, per-token angles (positions up to 4k, a base-10000 frequency ladder like a real
    model's), distinct slots with some skipped, and random old cache bytes."""
    slots = rng.choice(n * b, size=t, replace=False).astype(np.int64)
    slots[rng.random(t) < skip] = -1
    pos = rng.integers(0, 4096, t)
    freq = 10000.0 ** (-np.arange(half) / half)
    ang = pos[:, None] * freq[None, :]
    scale = rng.uniform(0.05, 8.0)
    return {"qkv": (rng.standard_normal((t, (hq + 2 * hkv) * d)) * scale).astype(dtype),
            "cos": np.cos(ang).astype(dtype), "sin": np.sin(ang).astype(dtype), "slot_mapping": slots,
            "key_cache": rng.integers(-127, 128, (n, hkv, b, d), dtype=np.int8),
            "value_cache": rng.integers(-127, 128, (n, hkv, d, b), dtype=np.int8),
            "key_scale": rng.uniform(0.1, 2.0, (n, hkv, b)).astype(np.float32),
            "value_scale": rng.uniform(0.1, 2.0, (n, hkv, b)).astype(np.float32)}


def _assert_exact(got, want, names=OUT_NAMES):
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        # Bit patterns: NaN == NaN and -0 != +0 count as they are stored.
        bad = np.argwhere(g.view(f"u{g.itemsize}") != w.view(f"u{w.itemsize}"))
        assert bad.size == 0, f"{name}: {len(bad)} elements differ, first at {bad[:3].tolist()}"


def _unfused_chain(ins, hq, hkv, interleaved):
    """The graph the op replaces, in numpy, written independently of the op's reference: Split,
    then each head rotated the way the exporters write it (x * cos + rotate_half(x) * sin on the
    rotated dims, a negation and a float32 product and sum per element; identical to the contract
    since a + (-b) == a - b exactly), rounded to the dtype, then QuantizeKVCache's reference."""
    qkv = ins["qkv"]
    t = qkv.shape[0]
    d = qkv.shape[1] // (hq + 2 * hkv)
    r = 2 * ins["cos"].shape[1]
    c, s = ins["cos"].astype(np.float32), ins["sin"].astype(np.float32)
    if interleaved:
        c_full, s_full = np.repeat(c, 2, axis=1), np.repeat(s, 2, axis=1)
    else:
        c_full, s_full = np.concatenate([c, c], axis=1), np.concatenate([s, s], axis=1)

    def rope(x):  # [T, H, D] of the input dtype -> same dtype
        x = x.astype(np.float32)
        rot, keep = x[..., :r], x[..., r:]
        if interleaved:
            other = np.stack([-rot[..., 1::2], rot[..., 0::2]], axis=-1).reshape(rot.shape)
        else:
            other = np.concatenate([-rot[..., r // 2:], rot[..., :r // 2]], axis=-1)
        y = rot * c_full[:, None, :] + other * s_full[:, None, :]
        return np.concatenate([y, keep], axis=-1).astype(qkv.dtype)

    q, k, v = np.split(qkv, [hq * d, (hq + hkv) * d], axis=1)
    query = rope(q.reshape(t, hq, d))
    key = rope(k.reshape(t, hkv, d))
    caches = reference.quantize_kv_cache(key, v.reshape(t, hkv, d).copy(), ins["slot_mapping"],
                                         *(ins[n] for n in CACHE_NAMES))
    return (query, *caches)


CASES = [(hq, hkv, d, half) for hq, hkv in [(2, 2), (8, 2)] for d in (64, 128) for half in (d // 2, d // 4)]
CASE_IDS = [f"hq{hq}-hkv{hkv}-d{d}-r{2 * half}" for hq, hkv, d, half in CASES]


@pytest.mark.parametrize("hq,hkv,d,half", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_matches_reference_and_unfused_chain(rng, dtype, interleaved, hq, hkv, d, half):
    ins = _inputs(rng, 37, hq, hkv, d, half, dtype=dtype)
    before = {k: v.copy() for k, v in ins.items()}
    want = reference.rotary_quantize_kv_cache(**ins, num_heads=hq, kv_num_heads=hkv, interleaved=interleaved)
    _assert_exact(want, _unfused_chain(ins, hq, hkv, interleaved))
    got = run_single_op(SCHEMA, ins, num_heads=hq, kv_num_heads=hkv, interleaved=interleaved)
    _assert_exact(got, want)
    for k, v in before.items():  # the copy path leaves every input untouched
        np.testing.assert_array_equal(ins[k], v, err_msg=k)


@pytest.mark.parametrize("isa", ["scalar", "avx2"])  # the row quantizer's two variants
@pytest.mark.parametrize("t", [0, 1, 37])
def test_token_counts_and_isas(monkeypatch, rng, isa, t):
    use_isa(monkeypatch, isa)
    ins = _inputs(rng, t, 4, 1, 64, 32, dtype=np.float16)
    got = run_single_op(SCHEMA, ins, num_heads=4, kv_num_heads=1)
    want = reference.rotary_quantize_kv_cache(**ins, num_heads=4, kv_num_heads=1)
    _assert_exact(got, want)
    _assert_exact(want, _unfused_chain(ins, 4, 1, 0))
    assert got[0].shape == (t, 4, 64)
    if t == 0:
        _assert_exact(got[1:], [ins[n] for n in CACHE_NAMES], CACHE_NAMES)


def test_one_session_for_any_token_count(rng):
    """Symbolic input dims (a decode/prefill model's): the op's output type inference gives query
    qkv's dtype, and one session serves T = 5, 0 and 40."""
    attrs = {"num_heads": 8, "kv_num_heads": 2}
    sess = make_session(SCHEMA, _inputs(rng, 5, 8, 2, 64, 16, dtype=np.float16), dynamic_shapes=True, **attrs)
    for t in (5, 0, 40):
        ins = _inputs(rng, t, 8, 2, 64, 16, dtype=np.float16)
        _assert_exact(sess.run(None, ins), reference.rotary_quantize_kv_cache(**ins, **attrs))


@pytest.mark.parametrize("interleaved", [0, 1])
def test_hand_computed_values(interleaved):
    """One token, Hq = Hkv = 1, D = 4, R = 4: the rotation by 90 degrees (c = 0, s = 1) on pair 0 and
    identity (c = 1, s = 0) on pair 1, worked out by hand; K's codes and scale too."""
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    qkv = np.concatenate([x, 2 * x, x])[None, :]  # Q = x, K = 2x, V = x
    cos = np.array([[0.0, 1.0]], np.float32)
    sin = np.array([[1.0, 0.0]], np.float32)
    if interleaved:  # pairs (x0, x1), (x2, x3): (x0 c0 - x1 s0, x1 c0 + x0 s0) = (-2, 1); then (3, 4)
        rotated = [-2.0, 1.0, 3.0, 4.0]
    else:  # pairs (x0, x2), (x1, x3): y0 = x0 c0 - x2 s0 = -3, y2 = x2 c0 + x0 s0 = 1; y1 = 2, y3 = 4
        rotated = [-3.0, 2.0, 1.0, 4.0]
    ins = {"qkv": qkv, "cos": cos, "sin": sin, "slot_mapping": np.array([1], np.int64),
           "key_cache": np.zeros((1, 1, 2, 4), np.int8), "value_cache": np.zeros((1, 1, 4, 2), np.int8),
           "key_scale": np.zeros((1, 1, 2), np.float32), "value_scale": np.zeros((1, 1, 2), np.float32)}
    for got in (run_single_op(SCHEMA, ins, num_heads=1, kv_num_heads=1, interleaved=interleaved),
                reference.rotary_quantize_kv_cache(**ins, num_heads=1, kv_num_heads=1, interleaved=interleaved)):
        np.testing.assert_array_equal(got[0][0, 0], rotated)
        k = 2 * np.array(rotated)  # amax 8: scale 8/127, codes rint(k * 127/8)
        np.testing.assert_array_equal(got[1][0, 0, 1], np.rint(k * 127 / 8).astype(np.int8))
        assert got[3][0, 0, 1] == np.float32(8) / np.float32(127) and got[3][0, 0, 0] == 0
        np.testing.assert_array_equal(got[2][0, 0, :, 1], [32, 64, 95, 127])  # V = x, amax 4
        np.testing.assert_array_equal(got[2][0, 0, :, 0], 0)


def test_skipped_tokens_rotate_query_but_are_not_stored(rng):
    """A token with a negative slot still gets its query; its K/V are never read (NaN there is no
    error) and nothing of it reaches the cache."""
    ins = _inputs(rng, 5, 4, 2, 64, 32, skip=0.0)
    ins["slot_mapping"][[1, 3]] = -1
    d = 64
    ins["qkv"][1, 4 * d + 3] = np.nan   # K of a skipped token
    ins["qkv"][3, 6 * d + 10] = np.inf  # V of a skipped token
    clean = dict(ins, qkv=ins["qkv"].copy())
    clean["qkv"][1, 4 * d + 3] = clean["qkv"][3, 6 * d + 10] = 0.0
    got = run_single_op(SCHEMA, ins, num_heads=4, kv_num_heads=2)
    _assert_exact(got[1:], reference.rotary_quantize_kv_cache(**clean, num_heads=4, kv_num_heads=2)[1:], CACHE_NAMES)
    _assert_exact(got, reference.rotary_quantize_kv_cache(**ins, num_heads=4, kv_num_heads=2))
    assert np.all(np.isfinite(got[0][[1, 3]]))  # their Q is clean, so their query is too


def test_non_finite_query_is_not_an_error(rng):
    ins = _inputs(rng, 3, 2, 1, 64, 32, skip=0.0)
    ins["qkv"][0, 5] = np.nan
    ins["qkv"][2, 64 + 40] = np.inf  # Q head 1 (R = D: a rotated dim, so its pair partner is non-finite too)
    got = run_single_op(SCHEMA, ins, num_heads=2, kv_num_heads=1)
    _assert_exact(got, reference.rotary_quantize_kv_cache(**ins, num_heads=2, kv_num_heads=1))
    assert np.isnan(got[0][0, 0, 5]) and not np.all(np.isfinite(got[0][2, 1]))


def _bound_session(ins, attrs, same_buffers: bool):
    """QuantizeKVCache's IOBinding runner on this op; returns (cache inputs, separate cache
    outputs, query)."""
    values, outs, others = qkv_tests._bound_session(ins, same_buffers, SCHEMA, **attrs)
    return values, outs, others["query"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_in_place_through_iobinding(rng, dtype):
    """Caches bound in place: only the live tokens' slots change, in the same buffers."""
    n, b = 6, 16
    ins = _inputs(rng, 9, 4, 2, 128, 32, n=n, b=b, dtype=dtype)
    want = reference.rotary_quantize_kv_cache(**ins, num_heads=4, kv_num_heads=2)
    old = {name: ins[name].copy() for name in CACHE_NAMES}
    values, _, query = _bound_session(ins, {"num_heads": 4, "kv_num_heads": 2}, same_buffers=True)
    ptrs = {name: values[name].data_ptr() for name in CACHE_NAMES}
    got = [values[name].numpy() for name in CACHE_NAMES]
    _assert_exact([query, *got], want)
    assert all(values[name].data_ptr() == ptrs[name] for name in CACHE_NAMES)
    written = np.zeros(n * b, bool)
    written[ins["slot_mapping"][ins["slot_mapping"] >= 0]] = True
    by_slot = {"key_cache": lambda a: a.transpose(0, 2, 1, 3).reshape(n * b, -1),
               "value_cache": lambda a: a.transpose(0, 3, 1, 2).reshape(n * b, -1),
               "key_scale": lambda a: a.transpose(0, 2, 1).reshape(n * b, -1),
               "value_scale": lambda a: a.transpose(0, 2, 1).reshape(n * b, -1)}
    for name, g in zip(CACHE_NAMES, got):
        np.testing.assert_array_equal(by_slot[name](g)[~written], by_slot[name](old[name])[~written], err_msg=name)


def test_separate_output_buffers_copy(rng):
    """Cache outputs in fresh buffers: a full copy plus the new slots; the inputs are untouched."""
    ins = _inputs(rng, 7, 2, 2, 64, 16, n=4, b=8)
    old = {name: ins[name].copy() for name in CACHE_NAMES}
    values, outs, query = _bound_session(ins, {"num_heads": 2, "kv_num_heads": 2, "interleaved": 1},
                                         same_buffers=False)
    want = reference.rotary_quantize_kv_cache(**ins, num_heads=2, kv_num_heads=2, interleaved=1)
    _assert_exact([query, *(outs[n].numpy() for n in CACHE_NAMES)], want)
    for name in CACHE_NAMES:
        np.testing.assert_array_equal(values[name].numpy(), old[name], err_msg=name)


# ------------------------------------------------------------------ against ORT's stock graph

def _stock_session(dtype, t, hq, hkv, d, half, interleaved, n, b):
    """Split -> com.microsoft.RotaryEmbedding (Q and K, [1, T, H*D], position_ids 0..T-1 into the
    per-token cos/sin) -> Reshape -> ort_ops.QuantizeKVCache: the graph the op replaces."""
    from ort_ops._lib import session_options

    tp = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    i64 = lambda name, v: helper.make_tensor(name, helper.TensorProto.INT64, [len(v)], v)  # noqa: E731
    rope = {"interleaved": interleaved}
    if 2 * half < d:
        rope["rotary_embedding_dim"] = 2 * half
    nodes = [helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=1),
             helper.make_node("Unsqueeze", ["q", "zero"], ["q3"]),
             helper.make_node("Unsqueeze", ["k", "zero"], ["k3"]),
             helper.make_node("RotaryEmbedding", ["q3", "pos", "cos", "sin"], ["qr"], domain="com.microsoft",
                              num_heads=hq, **rope),
             helper.make_node("RotaryEmbedding", ["k3", "pos", "cos", "sin"], ["kr"], domain="com.microsoft",
                              num_heads=hkv, **rope),
             helper.make_node("Reshape", ["qr", "q_shape"], ["query"]),
             helper.make_node("Reshape", ["kr", "kv_shape"], ["key"]),
             helper.make_node("Reshape", ["v", "kv_shape"], ["value"]),
             quantize_kv_cache.SCHEMA.make_node(["key", "value", "slot_mapping", *CACHE_NAMES])]
    inits = [i64("split", [hq * d, hkv * d, hkv * d]), i64("zero", [0]), i64("q_shape", [t, hq, d]),
             i64("kv_shape", [t, hkv, d])]
    vi = helper.make_tensor_value_info
    inputs = [vi("qkv", tp, [t, (hq + 2 * hkv) * d]), vi("pos", helper.TensorProto.INT64, [1, t]),
              vi("cos", tp, [t, half]), vi("sin", tp, [t, half]),
              vi("slot_mapping", helper.TensorProto.INT64, [t]),
              vi("key_cache", helper.TensorProto.INT8, [n, hkv, b, d]),
              vi("value_cache", helper.TensorProto.INT8, [n, hkv, d, b]),
              vi("key_scale", helper.TensorProto.FLOAT, [n, hkv, b]),
              vi("value_scale", helper.TensorProto.FLOAT, [n, hkv, b])]
    outputs = [onnx.ValueInfoProto(name=name) for name in ("query", *(c + "_out" for c in CACHE_NAMES))]
    graph = helper.make_graph(nodes, "unfused_prologue", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid("com.microsoft", 1),
                                             helper.make_opsetid(DOMAIN, OPSET_VERSION)])
    return ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


def _ulps(a, b):
    """|a - b| in units of the last place of b's dtype (at b's magnitude)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return np.abs(a64 - b64) / np.spacing(np.abs(b).astype(b.dtype)).astype(np.float64)


def _operand_magnitude(x, cos, sin, half, interleaved):
    """|a c| + |b s| of each rotated output (|x| for pass-through dims), float64 [T, H, D]."""
    x = np.abs(x.astype(np.float64))
    c, s = np.abs(cos.astype(np.float64))[:, None, :], np.abs(sin.astype(np.float64))[:, None, :]
    mag = x.copy()
    i, j = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else (slice(0, half), slice(half, 2 * half))
    mag[..., i] = x[..., i] * c + x[..., j] * s
    mag[..., j] = x[..., j] * c + x[..., i] * s
    return mag


@pytest.mark.parametrize("hq,hkv,d,half", [(8, 2, 64, 32), (4, 4, 128, 32), (4, 1, 128, 64)],
                         ids=["gqa4-d64", "mha-d128-partial", "gqa4-d128"])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_within_bound_of_stock_rotary_embedding_graph(rng, dtype, interleaved, hq, hkv, d, half):
    """DESIGN.md's bound against ORT's own RotaryEmbedding chain (its float32 kernel fuses a
    multiply-add): query within ROTARY_QKV_F32_QUERY_REL_OPERANDS of the operands (float32) or
    ROTARY_QKV_F16_QUERY_ULPS ulps (float16), codes within ROTARY_QKV_CODE_STEPS, scales within
    ROTARY_QKV_SCALE_ULPS float32 ulps."""
    t, n, b = 37, 6, 16
    ins = _inputs(rng, t, hq, hkv, d, half, n=n, b=b, dtype=dtype)
    sess = _stock_session(dtype, t, hq, hkv, d, half, interleaved, n, b)
    stock = sess.run(None, dict(ins, pos=np.arange(t, dtype=np.int64)[None, :]))
    got = run_single_op(SCHEMA, ins, num_heads=hq, kv_num_heads=hkv, interleaved=interleaved)
    if dtype == np.float32:
        q = ins["qkv"].reshape(t, hq + 2 * hkv, d)[:, :hq]
        mag = _operand_magnitude(q, ins["cos"], ins["sin"], half, interleaved)
        diff = np.abs(got[0].astype(np.float64) - stock[0].astype(np.float64))
        assert np.all(diff <= ROTARY_QKV_F32_QUERY_REL_OPERANDS * mag)
    else:
        assert np.max(_ulps(got[0], stock[0])) <= ROTARY_QKV_F16_QUERY_ULPS
    for i in (1, 2):
        assert np.max(np.abs(got[i].astype(np.int32) - stock[i].astype(np.int32))) <= ROTARY_QKV_CODE_STEPS
    for i in (3, 4):
        assert np.max(_ulps(got[i], stock[i])) <= ROTARY_QKV_SCALE_ULPS


# ------------------------------------------------------------------ refusals

def _run_both(ins, match, **attrs):
    """The op and the reference both refuse ``ins`` with ``match``."""
    attrs = {"num_heads": 4, "kv_num_heads": 2, **attrs}
    with pytest.raises(Exception, match="RotaryQuantizeKVCache: " + match):
        run_single_op(SCHEMA, ins, **attrs)
    with pytest.raises(ValueError, match="RotaryQuantizeKVCache: "):
        reference.rotary_quantize_kv_cache(**ins, **attrs)


@pytest.mark.parametrize("slot", [96, 1000])
def test_slot_out_of_range(rng, slot):
    ins = _inputs(rng, 3, 4, 2, 64, 32, skip=0.0)
    ins["slot_mapping"][1] = slot
    _run_both(ins, rf"input 'slot_mapping' must hold slots < 96 \(num_blocks \* block_size\), "
                   rf"got slot_mapping\[1\] = {slot}")


def test_repeated_slot(rng):
    ins = _inputs(rng, 3, 4, 2, 64, 32, skip=0.0)
    ins["slot_mapping"][:] = [5, 9, 5]
    _run_both(ins, r"input 'slot_mapping' must not repeat a slot, got slot 5 twice")


@pytest.mark.parametrize("where,what", [(4 * 64 + 64 + 3, r"the K \(after rotation\)"), (6 * 64 + 70, "the V")],
                         ids=["key", "value"])
def test_non_finite_k_or_v_leaves_bound_cache_untouched(rng, where, what):
    ins = _inputs(rng, 5, 4, 2, 64, 32, skip=0.0)
    ins["qkv"][4, where] = np.nan  # kv head 1 of token 4
    old = {name: ins[name].copy() for name in CACHE_NAMES}
    match = rf"RotaryQuantizeKVCache: input 'qkv' must be finite in {what} of a live token, got NaN or Inf in token 4, kv head 1"
    with pytest.raises(Exception, match=match):
        _bound_session(ins, {"num_heads": 4, "kv_num_heads": 2}, same_buffers=True)
    with pytest.raises(ValueError, match=match):
        reference.rotary_quantize_kv_cache(**ins, num_heads=4, kv_num_heads=2)
    for name in CACHE_NAMES:
        np.testing.assert_array_equal(ins[name], old[name], err_msg=name)


def test_rotation_overflow_in_k_is_refused(rng):
    """Finite K whose rotation overflows float16 (|y| > 65504) is non-finite after rotation."""
    ins = _inputs(rng, 2, 4, 2, 64, 32, dtype=np.float16, skip=0.0)
    ins["qkv"][1, 4 * 64 + 0] = 60000.0
    ins["qkv"][1, 4 * 64 + 32] = 60000.0
    ins["cos"][1, 0] = 1.0
    ins["sin"][1, 0] = 1.0  # y[32] = 60000 + 60000 = inf in float16
    _run_both(ins, r"input 'qkv' must be finite in the K \(after rotation\) of a live token, got NaN or Inf in token 1, kv head 0")


@pytest.mark.parametrize("change,match", [
    (lambda i: dict(i, qkv=i["qkv"][None]), r"input 'qkv' must have rank 2, got shape \[1, 3, 512\]"),
    (lambda i: dict(i, qkv=i["qkv"][:, :500].copy()),
     r"input 'qkv' must have a last dim \(num_heads \+ 2 \* kv_num_heads\) \* head_dim = 8 \* head_dim with head_dim > 0, got 500"),
    (lambda i: dict(i, cos=i["cos"][:2].copy()),
     r"input 'cos' must have shape \[3, R/2\] with 1 <= R/2 <= head_dim/2 = 32, got \[2, 32\]"),
    (lambda i: dict(i, cos=np.zeros((3, 33), np.float32), sin=np.zeros((3, 33), np.float32)),
     r"input 'cos' must have shape \[3, R/2\] with 1 <= R/2 <= head_dim/2 = 32, got \[3, 33\]"),
    (lambda i: dict(i, cos=np.zeros((3, 0), np.float32), sin=np.zeros((3, 0), np.float32)),
     r"input 'cos' must have shape \[3, R/2\] with 1 <= R/2 <= head_dim/2 = 32, got \[3, 0\]"),
    (lambda i: dict(i, sin=i["sin"][:, :16].copy()), r"input 'sin' must have shape \[3, 32\], got \[3, 16\]"),
    (lambda i: dict(i, cos=i["cos"].astype(np.float16)),
     r"input 'cos' must have the dtype of 'qkv' \(float32\), got float16"),
    (lambda i: dict(i, sin=i["sin"].astype(np.float16)),
     r"input 'sin' must have the dtype of 'qkv' \(float32\), got float16"),
    (lambda i: dict(i, key_cache=np.zeros((6, 1, 16, 64), np.int8)),
     r"input 'key_cache' must have shape \[6, 2, 16, 64\], got \[6, 1, 16, 64\]"),
    (lambda i: dict(i, value_cache=np.zeros((6, 2, 128, 16), np.int8)),
     r"input 'value_cache' must have shape \[6, 2, 64, 16\], got \[6, 2, 128, 16\]"),
    (lambda i: dict(i, key_scale=np.zeros((6, 2, 8), np.float32)),
     r"input 'key_scale' must have shape \[6, 2, 16\], got \[6, 2, 8\]"),
    (lambda i: dict(i, slot_mapping=i["slot_mapping"][:2].copy()), r"input 'slot_mapping' must have shape \[3\], got \[2\]"),
], ids=["qkv-rank", "qkv-width", "cos-rows", "rotary-wider-than-head", "rotary-empty", "sin-shape", "cos-dtype",
        "sin-dtype", "cache-heads", "cache-head-dim", "scale-block", "slots-len"])
def test_shape_and_dtype_refusals(rng, change, match):
    ins = change(_inputs(rng, 3, 4, 2, 64, 32))
    _run_both(ins, match)


def test_qkv_dtype_refused(rng):
    ins = _inputs(rng, 3, 4, 2, 64, 32)
    ins = dict(ins, qkv=ins["qkv"].astype(np.float64), cos=ins["cos"].astype(np.float64),
               sin=ins["sin"].astype(np.float64))
    _run_both(ins, r"input 'qkv' must be float32 or float16, got float64")


@pytest.mark.parametrize("attrs,match", [
    ({"num_heads": 3, "kv_num_heads": 2}, r"attribute 'num_heads' must be a multiple of 'kv_num_heads' \(2\), got 3"),
    ({"num_heads": 0}, r"attribute 'num_heads' must be given and > 0, got 0"),
    ({"kv_num_heads": -1}, r"attribute 'kv_num_heads' must be given and > 0, got -1"),
    ({"interleaved": 2}, r"attribute 'interleaved' must be 0 or 1, got 2"),
])
def test_attribute_refusals(rng, attrs, match):
    ins = _inputs(rng, 3, 4, 2, 64, 32)
    with pytest.raises(Exception, match="RotaryQuantizeKVCache: " + match):
        run_single_op(SCHEMA, ins, **{"num_heads": 4, "kv_num_heads": 2, **attrs})
    with pytest.raises(ValueError, match="RotaryQuantizeKVCache: attribute"):
        reference.rotary_quantize_kv_cache(**ins, **{"num_heads": 4, "kv_num_heads": 2, **attrs})


def test_missing_attribute_refused(rng):
    ins = _inputs(rng, 3, 4, 2, 64, 32)
    with pytest.raises(Exception, match=r"RotaryQuantizeKVCache: attribute 'kv_num_heads' must be given and > 0, got 0"):
        run_single_op(SCHEMA, ins, num_heads=4)
