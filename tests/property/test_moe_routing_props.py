# SPDX-License-Identifier: MIT
"""MoeInitRouting and MoeFinalizeRouting on the CPU EP against their references for random valid
inputs: 0..64 tokens, top-k 1..8, 1..64 experts (most of them empty when tokens are few, all
tokens on one expert, repeated experts within a token), float32/float16 values including extremes,
with and without residual; outputs bit for bit. Invalid inputs (expert ids out of range, a
sorted_to_flat that is not a permutation, disagreeing shapes, ranks, dtypes, num_experts < 1,
misaligned buffers) are refused naming the op and the input."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ort_ops import reference
from ort_ops.ops import moe_finalize_routing, moe_init_routing
from tests.property import _harness as h
from tests.property import _strategies as S

INIT = moe_init_routing.SCHEMA
FINAL = moe_finalize_routing.SCHEMA


def _ids(rng, m, k, e, how):
    if how == "one_expert":
        return np.full((m, k), e - 1, np.int32)
    if how == "distinct" and k <= e and m:
        return np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32).reshape(m, k)
    return rng.integers(0, e, (m, k)).astype(np.int32)


@st.composite
def init_inputs(draw):
    rng = np.random.default_rng(draw(S.seeds))
    m, k, e = draw(st.integers(0, 64)), draw(st.integers(1, 8)), draw(st.sampled_from([1, 2, 3, 8, 64]))
    hdim = draw(st.sampled_from([1, 7, 64, 130]))
    x = S.floats(rng, (m, hdim), draw(S.float_dtypes), draw(S.regimes))
    ids = _ids(rng, m, k, e, draw(st.sampled_from(["random", "one_expert", "distinct"])))
    return {"x": x, "expert_ids": ids}, {"num_experts": e}


@given(init_inputs())
def test_init_routing_matches_reference(case):
    ins, attrs = case
    want = reference.moe_init_routing(**ins, **attrs)
    got = h.run(INIT, ins, attrs)
    for name, g, w in zip(INIT.output_names(), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), name


@st.composite
def finalize_inputs(draw):
    rng = np.random.default_rng(draw(S.seeds))
    m, k, hdim = draw(st.integers(0, 64)), draw(st.integers(1, 8)), draw(st.sampled_from([1, 7, 64, 130]))
    dt = draw(S.float_dtypes)
    ins = {"expert_out": S.floats(rng, (m * k, hdim), dt, draw(S.regimes)),
           "sorted_to_flat": rng.permutation(m * k).astype(np.int32),
           "topk_weights": S.floats(rng, (m, k), draw(S.float_dtypes), draw(st.sampled_from(["normal", "ties", "zeros"]))),
           "residual": S.floats(rng, (m, hdim), draw(S.float_dtypes), "normal") if draw(st.booleans()) else None}
    return ins


@given(finalize_inputs())
def test_finalize_routing_matches_reference(ins):
    with np.errstate(over="ignore", invalid="ignore"):
        want = reference.moe_finalize_routing(**ins)
    (got,) = h.run(FINAL, ins)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)  # NaN == NaN here: an Inf - Inf in both is the same


@st.composite
def init_invalid(draw):
    (ins, attrs) = draw(init_inputs())
    m, k = ins["expert_ids"].shape
    e = attrs["num_experts"]
    kind = draw(st.sampled_from(["id_high", "id_negative", "x_rank", "ids_rows", "ids_dtype", "x_dtype",
                                 "num_experts", "misaligned"]))
    bad = "expert_ids"
    if kind in ("id_high", "id_negative") and m:
        ins["expert_ids"].flat[draw(st.integers(0, m * k - 1))] = (
            draw(st.integers(e, 2**31 - 1)) if kind == "id_high" else draw(st.integers(-2**31, -1)))
    elif kind == "x_rank":
        bad = "x"
        ins["x"] = ins["x"].reshape(-1)
    elif kind == "misaligned" and m:
        bad = draw(st.sampled_from(["x", "expert_ids"]))
        ins[bad] = S.misaligned(ins[bad])
        return ins, attrs, bad, False
    elif kind == "ids_rows":
        ins["expert_ids"] = np.zeros((m + 1, k), np.int32)
    elif kind == "ids_dtype":
        ins["expert_ids"] = ins["expert_ids"].astype(np.int64)
    elif kind == "x_dtype":
        bad = "x"
        ins["x"] = ins["x"].astype(np.float64)
    else:
        bad = "num_experts"
        attrs["num_experts"] = draw(st.integers(-5, 0))
    return ins, attrs, bad, True


@given(init_invalid())
def test_init_routing_invalid_refused(case):
    ins, attrs, bad, ref_refuses = case  # numpy has no notion of a misaligned buffer
    h.assert_refused(INIT, ins, attrs, bad, reference=reference.moe_init_routing if ref_refuses else None)


@st.composite
def finalize_invalid(draw):
    ins = draw(finalize_inputs())
    mk = ins["sorted_to_flat"].size
    m, k = ins["topk_weights"].shape
    kind = draw(st.sampled_from(["repeat", "out_of_range", "s2f_shape", "s2f_dtype", "weights_shape",
                                 "expert_out_rows", "residual_shape", "expert_out_dtype", "misaligned"]))
    bad = "sorted_to_flat"
    s2f = ins["sorted_to_flat"]
    if kind == "repeat" and mk >= 2:
        i, j = draw(st.integers(0, mk - 1)), draw(st.integers(0, mk - 1))
        if i == j:
            j = (i + 1) % mk
        s2f[i] = s2f[j]
    elif kind == "out_of_range" and mk:
        s2f[draw(st.integers(0, mk - 1))] = draw(st.one_of(st.integers(mk, 2**31 - 1), st.integers(-2**31, -1)))
    elif kind == "misaligned" and mk:
        bad = draw(st.sampled_from(["expert_out", "sorted_to_flat", "topk_weights"]))
        ins[bad] = S.misaligned(ins[bad])
        return ins, bad, False
    elif kind == "s2f_shape":
        ins["sorted_to_flat"] = np.append(s2f, np.int32(mk))
    elif kind == "s2f_dtype":
        ins["sorted_to_flat"] = s2f.astype(np.int64)
    elif kind == "weights_shape":
        bad = ["topk_weights", "expert_out", "sorted_to_flat"]  # topk_weights defines M and K for the others
        ins["topk_weights"] = np.zeros((m + 1, k), np.float32)
    elif kind == "expert_out_rows":
        bad = "expert_out"
        ins["expert_out"] = np.zeros((mk + 1, ins["expert_out"].shape[1]), np.float32)
    elif kind == "residual_shape":
        bad = "residual"
        ins["residual"] = np.zeros((m, ins["expert_out"].shape[1] + 1), np.float32)
    else:
        bad = "expert_out"
        ins["expert_out"] = ins["expert_out"].astype(np.float64)
    return ins, bad, True


@given(finalize_invalid())
def test_finalize_routing_invalid_refused(case):
    ins, bad, ref_refuses = case  # numpy has no notion of a misaligned buffer
    with np.errstate(over="ignore", invalid="ignore"):
        h.assert_refused(FINAL, ins, {}, bad, reference=reference.moe_finalize_routing if ref_refuses else None)
