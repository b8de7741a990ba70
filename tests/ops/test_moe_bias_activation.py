# SPDX-License-Identifier: MIT
"""The optional bias input of GroupedMatmulSwigluQuant and GroupedMatmulDequant and GMSQ's
activation "swiglu_oai" (gpt-oss's clamped SwiGLU, attributes alpha and limit) on the CPU EP,
bit for bit against ort_ops.reference on every GEMM variant and weight layout.

The products C are made large on purpose (|C| up to ~60, against the default limit 7), so that
many gate values lie above the limit and many up values beyond +-limit: every test asserts that
its data reaches past the clamp on both sides before comparing. The reference's "swiglu_oai" is
itself checked against gpt-oss's formula in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from ort_ops.ops import grouped_matmul_dequant as gmd
from ort_ops.ops import grouped_matmul_swiglu_quant as gmsq
from ort_ops.ops._moe import exp_f32, grouped_dequant_matmul, pack_en16k4
from ort_ops.ops._run import run_single_op
from tests.ops.conftest import use_gemm_isa
from tests.ops.test_grouped_matmul_swiglu_quant import assert_exact, count_ties

# (M, K, N, E, group_list): one row; empty experts; few-row experts (the GEMV route, <= 6 rows)
# beside tile-sized ones; N/2 not a multiple of 64; rows past the last group end.
CASES = [
    (1, 40, 8, 1, [1]),
    (9, 33, 10, 3, [0, 9, 9]),
    (12, 64, 36, 4, [1, 3, 3, 10]),
    (70, 130, 300, 3, [2, 50, 64]),
]
ACTS = [{}, {"activation": "swiglu"}, {"activation": "swiglu_oai"},
        {"activation": "swiglu_oai", "alpha": 1.0, "limit": 3.0},
        {"activation": "swiglu_oai", "alpha": 2.5, "limit": 20.0}]
ACT_IDS = ["default", "swiglu", "oai", "oai-a1-l3", "oai-a2.5-l20"]


def make_inputs(rng, m, k, n, e, group_list, *, bias=True):
    """Codes in [-127, 127] and scales that put C in about [-60, 60]; a bias in [-8, 8]."""
    x = rng.integers(-127, 128, (m, k)).astype(np.int8)
    w = rng.integers(-127, 128, (e, k, n)).astype(np.int8)
    spread = 1.0 / (74.0 * 74.0 * np.sqrt(k))  # |acc| ~ 74^2 sqrt(K): C ~ xs * ws * that
    ws = (rng.uniform(0.5, 4.0, (e, n)) * np.sqrt(spread)).astype(np.float32)
    xs = (rng.uniform(0.5, 4.0, m) * np.sqrt(spread) * 6.0).astype(np.float32)
    # Row 0 against all-127 / all -127 weight columns at the largest scales: its gate column 0 lies
    # far above any limit (|C| > 1000 for K >= 33), its up column N/2 far below and N/2 + 1 far
    # above, whatever the random draw.
    if m and n >= 4:
        x[0] = 127
        xs[0] = 4.0 * np.sqrt(spread) * 6.0
        for col, sign in ((0, 1), (n // 2, -1), (n // 2 + 1, 1)):
            w[:, :, col] = 127 * sign
            ws[:, col] = 4.0 * np.sqrt(spread)
    ins = {"x": x, "weight": w, "weight_scale": ws, "x_scale": xs, "group_list": np.asarray(group_list, np.int64)}
    if bias:
        ins["bias"] = rng.uniform(-8.0, 8.0, (e, n)).astype(np.float32)
    return ins


def assert_reaches_clamp(ins, limit):
    """The test's products (bias included) reach the clamp: a gate value above the limit and up
    values past it on both sides (row 0's forced columns guarantee them; the random rows add more
    at the smaller limits)."""
    c, valid = grouped_dequant_matmul("t", ins["x"], ins["weight"], ins["weight_scale"], ins["x_scale"],
                                      ins["group_list"], 0, ins.get("bias"))
    c = c[valid]
    h = c.shape[1] // 2
    assert np.any(c[:, :h] > limit), f"no gate value above {limit}"
    assert np.any(c[:, h:] > limit) and np.any(c[:, h:] < -limit), f"no up values past +-{limit}"


def _weight(ins, layout):
    w = ins["weight"]
    if layout == "ENK":
        return dict(ins, weight=np.ascontiguousarray(w.transpose(0, 2, 1)))
    if layout == "EN16K4":
        return dict(ins, weight=pack_en16k4(w))
    return ins


def test_oai_reference_is_gpt_oss_formula():
    """The float32 recipe of "swiglu_oai" against gpt-oss's expression in float64 (to float32
    rounding): glu = a * sigmoid(alpha * a), out = (g + 1) * glu, a = min(A, limit),
    g = clamp(G, -limit, limit)."""
    rng = np.random.default_rng(5)
    a = rng.uniform(-30, 30, 20000).astype(np.float32)
    g = rng.uniform(-30, 30, 20000).astype(np.float32)
    for alpha, limit in [(1.702, 7.0), (1.0, 3.0), (0.5, 100.0)]:
        got = gmsq.swiglu_oai_f32(a, g, alpha, limit).astype(np.float64)
        a64 = np.minimum(a.astype(np.float64), np.float64(np.float32(limit)))
        g64 = np.clip(g.astype(np.float64), -np.float64(np.float32(limit)), np.float64(np.float32(limit)))
        want = (g64 + 1) * a64 / (1 + np.exp(-np.float64(np.float32(alpha)) * a64))
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
    # exp_f32 clamps its argument at -87: a huge negative alpha * a stays finite (S -> 0).
    assert np.isfinite(exp_f32(np.float32(-1e30)))


@pytest.mark.parametrize("act", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-K{}-N{}-E{}".format(*c[:4]))
def test_gmsq_matches_reference(rng, gemm_isa, case, bias, act):
    ins = make_inputs(rng, *case, bias=bias)
    assert_reaches_clamp(ins, act.get("limit", 7.0))
    want = reference.grouped_matmul_swiglu_quant(**ins, **act)
    print(f"{gemm_isa} {case[:4]}: {count_ties(ins, **act)} rounding ties, all must match")
    got = run_single_op(gmsq.SCHEMA, ins, **act)
    assert_exact(got, want)
    end = int(case[4][-1])
    assert not got[0][end:].any() and not got[1][end:].any(), "rows past the last group end must stay zero"


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-K{}-N{}-E{}".format(*c[:4]))
def test_gmd_matches_reference(rng, gemm_isa, case, bias):
    ins = make_inputs(rng, *case, bias=bias)
    want = reference.grouped_matmul_dequant(**ins)
    got = run_single_op(gmd.SCHEMA, ins)[0]
    assert got.dtype == np.float32 and got.shape == want.shape
    assert got.tobytes() == want.tobytes(), f"{int(np.sum(got != want))} of {got.size} differ"
    end = int(case[4][-1])
    assert not got[end:].any(), "rows past the last group end must stay zero (no bias)"
    if bias:  # the bias is one float32 add on top of the unbiased output
        plain = reference.grouped_matmul_dequant(**{k: v for k, v in ins.items() if k != "bias"})
        expert = np.searchsorted(ins["group_list"], np.arange(end), side="right")
        np.testing.assert_array_equal(want[:end], (plain[:end] + ins["bias"][expert]).astype(np.float32))


@pytest.mark.parametrize("layout", ["ENK", "EN16K4"])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avxvnni", "avx512vnni", "amx"])
def test_weight_layouts(monkeypatch, rng, isa, layout):
    """Bias and swiglu_oai through the layouts' own routes (transpose / unpack, AMX panels)."""
    use_gemm_isa(monkeypatch, isa)
    ins = make_inputs(rng, 40, 96, 132, 5, [3, 3, 20, 38, 40])
    assert_reaches_clamp(ins, 7.0)
    act = {"activation": "swiglu_oai"}
    want = reference.grouped_matmul_swiglu_quant(**ins, **act)
    assert_exact(run_single_op(gmsq.SCHEMA, _weight(ins, layout), weight_layout=layout, **act), want)
    want_d = reference.grouped_matmul_dequant(**ins)
    got_d = run_single_op(gmd.SCHEMA, _weight(ins, layout), weight_layout=layout)[0]
    assert got_d.tobytes() == want_d.tobytes(), f"{int(np.sum(got_d != want_d))} of {got_d.size} differ"


