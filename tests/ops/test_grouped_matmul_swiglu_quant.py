# SPDX-License-Identifier: MIT
"""GroupedMatmulSwigluQuant on the CPU EP against ort_ops.reference.grouped_matmul_swiglu_quant.

Codes and scales are bit-exact on every ISA variant (the kernels follow _moe.py's float32
recipe, so a rounding tie rounds the same way everywhere: the tests count ties and still
require equality). Shapes are awkward on purpose: K not a multiple of 4, N/2 not a multiple of
the 64-column tile, empty experts, one-row experts, rows past the last group end.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from ort_ops.ops import grouped_matmul_swiglu_quant as gmsq
from ort_ops.ops._run import make_session, run_single_op
from tests.ops.conftest import use_gemm_isa
from tests.tolerances import INT8_EXACT_ATOL

# (M, K, N, E)
SHAPES = [(1, 1, 2, 1), (7, 33, 10, 3), (64, 130, 300, 8), (129, 257, 130, 2), (250, 64, 258, 4)]


def make_inputs(rng, m, k, n, e, *, scale_dtype=np.float32, group_list=None, codes=(-128, 128)):
    x = rng.integers(*codes, (m, k)).astype(np.int8)
    w = rng.integers(*codes, (e, k, n)).astype(np.int8)
    ws = rng.uniform(1e-3, 1e-2, (e, n)).astype(scale_dtype)
    xs = rng.uniform(1e-3, 1e-2, m).astype(scale_dtype)
    if group_list is None:  # random cut points: some experts empty, some one row
        group_list = np.sort(rng.integers(0, m + 1, e))
    return {"x": x, "weight": w, "weight_scale": ws, "x_scale": xs, "group_list": np.asarray(group_list, np.int64)}


def _run(inputs, **attrs):
    return run_single_op(gmsq.SCHEMA, inputs, **attrs)


def count_ties(inputs, **attrs) -> int:
    """Values of S * (127 / amax) that sit exactly on n + 0.5 (where a different rounding rule
    or a 1-ulp different S would change a code by one)."""
    s, _valid = gmsq.swiglu_rows(**inputs, **attrs)
    amax = np.abs(s).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    v = (s * inv).astype(np.float32)
    return int(np.count_nonzero((v - np.floor(v)) == 0.5))


def assert_exact(got, want):
    y, ys, yo = got
    ry, rys, ryo = want
    assert y.dtype == np.int8 and ys.dtype == np.float32 and yo.dtype == np.float32
    assert y.shape == ry.shape and ys.shape == rys.shape and yo.shape == ryo.shape
    diff = np.abs(y.astype(np.int32) - ry)
    bad = np.argwhere(diff > INT8_EXACT_ATOL)
    assert bad.size == 0, f"{len(bad)} codes differ, first at {bad[:5].tolist()}: {y[tuple(bad[0])]} vs {ry[tuple(bad[0])]}"
    np.testing.assert_array_equal(ys, rys)
    assert not yo.any()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}-E{}".format(*s))
def test_matches_reference(rng, gemm_isa, shape):
    inputs = make_inputs(rng, *shape)
    ties = count_ties(inputs)
    print(f"{gemm_isa} {shape}: {ties} rounding ties, all must match")
    assert_exact(_run(inputs), reference.grouped_matmul_swiglu_quant(**inputs))


def test_realistic_shape(rng, gemm_isa):
    """Hidden 2048 -> 2 x 704 with 8 experts and offline-quantized weights (codes in [-127, 127])."""
    m, k, n, e = 48, 2048, 1408, 8
    inputs = make_inputs(rng, m, k, n, e, codes=(-127, 128))
    assert_exact(_run(inputs), reference.grouped_matmul_swiglu_quant(**inputs))


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni", "amx"])
def test_float16_scales_and_counts(monkeypatch, rng, isa):
    use_gemm_isa(monkeypatch, isa)
    inputs = make_inputs(rng, 40, 96, 136, 5, scale_dtype=np.float16)
    counts = np.diff(np.concatenate([[0], inputs["group_list"]]))
    as_counts = dict(inputs, group_list=counts.astype(np.int64))
    want = reference.grouped_matmul_swiglu_quant(**inputs)
    assert_exact(_run(inputs), want)
    assert_exact(_run(as_counts, group_list_type=1), want)
    assert_exact(_run(as_counts, group_list_type=1), reference.grouped_matmul_swiglu_quant(**as_counts, group_list_type=1))


@pytest.mark.parametrize("group_list", [[0, 0, 0], [0, 9, 9], [9, 9, 9], [1, 2, 3], [0, 4, 6]],
                         ids=["none", "one-expert-first", "all-in-expert0", "one-row-each", "tail-unused"])
def test_group_layouts(rng, gemm_isa, group_list):
    """Empty experts, all rows in one expert, one-row experts; rows past the end are zeros."""
    inputs = make_inputs(rng, 9, 40, 132, 3, group_list=group_list)
    got = _run(inputs)
    assert_exact(got, reference.grouped_matmul_swiglu_quant(**inputs))
    end = group_list[-1]
    assert not got[0][end:].any() and not got[1][end:].any()
    assert np.all(got[1][:end] > 0)


def test_empty_m(rng):
    inputs = make_inputs(rng, 0, 16, 8, 2, group_list=[0, 0])
    y, ys, yo = _run(inputs)
    assert y.shape == (0, 4) and ys.shape == (0,) and yo.shape == (0,)


def test_zero_rows_and_saturating_codes(rng, gemm_isa):
    """A zero x row gives scale 0 and codes 0; all -128 codes (x and W) stay exact in int32."""
    inputs = make_inputs(rng, 8, 4099, 34, 1, group_list=[8])
    inputs["x"][2] = 0
    inputs["x"][3] = -128
    inputs["weight"][0, :, :5] = -128
    got = _run(inputs)
    assert_exact(got, reference.grouped_matmul_swiglu_quant(**inputs))
    assert got[1][2] == 0 and not got[0][2].any()


def test_session_reused_across_shapes(rng):
    inputs = make_inputs(rng, 6, 20, 12, 2)
    sess = make_session(gmsq.SCHEMA, inputs, dynamic_shapes=True)
    for m, k, n, e in [(6, 20, 12, 2), (30, 7, 130, 3), (1, 64, 2, 1)]:
        ins = make_inputs(rng, m, k, n, e)
        assert_exact(sess.run(None, ins), reference.grouped_matmul_swiglu_quant(**ins))


def test_k_limit_refused():
    k = 131072
    inputs = {"x": np.zeros((1, k), np.int8), "weight": np.zeros((1, k, 2), np.int8),
                  "weight_scale": np.ones((1, 2), np.float32), "x_scale": np.ones(1, np.float32),
                  "group_list": np.array([1], np.int64)}
    with pytest.raises(Exception, match=r"GroupedMatmulSwigluQuant: K must be <= 131071 so the int32 accumulator cannot overflow, got 131072"):
        _run(inputs)
    with pytest.raises(ValueError, match="K must be <= 131071"):
        reference.grouped_matmul_swiglu_quant(**inputs)


ERRORS = [
    ("decreasing", {"group_list": [3, 2, 5]}, {}, r"input 'group_list' must be non-decreasing and >= 0, got 2 at index 1 after 3"),
    ("negative", {"group_list": [-1, 2, 5]}, {}, r"input 'group_list' must be non-decreasing and >= 0, got -1 at index 0"),
    ("past-m", {"group_list": [1, 2, 9]}, {}, r"input 'group_list' must end at <= 6 \(rows of 'x'\), got 9"),
    ("counts-past-m", {"group_list": [4, 2, 1]}, {"group_list_type": 1}, r"input 'group_list' counts must sum to <= 6"),
    ("negative-count", {"group_list": [4, -2, 1]}, {"group_list_type": 1}, r"input 'group_list' must hold counts >= 0, got -2 at index 1"),
    ("group-list-len", {"group_list": [1, 6]}, {}, r"input 'group_list' must have shape \[3\], got \[2\]"),
    ("odd-n", {"weight": np.zeros((3, 10, 7), np.int8), "weight_scale": np.ones((3, 7), np.float32)}, {},
     r"input 'weight' must have an even N \(last dim\), got 7"),
    ("k-mismatch", {"weight": np.zeros((3, 11, 8), np.int8)}, {}, r"input 'weight' must have shape \[E, 10, N\] \(K of 'x'\), got \[3, 11, 8\]"),
    ("weight-scale-shape", {"weight_scale": np.ones((3, 7), np.float32)}, {}, r"input 'weight_scale' must have shape \[3, 8\], got \[3, 7\]"),
    ("x-scale-shape", {"x_scale": np.ones(5, np.float32)}, {}, r"input 'x_scale' must have shape \[6\], got \[5\]"),
    ("x-dtype", {"x": np.zeros((6, 10), np.float32)}, {}, r"input 'x' must be int8, got float32"),
    ("weight-dtype", {"weight": np.zeros((3, 10, 8), np.uint8)}, {}, r"input 'weight' must be int8, got uint8"),
    ("scale-dtype", {"x_scale": np.ones(6, np.float64)}, {}, r"input 'x_scale' must be float32 or float16, got float64"),
    ("group-list-dtype", {"group_list": np.array([1, 2, 3], np.int32)}, {}, r"input 'group_list' must be int64, got int32"),
    ("x-rank", {"x": np.zeros((6, 10, 1), np.int8)}, {}, r"input 'x' must have rank 2"),
    ("group-list-type", {}, {"group_list_type": 2}, r"attribute 'group_list_type' must be 0 \(cumulative\) or 1 \(counts\), got 2"),
]


@pytest.mark.parametrize("name,override,attrs,msg", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_fails_with_message(rng, name, override, attrs, msg):
    inputs = make_inputs(rng, 6, 10, 8, 3, group_list=[1, 2, 5])
    inputs.update({k: (np.asarray(v, np.int64) if k == "group_list" and isinstance(v, list) else v)
                   for k, v in override.items()})
    with pytest.raises(Exception, match="GroupedMatmulSwigluQuant: " + msg):
        _run(inputs, **attrs)
    if name not in ("x-rank",):  # the reference raises the same message
        with pytest.raises(ValueError, match=msg):
            reference.grouped_matmul_swiglu_quant(**inputs, **attrs)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni", "amx"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_scale_fails(monkeypatch, rng, isa, bad):
    use_gemm_isa(monkeypatch, isa)
    inputs = make_inputs(rng, 6, 10, 8, 3, group_list=[1, 2, 5])
    inputs["x_scale"][3] = bad
    with pytest.raises(Exception, match=r"GroupedMatmulSwigluQuant: row 3: the dequantized product is not finite"):
        _run(inputs)
    with pytest.raises(ValueError, match=r"row 3: the dequantized product is not finite"):
        reference.grouped_matmul_swiglu_quant(**inputs)


def test_overflowing_swiglu_fails(rng):
    inputs = make_inputs(rng, 4, 8, 4, 1, group_list=[4], codes=(100, 101))
    inputs["x_scale"][:] = 1e15
    inputs["weight_scale"][:] = 1e15
    with pytest.raises(Exception, match=r"GroupedMatmulSwigluQuant: row 0: the SwiGLU output overflows float32"):
        _run(inputs)


def test_rounding_ties_round_half_to_even(gemm_isa):
    """Exact ties: with A >= 17, exp_f32(-A) < 2^-24 so Swish(A) == A and S == A * G exactly;
    with the row's amax 127 the factor 127 / amax is 1, so S = 63.5 is a true tie -> 64."""
    a = np.array([127, 63.5, 62.5, 20.5, 21.5, 63.5, 100.5, 17.5], np.float32)
    g = np.array([1, 1, 1, 1, 1, -1, -1, 1], np.float32)
    h = a.size
    inputs = {"x": np.ones((1, 1), np.int8), "weight": np.ones((1, 1, 2 * h), np.int8),
                  "weight_scale": np.concatenate([a, g])[None, :].astype(np.float32),
                  "x_scale": np.ones(1, np.float32), "group_list": np.array([1], np.int64)}
    assert count_ties(inputs) == 7
    y, ys, _ = _run(inputs)
    np.testing.assert_array_equal(y[0], [127, 64, 62, 20, 22, -64, -100, 18])
    assert ys[0] == np.float32(1.0)
    assert_exact((y, ys, _), reference.grouped_matmul_swiglu_quant(**inputs))


