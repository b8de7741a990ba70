# SPDX-License-Identifier: MIT
"""GroupedMatmulDequant on the CPU EP against ort_ops.reference.grouped_matmul_dequant.

The float32 output is bit-exact: int32 accumulation is exact and the dequantization is the same
two float32 multiplies in the same order ((float(acc) * x_scale) * weight_scale) everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from ort_ops.ops import grouped_matmul_dequant as gmd
from ort_ops.ops._run import run_single_op
from tests.ops.test_grouped_matmul_swiglu_quant import make_inputs
from tests.tolerances import MOE_FLOAT_EXACT_ATOL

SHAPES = [(1, 1, 1, 1), (7, 33, 10, 3), (64, 130, 300, 8), (129, 257, 129, 2), (250, 64, 260, 4)]


def _run(inputs, **attrs):
    return run_single_op(gmd.SCHEMA, inputs, **attrs)[0]


def assert_exact(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.all(np.isfinite(got))
    bad = np.argwhere(np.abs(got - want) > MOE_FLOAT_EXACT_ATOL)
    assert bad.size == 0, f"{len(bad)} values differ, first at {bad[:5].tolist()}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}-E{}".format(*s))
def test_matches_reference(rng, gemm_isa, shape):
    inputs = make_inputs(rng, *shape)
    assert_exact(_run(inputs), reference.grouped_matmul_dequant(**inputs))


def test_realistic_shape(rng, gemm_isa):
    """The down projection 704 -> 2048 with 8 experts."""
    inputs = make_inputs(rng, 40, 704, 2048, 8, codes=(-127, 128))
    assert_exact(_run(inputs), reference.grouped_matmul_dequant(**inputs))


@pytest.mark.parametrize("group_list", [[0, 0, 0], [9, 9, 9], [1, 2, 3], [0, 4, 6]])
def test_group_layouts(rng, gemm_isa, group_list):
    inputs = make_inputs(rng, 9, 40, 70, 3, group_list=group_list)
    got = _run(inputs)
    assert_exact(got, reference.grouped_matmul_dequant(**inputs))
    assert not got[group_list[-1]:].any()


def test_counts_and_float16_scales(rng, gemm_isa):
    inputs = make_inputs(rng, 30, 50, 70, 4, scale_dtype=np.float16)
    counts = np.diff(np.concatenate([[0], inputs["group_list"]])).astype(np.int64)
    want = reference.grouped_matmul_dequant(**inputs)
    assert_exact(_run(dict(inputs, group_list=counts), group_list_type=1), want)


def test_empty_m(rng):
    got = _run(make_inputs(rng, 0, 16, 8, 2, group_list=[0, 0]))
    assert got.shape == (0, 8)


ERRORS = [
    ({"group_list": [3, 2, 5]}, r"input 'group_list' must be non-decreasing"),
    ({"group_list": [1, 2, 9]}, r"input 'group_list' must end at <= 6 \(rows of 'x'\), got 9"),
    ({"weight_scale": np.ones((3, 9), np.float32)}, r"input 'weight_scale' must have shape \[3, 8\], got \[3, 9\]"),
    ({"x_scale": np.ones(7, np.float32)}, r"input 'x_scale' must have shape \[6\], got \[7\]"),
    ({"x": np.zeros((6, 10), np.int32)}, r"input 'x' must be int8, got int32"),
    ({"weight": np.zeros((3, 9, 8), np.int8)}, r"input 'weight' must have shape \[E, 10, N\]"),
]


@pytest.mark.parametrize("override,msg", ERRORS)
def test_bad_input_fails_with_message(rng, override, msg):
    inputs = make_inputs(rng, 6, 10, 8, 3, group_list=[1, 2, 5])
    inputs.update({k: (np.asarray(v, np.int64) if k == "group_list" else v) for k, v in override.items()})
    with pytest.raises(Exception, match="GroupedMatmulDequant: " + msg):
        _run(inputs)
    with pytest.raises(ValueError, match=msg):
        reference.grouped_matmul_dequant(**inputs)


def test_odd_n_is_fine(rng):
    """Only the SwiGLU op needs an even N."""
    inputs = make_inputs(rng, 5, 12, 7, 2)
    assert_exact(_run(inputs), reference.grouped_matmul_dequant(**inputs))


@pytest.mark.parametrize("k", [3, 257, 1037])
def test_few_row_experts(rng, gemm_isa, k):
    """Experts of 1-4 rows take the K-split path; see the SwiGLU op's test of the same name."""
    inputs = make_inputs(rng, 12, k, 150, 5, group_list=[1, 3, 3, 6, 10])
    inputs["x"][0, :] = -128
    assert_exact(_run(inputs), reference.grouped_matmul_dequant(**inputs))


def test_row_blocks(rng, gemm_isa):
    """Experts of 2-129 rows around the tiles' row blocks (AMX: 16 and 32 rows; AVX: 3 or 6), K
    not a multiple of 64, N not a multiple of the 64-column packing group."""
    counts = [2, 3, 15, 16, 17, 31, 32, 33, 64, 70, 128, 129]
    inputs = make_inputs(rng, sum(counts) + 5, 300, 530, len(counts), group_list=np.cumsum(counts))
    inputs["x"][-10:, :] = -128
    assert_exact(_run(inputs), reference.grouped_matmul_dequant(**inputs))
