# SPDX-License-Identifier: MIT
"""GroupedMatmulSwigluQuant and GroupedMatmulDequant on the CPU EP against their references for
random valid inputs: rows 0..48, K 1..300, E 1..8 with empty experts, rows past the last group,
group_list cumulative and as counts, every weight layout (EKN, ENK, EN16K4), int8 codes including
-128, with and without the optional bias (small to huge), GroupedMatmulSwigluQuant's activations
"swiglu" and "swiglu_oai" (random alpha and limit), float32/float16 scales from tiny to huge (float overflow included: the ops refuse a
non-finite product or SwiGLU output, GroupedMatmulDequant returns Inf as float math does), every
GEMM kernel variant; outputs bit for bit. Invalid inputs (odd N, K past the int32-exact bound,
decreasing or overlong group lists, negative counts, shapes, ranks, dtypes, layouts and
group_list_type values the ops do not take, NaN scales, misaligned buffers, a bias of the wrong
shape or dtype or with NaN / Inf, an unknown activation, a non-finite alpha or limit, limit <= 0)
are refused naming the op and the input or attribute."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ort_ops import reference
from ort_ops.ops import grouped_matmul_dequant, grouped_matmul_swiglu_quant
from ort_ops.ops._moe import MAX_K, pack_en16k4
from tests.ops.conftest import GEMM_ISAS, amx_available
from tests.property import _harness as h
from tests.property import _strategies as S
from tests.conftest import available_isas

OPS = {"GroupedMatmulSwigluQuant": (grouped_matmul_swiglu_quant.SCHEMA, reference.grouped_matmul_swiglu_quant),
       "GroupedMatmulDequant": (grouped_matmul_dequant.SCHEMA, reference.grouped_matmul_dequant)}


def gemm_isas():
    """The grouped-GEMM variants this machine runs (tests/ops/conftest.py: AVX-512 VNNI with and
    without AMX tiles)."""
    return st.sampled_from([i for i in GEMM_ISAS if (i == "amx" and amx_available()) or i in available_isas()])


def _group_list(rng, m, e, kind, gl_type):
    """Random expert groups over rows 0..m (some empty; the last may end before m)."""
    end = m if kind == "full" else int(rng.integers(0, m + 1))
    cuts = np.sort(rng.integers(0, end + 1, e - 1)) if e > 1 else np.zeros(0, np.int64)
    ends = np.concatenate([cuts, [end]]).astype(np.int64)
    return ends if gl_type == 0 else np.diff(ends, prepend=0).astype(np.int64)


def _weight(w_ekn, layout):
    if layout == "ENK":
        return np.ascontiguousarray(w_ekn.transpose(0, 2, 1))
    if layout == "EN16K4":
        return pack_en16k4(w_ekn)
    return w_ekn


@st.composite
def valid_inputs(draw):
    op = draw(st.sampled_from(sorted(OPS)))
    rng = np.random.default_rng(draw(S.seeds))
    layout = draw(st.sampled_from(["EKN", "ENK", "EN16K4"]))
    m = draw(st.one_of(st.integers(0, 4), st.integers(5, 48)))
    k = draw(st.one_of(st.integers(1, 16), st.integers(17, 300), st.sampled_from([32, 64, 128, 256])))
    if layout == "EN16K4":
        k = -(-k // 4) * 4
    n = draw(st.one_of(st.integers(1, 12), st.integers(13, 96))) * (2 if op == "GroupedMatmulSwigluQuant" else 1)
    e = draw(st.integers(1, 8))
    lo = -128 if draw(st.booleans()) else -127
    x = rng.integers(lo, 128, (m, k), dtype=np.int8)
    w = rng.integers(lo, 128, (e, k, n), dtype=np.int8)
    sdt = draw(S.float_dtypes)
    mag = draw(st.sampled_from(["normal", "tiny", "huge", "zeros"]))
    f16 = sdt == np.float16
    size = {"normal": 1e-2, "tiny": 1e-7 if f16 else 1e-30, "huge": 1e4 if f16 else 1e20, "zeros": 0.0}[mag]
    ws = (rng.uniform(0.0, 1.0, (e, n)) * size).astype(sdt)
    xs = (rng.uniform(0.0, 1.0, m) * (1.0 if mag == "zeros" else size)).astype(sdt)
    gl_type = draw(st.sampled_from([0, 1]))
    gl = _group_list(rng, m, e, draw(st.sampled_from(["full", "partial"])), gl_type)
    ins = {"x": x, "weight": _weight(w, layout), "weight_scale": ws, "x_scale": xs, "group_list": gl}
    attrs = {"group_list_type": gl_type, "weight_layout": layout}
    bias = draw(st.sampled_from([None, 1.0, 30.0, 1e30, 3e38]))
    if bias is not None:
        ins["bias"] = rng.uniform(-bias, bias, (e, n)).astype(np.float32)
    if op == "GroupedMatmulSwigluQuant":
        act = draw(st.sampled_from([None, "swiglu", "swiglu_oai"]))
        if act is not None:
            attrs["activation"] = act
        if act == "swiglu_oai" and draw(st.booleans()):
            attrs["alpha"] = draw(st.floats(-4.0, 4.0, width=32))
            attrs["limit"] = draw(st.one_of(st.floats(0.0009765625, 50.0, width=32), st.sampled_from([1e-30, 1e30])))
    return op, ins, attrs, draw(gemm_isas())


@given(valid_inputs())
def test_matches_reference(case):
    op, ins, attrs, isa = case
    schema, ref = OPS[op]
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # float overflow is part of what is tested
            want = ref(**ins, **attrs)
    except ValueError:  # a non-finite dequantized product or SwiGLU output: the kernel refuses it too
        h.assert_refused(schema, ins, attrs, ["x_scale", "weight_scale"], isa=isa)
        return
    want = want if isinstance(want, tuple) else (want,)
    got = h.run(schema, ins, attrs, isa=isa)
    for name, g, w in zip(schema.output_names(), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.tobytes() == w.tobytes(), f"{op} {name}: {int(np.sum(g != w))} of {g.size} differ"


INVALID = ("odd_n", "k_past_bound", "gl_decreasing", "gl_past_m", "gl_negative_count", "gl_counts_past_m",
           "gl_shape", "gl_dtype", "x_rank", "weight_k", "weight_scale_shape", "x_scale_shape", "x_scale_nan",
           "x_dtype", "scale_dtype", "layout", "gl_type", "en16k4_k", "misaligned", "bias_shape", "bias_dtype",
           "bias_nonfinite", "activation", "limit", "alpha")


@st.composite
def invalid_inputs(draw):
    op = draw(st.sampled_from(sorted(OPS)))
    rng = np.random.default_rng(draw(S.seeds))
    m, k, e = draw(st.integers(1, 12)), draw(st.integers(1, 40)), draw(st.integers(1, 4))
    n = draw(st.integers(1, 8)) * 2
    x = rng.integers(-127, 128, (m, k), dtype=np.int8)
    w = rng.integers(-127, 128, (e, k, n), dtype=np.int8)
    sdt = draw(S.float_dtypes)
    ins = {"x": x, "weight": w, "weight_scale": rng.uniform(0, 0.1, (e, n)).astype(sdt),
           "x_scale": rng.uniform(0, 0.1, m).astype(sdt), "group_list": _group_list(rng, m, e, "full", 0)}
    attrs = {}
    kind = draw(st.sampled_from(INVALID))
    bad = "group_list"
    gl = ins["group_list"]
    if kind == "odd_n" and op == "GroupedMatmulSwigluQuant":
        bad = "weight"
        ins["weight"] = w[:, :, :-1].copy()
        ins["weight_scale"] = ins["weight_scale"][:, :-1].copy()
    elif kind == "k_past_bound":
        bad = "K must be <="  # K, dim 1 of 'x' and 'weight', as the contract names it
        k2 = draw(st.sampled_from([MAX_K + 1, MAX_K + 4]))
        ins["x"] = np.ones((1, k2), np.int8)
        ins["weight"] = np.ones((1, k2, n), np.int8)
        ins["weight_scale"] = ins["weight_scale"][:1].copy()
        ins["x_scale"] = ins["x_scale"][:1].copy()
        ins["group_list"] = np.array([1], np.int64)
    elif kind == "gl_decreasing" and e >= 2:
        i = draw(st.integers(1, e - 1))
        gl[:] = np.arange(e)
        gl[i] = gl[i - 1] - draw(st.integers(1, 3))
    elif kind == "gl_past_m":
        gl[-1] = m + draw(st.integers(1, 2**40))
    elif kind == "gl_negative_count":
        attrs["group_list_type"] = 1
        gl[:] = 0
        gl[draw(st.integers(0, e - 1))] = -draw(st.integers(1, 2**40))
    elif kind == "gl_counts_past_m":
        attrs["group_list_type"] = 1
        gl[:] = 0
        gl[draw(st.integers(0, e - 1))] = m + draw(st.integers(1, 100))
    elif kind == "gl_shape":
        ins["group_list"] = np.append(gl, gl[-1:])
    elif kind == "gl_dtype":
        ins["group_list"] = gl.astype(np.int32)
    elif kind == "x_rank":
        bad = "x"
        ins["x"] = x.reshape(1, m, k)
    elif kind == "weight_k":
        bad = "weight"
        ins["weight"] = np.zeros((e, k + 1, n), np.int8)
    elif kind == "weight_scale_shape":
        bad = "weight_scale"
        ins["weight_scale"] = np.zeros((e, n + 2), sdt)
    elif kind == "x_scale_shape":
        bad = "x_scale"
        ins["x_scale"] = np.zeros(m + 1, sdt)
    elif kind == "x_scale_nan" and op == "GroupedMatmulSwigluQuant":  # Dequant's float output takes NaN
        bad = "x_scale"
        ins["x_scale"][int(rng.integers(0, m))] = draw(st.sampled_from([np.nan, np.inf]))
    elif kind == "misaligned":  # int8 x and weight are aligned at any address
        bad = draw(st.sampled_from(["weight_scale", "x_scale", "group_list"]))
        ins[bad] = S.misaligned(ins[bad])
    elif kind == "x_dtype":
        bad = "x"
        ins["x"] = x.view(np.uint8)
    elif kind == "scale_dtype":
        bad = "weight_scale"
        ins["weight_scale"] = ins["weight_scale"].astype(np.float64)
    elif kind == "en16k4_k" and k % 4:
        bad = ["x", "weight_layout"]
        attrs["weight_layout"] = "EN16K4"
        ins["weight"] = np.zeros((e, -(-n // 16), -(-k // 4), 16, 4), np.int8)
    elif kind == "bias_shape":
        bad = "bias"
        ins["bias"] = np.zeros(draw(st.sampled_from([(e, n + 1), (e + 1, n), (e * n,), (1, e, n)])), np.float32)
    elif kind == "bias_dtype":
        bad = "bias"
        ins["bias"] = np.zeros((e, n), draw(st.sampled_from([np.float16, np.float64, np.int32])))
    elif kind == "bias_nonfinite":
        bad = "bias"
        ins["bias"] = np.zeros((e, n), np.float32)
        ins["bias"][int(rng.integers(0, e)), int(rng.integers(0, n))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif kind == "activation" and op == "GroupedMatmulSwigluQuant":
        bad = "activation"
        attrs["activation"] = draw(st.sampled_from(["gelu", "silu", "SWIGLU", "swiglu_oai ", "relu"]))
    elif kind == "limit" and op == "GroupedMatmulSwigluQuant":
        bad = "limit"
        attrs["activation"] = "swiglu_oai"
        attrs["limit"] = draw(st.sampled_from([0.0, -0.0, -1.0, -7.0, float("inf"), float("nan"), -1e-30]))
    elif kind == "alpha" and op == "GroupedMatmulSwigluQuant":
        bad = "alpha"
        attrs["activation"] = "swiglu_oai"
        attrs["alpha"] = draw(st.sampled_from([float("inf"), float("-inf"), float("nan")]))
    elif kind == "gl_type":
        bad = "group_list_type"
        attrs["group_list_type"] = draw(st.sampled_from([2, -1, 7]))
    else:
        bad = "weight_layout"
        attrs["weight_layout"] = draw(st.sampled_from(["NKE", "ekn", "", "EN16K"]))
    return op, ins, attrs, bad, draw(gemm_isas()), kind != "misaligned"


@given(invalid_inputs())
def test_invalid_refused(case):
    op, ins, attrs, bad, isa, ref_refuses = case  # numpy has no notion of a misaligned buffer
    schema, ref = OPS[op]
    h.assert_refused(schema, ins, attrs, bad, isa=isa, reference=ref if ref_refuses else None)
