# SPDX-License-Identifier: MIT
"""DynamicQuant on the CPU EP against ort_ops.reference.dynamic_quant (bit-exact codes and scales)."""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from ort_ops.ops import dynamic_quant
from ort_ops.ops._run import make_session, run_single_op
from tests.conftest import use_isa

ISAS = ["scalar", "avx2"]  # DynamicQuant has these two row kernels; VNNI levels use the AVX2 one
SHAPES = [(1,), (7,), (3, 33), (4, 5, 129), (2, 1, 3, 64), (5, 16384)]


def _run(x, smooth=None):
    return run_single_op(dynamic_quant.SCHEMA, {"x": x, "smooth_scale": smooth})


def _assert_exact(got, want):
    y, s = got
    ry, rs = want
    assert y.dtype == np.int8 and s.dtype == np.float32
    assert y.shape == ry.shape and s.shape == rs.shape
    bad = np.argwhere(y != ry)
    assert bad.size == 0, f"{len(bad)} codes differ, first at {bad[:5].tolist()}: {y[tuple(bad[0])]} vs {ry[tuple(bad[0])]}"
    np.testing.assert_array_equal(s, rs)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("smooth", [False, True])
def test_matches_reference(monkeypatch, rng, isa, shape, dtype, smooth):
    use_isa(monkeypatch, isa)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(dtype)
    sm = rng.uniform(0.5, 2.0, shape[-1]).astype(dtype) if smooth else None
    _assert_exact(_run(x, sm), reference.dynamic_quant(x, sm))


@pytest.mark.parametrize("isa", ISAS)
def test_edge_rows(monkeypatch, rng, isa):
    """Zero rows (scale 0, codes 0), a row with one non-zero, negative-only rows, tiny values."""
    use_isa(monkeypatch, isa)
    k = 77
    x = rng.standard_normal((6, k)).astype(np.float32)
    x[0] = 0.0
    x[1] = 0.0
    x[1, 40] = -3.5
    x[2] = -np.abs(x[2])
    x[3] *= 1e-30  # subnormal-range scales still follow the rule
    x[4] = 0.0
    x[4, 0] = 1e30
    y, s = _run(x)
    _assert_exact((y, s), reference.dynamic_quant(x))
    assert s[0] == 0 and not y[0].any()
    assert y[1, 40] == -127 and np.count_nonzero(y[1]) == 1


@pytest.mark.parametrize("isa", ISAS)
def test_half_way_values_round_to_even(monkeypatch, isa):
    """Values landing exactly on n + 0.5 after scaling round half to even, as np.rint does.

    With amax = 127 the factor 127 / amax is exactly 1, so x * inv is x itself and each x.5 is a
    true tie: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2, 126.5 -> 126.
    """
    use_isa(monkeypatch, isa)
    ties = np.array([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 126.5, -126.5, 64.5], np.float32)
    row = np.concatenate([[127.0], ties, ties, ties, ties]).astype(np.float32)  # > 32: SIMD body
    y, s = _run(row[None, :])
    want = np.concatenate([[127], [0, 2, 2, 4, 0, -2, -2, 126, -126, 64] * 4]).astype(np.int8)
    np.testing.assert_array_equal(y[0], want)
    assert s[0] == np.float32(1.0)
    _assert_exact((y, s), reference.dynamic_quant(row[None, :]))


@pytest.mark.parametrize("isa", ISAS)
def test_large_rows(monkeypatch, rng, isa):
    use_isa(monkeypatch, isa)
    x = rng.standard_normal((33, 16384)).astype(np.float32)
    x[5, 123] = 1000.0  # one outlier dominates a row's scale
    _assert_exact(_run(x), reference.dynamic_quant(x))


def test_empty_tensors(rng):
    y, s = _run(np.zeros((0, 8), np.float32))
    assert y.shape == (0, 8) and s.shape == (0,)
    y, s = _run(np.zeros((3, 0), np.float32))
    assert y.shape == (3, 0) and s.shape == (3,) and not s.any()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_fails_the_run(monkeypatch, rng, isa, bad):
    use_isa(monkeypatch, isa)
    x = rng.standard_normal((4, 40)).astype(np.float32)
    x[2, 37] = bad  # in the scalar tail of the AVX2 kernel
    with pytest.raises(Exception, match=r"DynamicQuant: row 2 of input 'x' has a non-finite value"):
        _run(x)
    x = rng.standard_normal((4, 40)).astype(np.float32)
    x[3, 3] = bad  # in its SIMD body
    with pytest.raises(Exception, match=r"row 3 of input 'x' has a non-finite value"):
        _run(x)
    with pytest.raises(ValueError, match="non-finite"):
        reference.dynamic_quant(x)


def test_overflowing_smooth_product_fails(rng):
    x = np.full((2, 16), 3e38, np.float32)
    with pytest.raises(Exception, match=r"\(times 'smooth_scale'\) has a non-finite value"):
        _run(x, np.full(16, 10.0, np.float32))


def test_wrong_dtype():
    with pytest.raises(Exception, match=r"DynamicQuant: input 'x' must be float32 or float16, got int32"):
        _run(np.ones((2, 3), np.int32))
    with pytest.raises(Exception, match=r"DynamicQuant: input 'smooth_scale' must be float32 or float16, got float64"):
        _run(np.ones((2, 3), np.float32), np.ones(3, np.float64))


def test_wrong_smooth_length():
    with pytest.raises(Exception, match=r"DynamicQuant: input 'smooth_scale' must have shape \[3\], got \[4\]"):
        _run(np.ones((2, 3), np.float32), np.ones(4, np.float32))


def test_rank_zero():
    with pytest.raises(Exception, match=r"DynamicQuant: input 'x' must have rank >= 1, got a scalar"):
        _run(np.float32(1.0).reshape(()))


def test_session_reused_across_shapes(rng):
    """One session, inputs of different shapes: nothing is cached from the first Run."""
    x0 = rng.standard_normal((2, 16)).astype(np.float32)
    sess = make_session(dynamic_quant.SCHEMA, {"x": x0}, dynamic_shapes=True)
    for shape in [(2, 16), (9, 16), (1, 16)]:
        x = rng.standard_normal(shape).astype(np.float32)
        _assert_exact(sess.run(None, {"x": x}), reference.dynamic_quant(x))


def test_unknown_isa_is_refused(monkeypatch):
    monkeypatch.setenv("ORT_OPS_CPU_ISA", "sse9")
    with pytest.raises(Exception, match=r"ORT_OPS_CPU_ISA must be one of scalar, avx2"):
        _run(np.ones((2, 3), np.float32))
