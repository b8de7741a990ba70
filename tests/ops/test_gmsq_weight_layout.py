# SPDX-License-Identifier: MIT
"""GroupedMatmulSwigluQuant's attribute weight_layout on the CPU EP: "ENK" (weight [E, N, K],
weight[e, n, k] = W_e[k, n]) gives the same codes and scales as "EKN" ([E, K, N]) and as the
numpy reference, bit for bit, on fresh random data (empty experts, M = 0, odd N/2, counts);
a bad attribute value and a weight of the wrong shape fail naming the attribute / the layout.
"EN16K4" (weight [E, ceil(N/16), K/4, 16, 4], weight[e, n // 16, k // 4, n % 16, k % 4] = W_e[k, n])
likewise equals "EKN" bit for bit on every kernel variant (the AMX panels read it directly; the
others unpack it), with
rows 1/2/3/16/64/129 an expert, empty experts, M = 0, K = 4 * odd, N/2 odd and counts; K not a
multiple of 4 and a weight of the wrong shape fail by name.

The CUDA-EP session test (an "ENK" model on onnxruntime-gpu, which needs an sm_90 GPU for the
wgmma kernel) is marked cuda and skips without a GPU, onnxruntime-gpu or a CUDA build.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from ort_ops.ops import grouped_matmul_swiglu_quant as gmsq
from ort_ops.ops._run import run_single_op
from tests.ops.test_grouped_matmul_swiglu_quant import assert_exact, make_inputs, weight_initializer_session


def enk(inputs: dict) -> dict:
    """The same problem with the weight stored [E, N, K]."""
    return dict(inputs, weight=np.ascontiguousarray(inputs["weight"].transpose(0, 2, 1)))


def _run(inputs, **attrs):
    return run_single_op(gmsq.SCHEMA, inputs, **attrs)


# (M, K, N, E, group_list): empty and one-row experts, N/2 odd, K odd, rows past the last end.
CASES = [
    (7, 33, 10, 3, None),
    (40, 130, 2 * 37, 6, [0, 1, 1, 17, 30, 30]),
    (129, 257, 130, 2, [0, 129]),
    (64, 96, 2 * 67, 8, None),
    (5, 3, 2, 1, [4]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-K{}-N{}-E{}".format(*c[:4]))
def test_enk_equals_ekn(rng, gemm_isa, case):
    m, k, n, e, gl = case
    inputs = make_inputs(rng, m, k, n, e, group_list=gl)
    want = reference.grouped_matmul_swiglu_quant(**inputs)
    assert_exact(reference.grouped_matmul_swiglu_quant(**enk(inputs), weight_layout="ENK"), want)
    ekn = _run(inputs)
    assert_exact(ekn, want)
    assert_exact(_run(enk(inputs), weight_layout="ENK"), ekn)
    assert_exact(_run(inputs, weight_layout="EKN"), ekn)  # the explicit default


def test_enk_counts_and_float16_scales(rng, gemm_isa):
    inputs = make_inputs(rng, 50, 70, 2 * 45, 5, scale_dtype=np.float16)
    counts = np.diff(np.concatenate([[0], inputs["group_list"]]))
    inputs["group_list"] = counts.astype(np.int64)
    want = reference.grouped_matmul_swiglu_quant(**inputs, group_list_type=1)
    assert_exact(_run(enk(inputs), weight_layout="ENK", group_list_type=1), want)


def en16k4(inputs: dict) -> dict:
    """The same problem with the weight packed as AMX B tiles [E, ceil(N/16), K/4, 16, 4]."""
    return dict(inputs, weight=gmsq.pack_en16k4(inputs["weight"]))


def test_pack_en16k4_definition(rng):
    w = rng.integers(-128, 128, (3, 12, 21)).astype(np.int8)
    p = gmsq.pack_en16k4(w)
    assert p.shape == (3, 2, 3, 16, 4) and p.flags.c_contiguous
    for e, k, n in [(0, 0, 0), (1, 5, 7), (2, 11, 20), (2, 6, 16), (0, 3, 15)]:
        assert p[e, n // 16, k // 4, n % 16, k % 4] == w[e, k, n]
    assert not p[:, 1, :, 5:, :].any()  # columns past N


def _groups(rows: list[int]) -> list[int]:
    return np.cumsum(rows).tolist()


# (M, K, N, E, rows per expert or None): rows 1/2/3/16/64/129 an expert, empty experts, rows past
# the last end, K = 4 * odd (not a multiple of 64), N/2 odd, N/2 past a 32-column chunk edge.
EN16K4_CASES = [
    (1 + 2 + 3 + 16 + 64 + 129, 4 * 33, 2 * 37, 8, [1, 0, 2, 3, 16, 0, 64, 129]),
    (7, 4 * 3, 10, 3, None),
    (40, 4 * 65, 2 * 75, 6, [0, 1, 1, 16, 12, 0]),
    (300, 4 * 5, 2 * 33, 2, [129, 150]),
    (64, 256, 2 * 96, 4, [64, 0, 0, 0]),
    (5, 4, 2, 1, [4]),
    (20, 4 * 81, 2 * 301, 3, [3, 16, 1]),
]


@pytest.mark.parametrize("case", EN16K4_CASES, ids=lambda c: "M{}-K{}-N{}-E{}".format(*c[:4]))
def test_en16k4_equals_ekn(rng, gemm_isa, case):
    m, k, n, e, rows = case
    gl = None if rows is None else _groups(rows)
    inputs = make_inputs(rng, m + 2, k, n, e, group_list=gl)  # two rows past the last end
    want = reference.grouped_matmul_swiglu_quant(**inputs)
    assert_exact(reference.grouped_matmul_swiglu_quant(**en16k4(inputs), weight_layout="EN16K4"), want)
    ekn = _run(inputs)
    assert_exact(ekn, want)
    assert_exact(_run(en16k4(inputs), weight_layout="EN16K4"), ekn)


def test_en16k4_counts_float16_scales_and_m0(rng, gemm_isa):
    inputs = make_inputs(rng, 50, 4 * 19, 2 * 45, 5, scale_dtype=np.float16)
    counts = np.diff(np.concatenate([[0], inputs["group_list"]]))
    inputs["group_list"] = counts.astype(np.int64)
    want = reference.grouped_matmul_swiglu_quant(**inputs, group_list_type=1)
    assert_exact(_run(en16k4(inputs), weight_layout="EN16K4", group_list_type=1), want)
    empty = make_inputs(rng, 0, 16, 8, 3, group_list=[0, 0, 0])
    y, ys, yo = _run(en16k4(empty), weight_layout="EN16K4")
    assert y.shape == (0, 4) and ys.shape == (0,) and yo.shape == (0,)


def test_en16k4_constant_weight_initializer(rng, gemm_isa):
    """The rewrite's case: the packed weight is an initializer; outputs unchanged across runs."""
    inputs = en16k4(make_inputs(rng, 33, 4 * 51, 2 * 72, 4, codes=(-127, 128)))
    sess, feeds = weight_initializer_session(inputs, weight_layout="EN16K4")
    want = reference.grouped_matmul_swiglu_quant(**inputs, weight_layout="EN16K4")
    for _ in range(2):
        assert_exact(tuple(sess.run(None, feeds)), want)