@pytest.mark.parametrize("k", [3, 257, 1037])
def test_few_row_experts(rng, gemm_isa, k):
    """Experts of 1-4 rows (<= kGemvRows = 6) take the K-split path (blocks of 256 k): K not a
    multiple of 4 or 16, several blocks, -128 codes, N/2 not a multiple of the packing group."""
    inputs = make_inputs(rng, 12, k, 300, 5, group_list=[1, 3, 3, 6, 10])
    inputs["x"][0, :] = -128
    inputs["weight"][0, -1, :] = -128
    assert_exact(_run(inputs), reference.grouped_matmul_swiglu_quant(**inputs))


def test_row_blocks(rng, gemm_isa):
    """Experts of 2-129 rows around the tiles' row blocks (AMX: 16 and 32 rows; AVX: 3 or 6) with
    K not a multiple of 64 (the last AMX k tile is part padding) and -128 codes in the last rows."""
    counts = [2, 3, 15, 16, 17, 31, 32, 33, 64, 70, 128, 129]
    inputs = make_inputs(rng, sum(counts) + 5, 300, 2 * 136, len(counts), group_list=np.cumsum(counts))
    inputs["x"][-10:, :] = -128
    assert_exact(_run(inputs), reference.grouped_matmul_swiglu_quant(**inputs))


