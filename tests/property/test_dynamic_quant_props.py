# SPDX-License-Identifier: MIT
"""DynamicQuant on the CPU EP against ort_ops.reference.dynamic_quant for random shapes (rank 1-4,
zero rows, one column), float32/float16, with and without smooth_scale, values from tiny to huge,
exact ties, non-contiguous arrays, on every ISA variant: codes and scales bit for bit. Invalid
inputs (NaN/Inf anywhere, a smooth_scale of the wrong shape, a wrong dtype, a misaligned buffer)
are refused with an error naming the op and the input."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ort_ops import reference
from ort_ops.ops import dynamic_quant
from tests.property import _harness as h
from tests.property import _strategies as S

SCHEMA = dynamic_quant.SCHEMA
OP = SCHEMA.name


@st.composite
def valid_inputs(draw):
    rank = draw(st.integers(1, 4))
    lead = draw(st.lists(st.integers(0, 5), min_size=rank - 1, max_size=rank - 1))
    k = draw(st.one_of(st.integers(1, 8), st.integers(9, 300), st.sampled_from([1, 7, 8, 31, 32, 33, 64, 4096])))
    dtype = draw(S.float_dtypes)
    rng = np.random.default_rng(draw(S.seeds))
    x = S.floats(rng, (*lead, k), dtype, draw(S.regimes))
    smooth = None
    if draw(st.booleans()):
        smooth = S.floats(rng, (k,), draw(S.float_dtypes), draw(st.sampled_from(["normal", "ties", "outliers"])))
    if draw(st.booleans()):
        x = np.repeat(x, 2, axis=-1)[..., ::2]  # a non-contiguous view (onnxruntime copies it)
    return {"x": x, "smooth_scale": smooth}, draw(S.isas())


@given(valid_inputs())
def test_matches_reference(case):
    ins, isa = case
    try:
        with np.errstate(over="ignore"):  # x * smooth_scale may overflow: then both must refuse
            want = reference.dynamic_quant(**ins)
    except ValueError:  # x * smooth_scale overflowed: the kernel must refuse it too
        h.assert_refused(SCHEMA, ins, {}, ["x", "smooth_scale"], isa=isa)
        return
    y, scale = h.run(SCHEMA, ins, isa=isa)
    assert y.dtype == np.int8 and y.shape == ins["x"].shape
    assert scale.dtype == np.float32 and scale.shape == ins["x"].shape[:-1]
    np.testing.assert_array_equal(y, want[0])
    np.testing.assert_array_equal(scale.view(np.int32), want[1].view(np.int32))  # bit for bit, -0 too


@st.composite
def invalid_inputs(draw):
    rng = np.random.default_rng(draw(S.seeds))
    rows, k = draw(st.integers(1, 6)), draw(st.integers(1, 80))
    dtype = draw(S.float_dtypes)
    x = S.floats(rng, (rows, k), dtype, "normal")
    smooth = S.floats(rng, (k,), dtype, "normal") if draw(st.booleans()) else None
    kind = draw(st.sampled_from(["nonfinite_x", "nonfinite_smooth", "smooth_shape", "smooth_rank", "x_rank0",
                                 "x_dtype", "smooth_dtype", "misaligned"]))
    bad = "x"
    if kind == "nonfinite_x":
        x.flat[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif kind == "nonfinite_smooth":
        smooth = S.floats(rng, (k,), dtype, "normal")
        smooth[draw(st.integers(0, k - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        bad = ["x", "smooth_scale"]  # the product x * smooth_scale is what is found non-finite
    elif kind == "smooth_shape":
        smooth = S.floats(rng, (k + draw(st.sampled_from([-1, 1, 5])),), dtype, "normal")
        bad = "smooth_scale"
    elif kind == "smooth_rank":
        smooth = S.floats(rng, (1, k), dtype, "normal")
        bad = "smooth_scale"
    elif kind == "x_rank0":
        x = np.asarray(x.flat[0])
    elif kind == "misaligned":
        if smooth is not None and draw(st.booleans()):
            bad, smooth = "smooth_scale", S.misaligned(smooth)
        else:
            x = S.misaligned(x)
        return {"x": x, "smooth_scale": smooth}, bad, draw(S.isas()), False
    elif kind == "x_dtype":
        x = x.astype(draw(st.sampled_from([np.float64, np.int32, np.int8])))
    else:
        smooth = S.floats(rng, (k,), dtype, "normal").astype(np.float64)
        bad = "smooth_scale"
    return {"x": x, "smooth_scale": smooth}, bad, draw(S.isas()), True


@given(invalid_inputs())
def test_invalid_refused(case):
    ins, bad, isa, ref_refuses = case  # numpy has no notion of a misaligned buffer: the reference takes it
    h.assert_refused(SCHEMA, ins, {}, bad, isa=isa, reference=reference.dynamic_quant if ref_refuses else None)