def test_counts_and_float16_scales_with_bias(rng, gemm_isa):
    ins = make_inputs(rng, 30, 50, 24, 4, [5, 5, 17, 30])
    ins["weight_scale"] = ins["weight_scale"].astype(np.float16)
    ins["x_scale"] = ins["x_scale"].astype(np.float16)
    counts = dict(ins, group_list=np.diff(ins["group_list"], prepend=0).astype(np.int64))
    act = {"activation": "swiglu_oai", "alpha": 1.5, "limit": 5.0}
    want = reference.grouped_matmul_swiglu_quant(**ins, **act)
    assert_exact(run_single_op(gmsq.SCHEMA, counts, group_list_type=1, **act), want)
    got = run_single_op(gmd.SCHEMA, counts, group_list_type=1)[0]
    assert got.tobytes() == reference.grouped_matmul_dequant(**ins).tobytes()


BAD_BIAS = {
    "shape": (lambda b: b[:, :-1].copy(), "input 'bias' must have shape"),
    "shape-e": (lambda b: b[:1].copy(), "input 'bias' must have shape"),
    "rank": (lambda b: b.reshape(-1).copy(), "input 'bias' must have shape"),
    "float16": (lambda b: b.astype(np.float16), "input 'bias' must be float32, got float16"),
    "float64": (lambda b: b.astype(np.float64), "input 'bias' must be float32, got float64"),
    "nan": (lambda b: np.where(np.arange(b.size).reshape(b.shape) == 7, np.float32(np.nan), b).astype(np.float32),
            "input 'bias' must be finite, got NaN or Inf at expert 0, column 7"),
    "inf": (lambda b: np.where(np.arange(b.size).reshape(b.shape) == b.shape[1] + 3, np.float32(-np.inf), b
                               ).astype(np.float32), "input 'bias' must be finite, got NaN or Inf at expert 1, column 3"),
}