def weight_initializer_session(inputs, schema=gmsq.SCHEMA, **attrs):
    """A CPU session of one node of ``schema`` (GroupedMatmulSwigluQuant's by default) whose input
    'weight' is a constant initializer (as in a rewritten model), and the feeds of the other inputs."""
    import onnxruntime as ort
    from onnx import numpy_helper

    from ort_ops._lib import session_options
    from ort_ops.ops._schema import single_op_model

    model = single_op_model(schema, inputs, **attrs)
    model.graph.initializer.append(numpy_helper.from_array(inputs["weight"], "weight"))
    kept = [i for i in model.graph.input if i.name != "weight"]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return sess, {k: v for k, v in inputs.items() if k != "weight"}


def test_constant_weight_initializer(rng, gemm_isa):
    """A weight of several MB as a constant initializer (the kernel asks for 2 MB pages for it
    at creation, ORT_OPS_CPU_HUGEPAGES): outputs unchanged, across several runs."""
    inputs = make_inputs(rng, 24, 1024, 2 * 1536, 4, codes=(-127, 128))  # 12.6 MB of weights
    sess, feeds = weight_initializer_session(inputs)
    want = reference.grouped_matmul_swiglu_quant(**inputs)
    for _ in range(2):
        assert_exact(sess.run(None, feeds), want)