EN16K4_ERRORS = [
    ("k-not-multiple-of-4", {"x": np.zeros((6, 10), np.int8), "weight": np.zeros((3, 1, 2, 16, 4), np.int8)},
     r"weight_layout 'EN16K4' needs K \(dim 1 of 'x'\) to be a multiple of 4, got 10"),
    ("ekn-weight-as-en16k4", {"weight": np.zeros((3, 12, 8), np.int8)},
     r"input 'weight' must be \[E, ceil\(N/16\), K/4, 16, 4\] = \[E, 1, 3, 16, 4\] for weight_layout 'EN16K4' "
     r"\(K of 'x', N of 'weight_scale'\), got \[3, 12, 8\]"),
    ("wrong-k-quads", {"weight": np.zeros((3, 1, 4, 16, 4), np.int8)},
     r"input 'weight' must be \[E, ceil\(N/16\), K/4, 16, 4\] = \[E, 1, 3, 16, 4\] .*got \[3, 1, 4, 16, 4\]"),
    ("wrong-n-tiles", {"weight": np.zeros((3, 2, 3, 16, 4), np.int8)},
     r"input 'weight' must be \[E, ceil\(N/16\), K/4, 16, 4\] = \[E, 1, 3, 16, 4\] .*got \[3, 2, 3, 16, 4\]"),
    ("last-dim-not-4", {"weight": np.zeros((3, 1, 3, 16, 2), np.int8)},
     r"input 'weight' must be \[E, ceil\(N/16\), K/4, 16, 4\] = \[E, 1, 3, 16, 4\] .*got \[3, 1, 3, 16, 2\]"),
    ("en16k4-experts", {"weight": np.zeros((2, 1, 3, 16, 4), np.int8)},
     r"input 'weight_scale' must have shape \[2, 8\], got \[3, 8\]"),
    ("en16k4-odd-n", {"weight": np.zeros((3, 1, 3, 16, 4), np.int8), "weight_scale": np.ones((3, 7), np.float32)},
     r"input 'weight' must have an even N"),
]


