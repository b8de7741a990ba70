# SPDX-License-Identifier: MIT
"""MoeInitRouting and MoeFinalizeRouting on the CPU EP against their references, and the
routing round trip: InitRouting then FinalizeRouting with identity experts gives
sum_j w[m, j] * x[m] (plus the residual)."""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from ort_ops.ops import moe_finalize_routing as fin
from ort_ops.ops import moe_init_routing as init
from ort_ops.ops._run import run_single_op
from tests.tolerances import MOE_FLOAT_EXACT_ATOL

CASES = [(1, 4, 1, 1), (7, 33, 2, 8), (64, 128, 8, 64), (129, 5, 2, 3), (0, 16, 2, 4)]  # M, H, K, E


def _ids(rng, m, k, e):
    """Distinct experts per token (as top-k gives) when k <= e."""
    rows = [rng.permutation(e)[:k] for _ in range(m)]
    return np.array(rows, np.int32).reshape(m, k)


def _init(x, ids, e, x_scale=None):
    return run_single_op(init.SCHEMA, {"x": x, "expert_ids": ids, "x_scale": x_scale}, num_experts=e)


def _fin(eo, s2f, w, residual=None):
    return run_single_op(fin.SCHEMA, {"expert_out": eo, "sorted_to_flat": s2f, "topk_weights": w,
                                      "residual": residual})[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-H{}-K{}-E{}".format(*c))
def test_init_routing_matches_reference(rng, case, dtype):
    m, h, k, e = case
    x = rng.standard_normal((m, h)).astype(dtype)
    ids = _ids(rng, m, k, e)
    got = _init(x, ids, e)
    want = reference.moe_init_routing(x, ids, e)
    assert got[0].dtype == dtype and got[1].dtype == np.int32 and got[2].dtype == np.int64
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-H{}-K{}-E{}".format(*c))
def test_int8_rows_then_routing_equals_routing_then_quantization(rng, case):
    """The lean chain: DynamicQuant of the M token rows, then MoeInitRouting of the int8 rows and
    their scales, gives the codes and scales of MoeInitRouting then DynamicQuant of the M*K
    gathered rows, bit for bit (row quantization commutes with the row gather)."""
    from ort_ops.ops import dynamic_quant as dq

    m, h, k, e = case
    x = (rng.standard_normal((m, h)) * rng.uniform(0.1, 10.0, (m, 1))).astype(np.float32)
    ids = _ids(rng, m, k, e)
    tq, ts = run_single_op(dq.SCHEMA, {"x": x})
    xq, s2f, gl, xs = _init(tq, ids, e, ts)
    want = reference.moe_init_routing(tq, ids, e, ts)
    for g, w in zip((xq, s2f, gl, xs), want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    sorted_x, rs2f, rgl = reference.moe_init_routing(x, ids, e)
    rq, rs = reference.dynamic_quant(sorted_x)
    np.testing.assert_array_equal(xq, rq)
    np.testing.assert_array_equal(xs.view(np.int32), rs.view(np.int32))
    np.testing.assert_array_equal(s2f, rs2f)
    np.testing.assert_array_equal(gl, rgl)


def test_init_routing_x_scale_goes_with_int8_x(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    ids = np.zeros((3, 2), np.int32)
    q = rng.integers(-127, 128, (3, 4), dtype=np.int8)
    s = np.ones(3, np.float32)
    with pytest.raises(Exception, match=r"MoeInitRouting: input 'x_scale' must be given exactly when 'x' is int8"):
        _init(q, ids, 4)
    with pytest.raises(Exception, match=r"MoeInitRouting: input 'x_scale' must be given exactly when 'x' is int8"):
        _init(x, ids, 4, s)
    with pytest.raises(Exception, match=r"MoeInitRouting: input 'x_scale' must have shape \[3\], got \[2\]"):
        _init(q, ids, 4, s[:2])
    with pytest.raises(ValueError, match=r"input 'x_scale' must be given exactly when 'x' is int8"):
        reference.moe_init_routing(q, ids, 4)


def test_init_routing_is_stable_with_repeats(rng):
    """Repeated experts within a token (k > E) keep flat order inside each group."""
    ids = rng.integers(0, 2, (20, 5)).astype(np.int32)
    x = rng.standard_normal((20, 3)).astype(np.float32)
    _, s2f, gl = _init(x, ids, 2)
    flat = ids.reshape(-1)
    assert gl.tolist() == [int((flat == 0).sum()), 100]
    for lo, hi in [(0, gl[0]), (gl[0], gl[1])]:
        assert np.all(np.diff(s2f[lo:hi]) > 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-H{}-K{}-E{}".format(*c))
def test_finalize_routing_matches_reference(rng, case, residual, dtype):
    m, h, k, _e = case
    eo = rng.standard_normal((m * k, h)).astype(dtype)
    s2f = rng.permutation(m * k).astype(np.int32)
    w = rng.uniform(0, 1, (m, k)).astype(dtype)
    res = rng.standard_normal((m, h)).astype(dtype) if residual else None
    got = _fin(eo, s2f, w, res)
    want = reference.moe_finalize_routing(eo, s2f, w, res)
    assert got.dtype == np.float32
    assert np.max(np.abs(got - want), initial=0) <= MOE_FLOAT_EXACT_ATOL


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "M{}-H{}-K{}-E{}".format(*c))
def test_round_trip_identity_experts(rng, case):
    m, h, k, e = case
    x = rng.standard_normal((m, h)).astype(np.float32)
    ids = _ids(rng, m, k, e)
    w = rng.uniform(0, 1, (m, k)).astype(np.float32)
    res = rng.standard_normal((m, h)).astype(np.float32)
    sorted_x, s2f, _ = _init(x, ids, e)
    out = _fin(sorted_x, s2f, w, res)
    want = res.copy()
    for j in range(k):  # the recipe's order: residual, then slot 0, 1, ...
        want = (want + (w[:, j:j + 1] * x).astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_allclose(out, res + w.sum(1, keepdims=True) * x, rtol=1e-5, atol=1e-5)


def test_init_routing_errors(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    bad = np.array([[0, 1], [2, 4], [1, 0]], np.int32)
    with pytest.raises(Exception, match=r"MoeInitRouting: input 'expert_ids' must be in \[0, 4\), got 4 at token 1, slot 1"):
        _init(x, bad, 4)
    with pytest.raises(ValueError, match=r"input 'expert_ids' must be in \[0, 4\), got 4 at token 1, slot 1"):
        reference.moe_init_routing(x, bad, 4)
    with pytest.raises(Exception, match=r"MoeInitRouting: input 'expert_ids' must have shape \[3, K\]"):
        _init(x, np.zeros((2, 2), np.int32), 4)
    with pytest.raises(Exception, match=r"MoeInitRouting: input 'x' must be float32 or float16 or int8, got float64"):
        _init(x.astype(np.float64), np.zeros((3, 2), np.int32), 4)
    with pytest.raises(Exception, match=r"expert_ids"):  # fixed int32: ORT refuses at session creation
        _init(x, np.zeros((3, 2), np.int64), 4)
    with pytest.raises(Exception, match=r"MoeInitRouting: attribute 'num_experts' must be given and >= 1, got 0"):
        _init(x, np.zeros((3, 2), np.int32), 0)


def test_finalize_routing_errors(rng):
    eo = rng.standard_normal((6, 4)).astype(np.float32)
    w = rng.uniform(0, 1, (3, 2)).astype(np.float32)
    for perm, shown in [([0, 1, 2, 3, 4, 4], "got 4 at index 5"), ([0, 1, 2, 3, 4, 6], "got 6 at index 5"),
                        ([0, 1, -1, 3, 4, 5], "got -1 at index 2")]:
        s2f = np.array(perm, np.int32)
        with pytest.raises(Exception, match=r"MoeFinalizeRouting: input 'sorted_to_flat' must be a permutation of \[0, 6\), " + shown):
            _fin(eo, s2f, w)
        with pytest.raises(ValueError, match=shown):
            reference.moe_finalize_routing(eo, s2f, w)
    s2f = np.arange(6, dtype=np.int32)
    with pytest.raises(Exception, match=r"MoeFinalizeRouting: input 'expert_out' must have shape \[6, 4\], got \[5, 4\]"):
        _fin(eo[:5], s2f, w)
    with pytest.raises(Exception, match=r"MoeFinalizeRouting: input 'residual' must have shape \[3, 4\], got \[3, 5\]"):
        _fin(eo, s2f, w, np.zeros((3, 5), np.float32))
    with pytest.raises(Exception, match=r"MoeFinalizeRouting: input 'topk_weights' must be float32 or float16, got int32"):
        _fin(eo, s2f, w.astype(np.int32))
    with pytest.raises(Exception, match=r"MoeFinalizeRouting: input 'sorted_to_flat' must be int32, got int64"):
        _fin(eo, s2f.astype(np.int64), w)