@pytest.mark.parametrize("op", ["GroupedMatmulSwigluQuant", "GroupedMatmulDequant"])
@pytest.mark.parametrize("kind", list(BAD_BIAS))
def test_bad_bias_refused(rng, op, kind):
    schema, ref = ((gmsq.SCHEMA, reference.grouped_matmul_swiglu_quant) if op == "GroupedMatmulSwigluQuant"
                   else (gmd.SCHEMA, reference.grouped_matmul_dequant))
    ins = make_inputs(rng, 6, 12, 10, 3, [1, 2, 6])
    make_bad, msg = BAD_BIAS[kind]
    ins["bias"] = make_bad(ins["bias"])
    with pytest.raises(Exception, match=f"{op}: {msg}"):
        run_single_op(schema, ins)
    with pytest.raises(ValueError, match=f"{op}: {msg}"):  # the reference refuses it the same way
        ref(**ins)


def test_nan_bias_of_an_unused_expert_is_refused(rng):
    """The bias is an input like the scales: a NaN anywhere is refused, used expert or not."""
    ins = make_inputs(rng, 6, 12, 10, 3, [1, 6, 6])
    ins["bias"][2, 0] = np.nan
    with pytest.raises(Exception, match="input 'bias' must be finite, got NaN or Inf at expert 2, column 0"):
        run_single_op(gmsq.SCHEMA, ins)


BAD_ATTRS = [
    ({"activation": "gelu"}, "attribute 'activation' must be 'swiglu' or 'swiglu_oai', got 'gelu'"),
    ({"activation": "SwiGLU"}, "attribute 'activation' must be 'swiglu' or 'swiglu_oai', got 'SwiGLU'"),
    ({"activation": "swiglu_oai", "limit": 0.0}, "attribute 'limit' must be finite and > 0"),
    ({"activation": "swiglu_oai", "limit": -7.0}, "attribute 'limit' must be finite and > 0"),
    ({"activation": "swiglu_oai", "limit": float("inf")}, "attribute 'limit' must be finite and > 0"),
    ({"activation": "swiglu_oai", "limit": float("nan")}, "attribute 'limit' must be finite and > 0"),
    ({"limit": -1.0}, "attribute 'limit' must be finite and > 0"),  # checked whatever the activation
    ({"activation": "swiglu_oai", "alpha": float("inf")}, "attribute 'alpha' must be finite"),
    ({"activation": "swiglu_oai", "alpha": float("nan")}, "attribute 'alpha' must be finite"),
]


@pytest.mark.parametrize("attrs,msg", BAD_ATTRS, ids=[f"{i}" for i in range(len(BAD_ATTRS))])
def test_bad_activation_attrs_refused(rng, attrs, msg):
    ins = make_inputs(rng, 6, 12, 10, 3, [1, 2, 6])
    with pytest.raises(Exception, match=f"GroupedMatmulSwigluQuant: {msg}"):
        run_single_op(gmsq.SCHEMA, ins, **attrs)
    with pytest.raises(ValueError, match=f"GroupedMatmulSwigluQuant: {msg}"):
        reference.grouped_matmul_swiglu_quant(**ins, **attrs)


def test_bias_overflow_to_inf_refused_by_gmsq(rng):
    """C + bias past FLT_MAX is a non-finite C: GroupedMatmulSwigluQuant refuses the row, as the
    reference does; GroupedMatmulDequant returns the Inf float math gives."""
    ins = make_inputs(rng, 4, 8, 6, 1, [4])
    ins["x"][:] = 1
    ins["weight"][:] = 127
    ins["weight_scale"][:] = 5.4e17  # C = (1016 * 5.4e17) * 5.4e17 ~ 2.96e38, finite
    ins["x_scale"][:] = 5.4e17
    ins["bias"][:] = 3e38
    with pytest.raises(Exception, match="GroupedMatmulSwigluQuant: row 0: the dequantized product is not finite"):
        run_single_op(gmsq.SCHEMA, ins)
    with pytest.raises(ValueError, match="row 0: the dequantized product is not finite"):
        reference.grouped_matmul_swiglu_quant(**ins)
    with np.errstate(over="ignore"):
        want = reference.grouped_matmul_dequant(**ins)
    assert np.isinf(want).all()
    got = run_single_op(gmd.SCHEMA, ins)[0]
    assert got.tobytes() == want.tobytes()