@pytest.mark.parametrize("name,override,msg", EN16K4_ERRORS, ids=[e[0] for e in EN16K4_ERRORS])
def test_en16k4_bad_shape_fails_with_message(rng, name, override, msg):
    inputs = make_inputs(rng, 6, 12, 8, 3, group_list=[1, 2, 5])
    inputs.update(override)
    with pytest.raises(Exception, match="GroupedMatmulSwigluQuant: " + msg):
        _run(inputs, weight_layout="EN16K4")
    with pytest.raises(ValueError, match=msg):  # the reference raises the same message
        reference.grouped_matmul_swiglu_quant(**inputs, weight_layout="EN16K4")


def test_enk_empty_m_and_no_rows(rng):
    inputs = make_inputs(rng, 0, 16, 8, 3, group_list=[0, 0, 0])
    y, ys, yo = _run(enk(inputs), weight_layout="ENK")
    assert y.shape == (0, 4) and ys.shape == (0,) and yo.shape == (0,)
    inputs = make_inputs(rng, 6, 16, 8, 3, group_list=[0, 0, 0])  # every row past the last end
    assert_exact(_run(enk(inputs), weight_layout="ENK"), reference.grouped_matmul_swiglu_quant(**inputs))


def test_enk_constant_weight_initializer(rng, gemm_isa):
    """The rewrite's case: the [E, N, K] weight is an initializer; outputs unchanged across runs."""
    inputs = enk(make_inputs(rng, 33, 200, 2 * 72, 4, codes=(-127, 128)))
    sess, feeds = weight_initializer_session(inputs, weight_layout="ENK")
    want = reference.grouped_matmul_swiglu_quant(**inputs, weight_layout="ENK")
    for _ in range(2):
        assert_exact(tuple(sess.run(None, feeds)), want)


