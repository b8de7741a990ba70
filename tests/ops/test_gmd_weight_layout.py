# SPDX-License-Identifier: MIT
"""GroupedMatmulDequant's attribute weight_layout on the CPU EP, shared with GroupedMatmulSwigluQuant
(same reading, checks and messages: ``ort_ops.ops._moe.weight_ekn``, grouped_matmul::read_problem_layout).
"EN16K4" (weight [E, ceil(N/16), K/4, 16, 4], weight[e, n // 16, k // 4, n % 16, k % 4] = W_e[k, n])
and "ENK" (weight [E, N, K]) give the same float32 y as "EKN" and as the numpy reference, bit for
bit, on every kernel variant (the AMX panels read "EN16K4" as it is; the other variants unpack
each used expert per Run): N not a multiple of 16 (and odd), K a multiple of 4 only, rows
1/2/3/16/64/129 an expert, empty experts, rows past the last end, M = 0, counts, float16 scales,
the weight as a constant initializer. Bad layouts and shapes fail naming the attribute / the
layout, with the reference raising the same message.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from ort_ops.ops import grouped_matmul_dequant as gmd
from ort_ops.ops._moe import pack_en16k4
from ort_ops.ops._run import run_single_op
from tests.ops.test_grouped_matmul_dequant import assert_exact
from tests.ops.test_gmsq_weight_layout import _groups, skip_without_cuda_ep
from tests.ops.test_grouped_matmul_swiglu_quant import make_inputs, weight_initializer_session


def _run(inputs, **attrs):
    return run_single_op(gmd.SCHEMA, inputs, **attrs)[0]


def en16k4(inputs: dict) -> dict:
    return dict(inputs, weight=pack_en16k4(inputs["weight"], gmd.OP))


def enk(inputs: dict) -> dict:
    return dict(inputs, weight=np.ascontiguousarray(inputs["weight"].transpose(0, 2, 1)))


# (M, K, N, E, rows per expert or None): rows 1/2/3/16/64/129 an expert, empty experts, K = 4 * odd
# (not a multiple of 64), N odd / not a multiple of 16 / past a 32- or 64-column chunk edge, the
# down projection's shape class (K 704 -> N 2048).
CASES = [
    (1 + 2 + 3 + 16 + 64 + 129, 4 * 33, 37, 8, [1, 0, 2, 3, 16, 0, 64, 129]),
    (7, 4 * 3, 10, 3, None),
    (40, 4 * 65, 75, 6, [0, 1, 1, 16, 12, 0]),
    (300, 4 * 5, 33, 2, [129, 150]),
    (64, 256, 96, 4, [64, 0, 0, 0]),
    (5, 4, 1, 1, [4]),
    (20, 4 * 81, 301, 3, [3, 16, 1]),
    (24, 704, 2048, 8, [4, 0, 1, 3, 6, 2, 8, 0]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-K{}-N{}-E{}".format(*c[:4]))
def test_layouts_equal_ekn(rng, gemm_isa, case):
    m, k, n, e, rows = case
    gl = None if rows is None else _groups(rows)
    inputs = make_inputs(rng, m + 2, k, n, e, group_list=gl)  # two rows past the last end
    want = reference.grouped_matmul_dequant(**inputs)
    np.testing.assert_array_equal(reference.grouped_matmul_dequant(**en16k4(inputs), weight_layout="EN16K4"), want)
    np.testing.assert_array_equal(reference.grouped_matmul_dequant(**enk(inputs), weight_layout="ENK"), want)
    ekn = _run(inputs)
    assert_exact(ekn, want)
    got = _run(en16k4(inputs), weight_layout="EN16K4")
    assert_exact(got, want)
    np.testing.assert_array_equal(got, ekn)  # bit for bit, not only within the float tolerance
    np.testing.assert_array_equal(_run(enk(inputs), weight_layout="ENK"), ekn)
    np.testing.assert_array_equal(_run(inputs, weight_layout="EKN"), ekn)  # the explicit default
    assert not got[int(inputs["group_list"][-1]):].any()  # rows past the last end: zeros


def test_counts_float16_scales_and_m0(rng, gemm_isa):
    inputs = make_inputs(rng, 50, 4 * 19, 45, 5, scale_dtype=np.float16)
    counts = np.diff(np.concatenate([[0], inputs["group_list"]]))
    inputs["group_list"] = counts.astype(np.int64)
    want = reference.grouped_matmul_dequant(**inputs, group_list_type=1)
    np.testing.assert_array_equal(_run(en16k4(inputs), weight_layout="EN16K4", group_list_type=1), want)
    np.testing.assert_array_equal(_run(enk(inputs), weight_layout="ENK", group_list_type=1), want)
    empty = make_inputs(rng, 0, 16, 8, 3, group_list=[0, 0, 0])
    assert _run(en16k4(empty), weight_layout="EN16K4").shape == (0, 8)
    none = make_inputs(rng, 6, 16, 8, 3, group_list=[0, 0, 0])  # every row past the last end
    got = _run(en16k4(none), weight_layout="EN16K4")
    assert got.shape == (6, 8) and not got.any()


def test_constant_weight_initializer(rng, gemm_isa):
    """The rewrite's case: the packed weight is an initializer (several MB: the kernel asks for
    2 MB pages for it); outputs unchanged across runs."""
    inputs = en16k4(make_inputs(rng, 33, 4 * 176, 2048 + 16, 4, codes=(-127, 128)))
    sess, feeds = weight_initializer_session(inputs, schema=gmd.SCHEMA, weight_layout="EN16K4")
    want = reference.grouped_matmul_dequant(**inputs, weight_layout="EN16K4")
    for _ in range(2):
        np.testing.assert_array_equal(sess.run(None, feeds)[0], want)


LAYOUT_MSG = (r"attribute 'weight_layout' must be 'EKN' \(weight \[E, K, N\]\), 'ENK' \(weight \[E, N, K\]\) "
              r"or 'EN16K4' \(weight \[E, N/16, K/4, 16, 4\]\), got ")
ERRORS = [
    ("bad-layout", {}, "KNE", LAYOUT_MSG + "'KNE'"),
    ("int-layout", {}, 2, LAYOUT_MSG + "a non-string value"),
    ("k-not-multiple-of-4", {"x": np.zeros((6, 10), np.int8), "weight": np.zeros((3, 1, 2, 16, 4), np.int8)},
     "EN16K4", r"weight_layout 'EN16K4' needs K \(dim 1 of 'x'\) to be a multiple of 4, got 10"),
    ("ekn-weight-as-en16k4", {"weight": np.zeros((3, 12, 7), np.int8)}, "EN16K4",
     r"input 'weight' must be \[E, ceil\(N/16\), K/4, 16, 4\] = \[E, 1, 3, 16, 4\] for weight_layout 'EN16K4' "
     r"\(K of 'x', N of 'weight_scale'\), got \[3, 12, 7\]"),
    ("wrong-n-tiles", {"weight": np.zeros((3, 2, 3, 16, 4), np.int8)}, "EN16K4",
     r"input 'weight' must be \[E, ceil\(N/16\), K/4, 16, 4\] = \[E, 1, 3, 16, 4\] .*got \[3, 2, 3, 16, 4\]"),
    ("en16k4-experts", {"weight": np.zeros((2, 1, 3, 16, 4), np.int8)}, "EN16K4",
     r"input 'weight_scale' must have shape \[2, 7\], got \[3, 7\]"),
    ("en16k4-weight-dtype", {"weight": np.zeros((3, 1, 3, 16, 4), np.uint8)}, "EN16K4",
     r"input 'weight' must be int8, got uint8"),
    ("ekn-weight-as-enk", {"weight": np.zeros((3, 12, 7), np.int8)}, "ENK",
     r"input 'weight' must be \[E, N, K\] = \[E, N, 12\] for weight_layout 'ENK' \(K of 'x'\), got \[3, 12, 7\]"),
    ("en16k4-decreasing", {"weight": np.zeros((3, 1, 3, 16, 4), np.int8), "group_list": np.array([3, 2, 5])},
     "EN16K4", r"input 'group_list' must be non-decreasing and >= 0, got 2 at index 1 after 3"),
]


@pytest.mark.parametrize("name,override,layout,msg", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_layout_or_shape_fails_with_message(rng, name, override, layout, msg):
    inputs = make_inputs(rng, 6, 12, 7, 3, group_list=[1, 2, 5])
    inputs.update(override)
    with pytest.raises(Exception, match="GroupedMatmulDequant: " + msg):
        _run(inputs, weight_layout=layout)
    with pytest.raises(ValueError, match="GroupedMatmulDequant: " + msg):  # the reference: same message
        reference.grouped_matmul_dequant(**inputs, weight_layout=layout)


def test_schema_declares_the_attribute():
    attr = {a.name: a for a in gmd.SCHEMA.attrs}["weight_layout"]
    assert attr.kind == "string" and attr.default == "EKN"


@pytest.mark.cuda
@pytest.mark.parametrize("layout,msg", [
    ("EN16K4", r"GroupedMatmulDequant: weight_layout 'EN16K4' is a CPU layout; use 'EKN' on CUDA"),
    ("ENK", r"GroupedMatmulDequant: weight_layout 'ENK' is not supported on CUDA"),
])
def test_cuda_ep_refuses_by_name(rng, layout, msg):
    """GroupedMatmulDequant on ORT's CUDA EP reads "EKN" only. Skips without onnxruntime-gpu,
    torch with CUDA or a CUDA build."""
    import onnxruntime as ort

    from ort_ops._lib import session_options
    from ort_ops.ops._schema import single_op_model

    skip_without_cuda_ep()
    inputs = make_inputs(rng, 32, 64, 64, 2, group_list=[16, 32])
    inputs = en16k4(inputs) if layout == "EN16K4" else enk(inputs)
    model = single_op_model(gmd.SCHEMA, inputs, weight_layout=layout)
    sess = ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(Exception, match=msg):
        sess.run(None, inputs)
