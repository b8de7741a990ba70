# SPDX-License-Identifier: MIT
"""SwiGLU on the CPU EP against ort_ops.reference.swiglu (bit-exact), and the contract's bound
against the stock graph it replaces (Split -> com.microsoft.QuickGelu -> Mul)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from ort_ops import reference
from ort_ops.ops import swiglu
from ort_ops.ops._run import make_session, run_single_op
from ort_ops.ops._schema import IR_VERSION, ONNX_OPSET
from tests.conftest import use_isa
from tests.tolerances import (SWIGLU_VS_QUICKGELU_F16_ABS, SWIGLU_VS_QUICKGELU_F16_REL,
                              SWIGLU_VS_QUICKGELU_F32_AB)

ISAS = ["scalar", "avx2"]  # the row kernel and the float16 converters of each
SHAPES = [(2,), (14,), (3, 34), (4, 5, 130), (2, 3, 66), (5, 16384), (7, 2 * 4099)]


def _run(x):
    return run_single_op(swiglu.SCHEMA, {"x": x})[0]


def _assert_exact(got, want):
    """Same dtype and shape, NaN where the reference has NaN, the same bits everywhere else
    (so -0 and +0 differ; NaN payloads are not part of the contract)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_got, nan_want), f"NaN at {np.argwhere(nan_got != nan_want)[:5].tolist()}"
    ui = np.uint32 if got.dtype == np.float32 else np.uint16
    g, w = got.view(ui)[~nan_got], want.view(ui)[~nan_want]
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (f"{bad.size} of {g.size} values differ, first at flat index {bad[0]}: "
                           f"{got[~nan_got][bad[0]]} vs {want[~nan_want][bad[0]]}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_matches_reference(monkeypatch, rng, isa, shape, dtype):
    use_isa(monkeypatch, isa)
    x = (rng.standard_normal(shape) * rng.uniform(0.5, 12)).astype(dtype)
    y = _run(x)
    assert y.shape == shape[:-1] + (shape[-1] // 2,)
    _assert_exact(y, reference.swiglu(x))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_non_finite_and_edge_values_propagate(monkeypatch, isa, dtype):
    """IEEE propagation as the contract says: +Inf gate -> +-Inf, -Inf gate -> NaN, NaN anywhere
    -> NaN, 0 * Inf -> NaN, -0 keeps its sign, the exp clamp's ends (|a| > 87), large products
    that overflow float16 at the final rounding."""
    a = np.array([np.inf, np.inf, -np.inf, np.nan, 1.0, 0.0, -0.0, -0.0, 100.0, -100.0, -87.5, 88.5,
                  200.0, 3.0, -3.0, 1e-3], np.float32)
    b = np.array([2.0, -2.0, 1.0, 1.0, np.nan, np.inf, 1.0, -1.0, 3.0, 3.0, 1.0, -1.0,
                  400.0, np.inf, -np.inf, 0.0], np.float32)
    x = np.concatenate([a, b])[None, :].astype(dtype)
    y = _run(x)
    want = reference.swiglu(x)
    _assert_exact(y, want)
    assert y[0, 0] == np.inf and y[0, 1] == -np.inf
    assert np.isnan(y[0, 2]) and np.isnan(y[0, 3]) and np.isnan(y[0, 4]) and np.isnan(y[0, 5])
    assert y[0, 6] == 0 and np.signbit(y[0, 6]) and not np.signbit(y[0, 7])
    if dtype == np.float16:
        assert y[0, 12] == np.inf  # 200 * 400 = 80000 > float16's max


def test_reference_order_is_the_moe_recipe(rng):
    """The reference is GroupedMatmulSwigluQuant's float32 "swiglu" (ort_ops/ops/_moe.py) on the
    two halves, and within 2e-7 relative of the float64 truth on finite data."""
    from ort_ops.ops._moe import swiglu_f32

    x = (rng.standard_normal((64, 256)) * 8).astype(np.float32)
    a, b = x[:, :128], x[:, 128:]
    _assert_exact(reference.swiglu(x), swiglu_f32(a, b))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = a64 / (1 + np.exp(-a64)) * b64
    big = np.abs(exact) > 1e-30
    assert np.max(np.abs(reference.swiglu(x)[big] - exact[big]) / np.abs(exact[big])) < 2e-7


def _stock_graph(dtype, width):
    """Split -> com.microsoft.QuickGelu(alpha 1) -> Mul on stock ORT: what the rewrite replaces."""
    tp = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Split", ["x"], ["a", "b"], axis=-1, num_outputs=2),
             helper.make_node("QuickGelu", ["a"], ["q"], domain="com.microsoft", alpha=1.0),
             helper.make_node("Mul", ["q", "b"], ["y"])]
    graph = helper.make_graph(nodes, "silu_mul", [helper.make_tensor_value_info("x", tp, [None, width])],
                              [helper.make_tensor_value_info("y", tp, None)])
    model = helper.make_model(graph, ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_within_the_stated_bound_of_quickgelu_mul(rng, dtype):
    """DESIGN.md's bound of the fused op against ORT's CPU QuickGelu + Mul (whose sigmoid is
    MLAS's approximation; in float16 the stock graph also rounds QuickGelu's output)."""
    width = 512
    x = (rng.standard_normal((400, width)) * 6).astype(dtype)
    (want,) = _stock_graph(dtype, width).run(None, {"x": x})
    got = _run(x)
    assert np.isfinite(got).all() and np.isfinite(want).all()
    a = x[:, : width // 2].astype(np.float64)
    b = x[:, width // 2:].astype(np.float64)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if dtype == np.float32:
        bound = SWIGLU_VS_QUICKGELU_F32_AB * np.abs(a * b) + 2.0 ** -23 * np.abs(want.astype(np.float64))
    else:
        bound = (SWIGLU_VS_QUICKGELU_F16_REL * np.abs(want.astype(np.float64))
                 + SWIGLU_VS_QUICKGELU_F16_ABS * (1 + np.abs(b)) + SWIGLU_VS_QUICKGELU_F32_AB * np.abs(a * b))
    over = np.argwhere(diff > bound)
    assert over.size == 0, f"{len(over)} values outside the bound, first at {over[0].tolist()}: {got[tuple(over[0])]} vs {want[tuple(over[0])]}"


def test_empty_tensors():
    assert _run(np.zeros((0, 8), np.float32)).shape == (0, 4)
    assert _run(np.zeros((3, 0), np.float16)).shape == (3, 0)
    assert _run(np.zeros((2, 0, 6), np.float32)).shape == (2, 0, 3)


def test_odd_width_names_the_input():
    with pytest.raises(Exception, match=r"SwiGLU: input 'x' must have an even last dim \(2 \* I\), got 7 \(shape \[2, 7\]\)"):
        _run(np.ones((2, 7), np.float32))
    with pytest.raises(ValueError, match=r"SwiGLU: input 'x' must have an even last dim \(2 \* I\), got 7"):
        reference.swiglu(np.ones((2, 7), np.float32))


def test_wrong_dtype():
    with pytest.raises(Exception, match=r"SwiGLU: input 'x' must be float32 or float16, got int32"):
        _run(np.ones((2, 4), np.int32))
    with pytest.raises(Exception, match=r"SwiGLU: input 'x' must be float32 or float16, got float64"):
        _run(np.ones((2, 4), np.float64))


def test_rank_zero():
    with pytest.raises(Exception, match=r"SwiGLU: input 'x' must have rank >= 1, got a scalar"):
        _run(np.float32(1.0).reshape(()))


def test_session_reused_across_shapes(rng):
    """One session, inputs of different shapes: nothing is cached from the first Run."""
    x0 = rng.standard_normal((2, 16)).astype(np.float32)
    sess = make_session(swiglu.SCHEMA, {"x": x0}, dynamic_shapes=True)
    for shape in [(2, 16), (9, 16), (1, 6), (3, 0)]:
        x = rng.standard_normal(shape).astype(np.float32)
        _assert_exact(sess.run(None, {"x": x})[0], reference.swiglu(x))


def test_multithreaded_equals_reference(rng):
    """Rows split across the intra-op pool (tasks of ~64K outputs) give the same bits."""
    x = rng.standard_normal((300, 2048)).astype(np.float16)
    (y,) = run_single_op(swiglu.SCHEMA, {"x": x}, intra_op_threads=4)
    _assert_exact(y, reference.swiglu(x))