ERRORS = [
    ("bad-layout", {}, {"weight_layout": "KNE"},
     r"attribute 'weight_layout' must be 'EKN' \(weight \[E, K, N\]\), 'ENK' \(weight \[E, N, K\]\) or 'EN16K4' \(weight \[E, N/16, K/4, 16, 4\]\), got 'KNE'"),
    ("lowercase-layout", {}, {"weight_layout": "enk"},
     r"attribute 'weight_layout' must be 'EKN' \(weight \[E, K, N\]\), 'ENK' \(weight \[E, N, K\]\) or 'EN16K4' \(weight \[E, N/16, K/4, 16, 4\]\), got 'enk'"),
    ("int-layout", {}, {"weight_layout": 2},
     r"attribute 'weight_layout' must be 'EKN' \(weight \[E, K, N\]\), 'ENK' \(weight \[E, N, K\]\) or 'EN16K4' \(weight \[E, N/16, K/4, 16, 4\]\), got a non-string value"),
    ("ekn-weight-as-enk", {"weight": np.zeros((3, 10, 8), np.int8)}, {"weight_layout": "ENK"},
     r"input 'weight' must be \[E, N, K\] = \[E, N, 10\] for weight_layout 'ENK' \(K of 'x'\), got \[3, 10, 8\]"),
    ("enk-odd-n", {"weight": np.zeros((3, 7, 10), np.int8), "weight_scale": np.ones((3, 7), np.float32)},
     {"weight_layout": "ENK"}, r"input 'weight' must have an even N \(dim 1 for weight_layout 'ENK'\), got 7"),
    ("enk-weight-scale-shape", {"weight": np.zeros((3, 6, 10), np.int8)}, {"weight_layout": "ENK"},
     r"input 'weight_scale' must have shape \[3, 6\], got \[3, 8\]"),
    ("enk-weight-dtype", {"weight": np.zeros((3, 8, 10), np.uint8)}, {"weight_layout": "ENK"},
     r"input 'weight' must be int8, got uint8"),
    ("enk-decreasing", {"group_list": [3, 2, 5]}, {"weight_layout": "ENK"},
     r"input 'group_list' must be non-decreasing and >= 0, got 2 at index 1 after 3"),
    ("enk-past-m", {"group_list": [1, 2, 9]}, {"weight_layout": "ENK"},
     r"input 'group_list' must end at <= 6 \(rows of 'x'\), got 9"),
    ("enk-counts-past-m", {"group_list": [4, 2, 1]}, {"weight_layout": "ENK", "group_list_type": 1},
     r"input 'group_list' counts must sum to <= 6"),
    ("enk-negative-count", {"group_list": [4, -2, 1]}, {"weight_layout": "ENK", "group_list_type": 1},
     r"input 'group_list' must hold counts >= 0, got -2 at index 1"),
]


@pytest.mark.parametrize("name,override,attrs,msg", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_layout_or_shape_fails_with_message(rng, name, override, attrs, msg):
    inputs = enk(make_inputs(rng, 6, 10, 8, 3, group_list=[1, 2, 5]))
    inputs.update({k: (np.asarray(v, np.int64) if k == "group_list" else v) for k, v in override.items()})
    with pytest.raises(Exception, match="GroupedMatmulSwigluQuant: " + msg):
        _run(inputs, **attrs)
    with pytest.raises(ValueError, match=msg):  # the reference raises the same message
        reference.grouped_matmul_swiglu_quant(**inputs, **attrs)


def test_schema_declares_the_attribute():
    attr = {a.name: a for a in gmsq.SCHEMA.attrs}["weight_layout"]
    assert attr.kind == "string" and attr.default == "EKN"


def skip_without_cuda_ep() -> None:
    """Skips the test without onnxruntime-gpu, a CUDA build of the library or torch with a GPU."""
    import onnxruntime as ort

    from ort_ops import build_info

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu not installed)")
    if not build_info()["cuda"]:
        pytest.skip("the ort_ops library was built without CUDA")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


@pytest.mark.cuda
@pytest.mark.parametrize("m,e", [(4096, 8), (300, 4), (16, 8)])
def test_enk_model_on_cuda_ep(rng, m, e):
    """An "ENK" model on ORT's CUDA EP (the wgmma kernel on sm_90 for many rows an expert, the
    K-major decode stream at 2 rows an expert) equals the CPU reference bit for bit and runs
    there (other GPUs take the mma.sync kernels' K-major paths at every row count, also bit-exact). Skips without onnxruntime-gpu, torch with CUDA or a CUDA build."""
    import json

    import onnxruntime as ort

    from ort_ops._lib import session_options
    from ort_ops.ops._schema import single_op_model

    skip_without_cuda_ep()
    inputs = enk(make_inputs(rng, m, 256, 2 * 128, e, codes=(-127, 128)))
    model = single_op_model(gmsq.SCHEMA, inputs, weight_layout="ENK")
    so = session_options()
    so.enable_profiling = True
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    got = tuple(sess.run(None, inputs))
    with open(sess.end_profiling()) as f:
        providers = {ev["args"].get("provider") for ev in json.load(f)
                     if ev.get("cat") == "Node" and ev["args"].get("op_name") == gmsq.OP}
    assert providers == {"CUDAExecutionProvider"}
    assert_exact(got, reference.grouped_matmul_swiglu_quant(**inputs, weight_layout="ENK"))
