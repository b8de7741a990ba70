# SPDX-License-Identifier: MIT
"""The SwiGLU pass (ort_ops/rewrite/swiglu.py): Split -> SiLU -> Mul becomes one SwiGLU node in
both SiLU forms, checked against numpy's float64 SwiGLU and against the fixture's rewrite without
the pass; Splits not used that way are left alone; the pass is on by default and swiglu=False
turns it off."""

from __future__ import annotations

import collections
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ort_ops
from ort_ops import reference
from ort_ops.rewrite.pipeline import RewriteOptions
from ort_ops.rewrite.swiglu import fuse_swiglu
from tests.tolerances import SWIGLU_REWRITE_LOGITS_ATOL_REL

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
W = 16  # the Split input's last dim: halves of 8


def _silu_nodes(form: str, gate: str, out: str) -> list[onnx.NodeProto]:
    if form == "quickgelu":
        return [helper.make_node("QuickGelu", [gate], [out], domain="com.microsoft", alpha=1.0)]
    return [helper.make_node("Sigmoid", [gate], [f"{out}_sig"]), helper.make_node("Mul", [gate, f"{out}_sig"], [out])]


def _model(form: str, opset: int = 18, dtype=TensorProto.FLOAT, sizes=(W // 2, W // 2), extra_reader=False):
    """x [2, 3, W] -> Split(sizes, last axis) -> SiLU(first) -> Mul(., second) -> Identity -> y.
    ``extra_reader``: the second half is also a graph output's input (not fusable)."""
    inits, split_inputs = [], ["x"]
    attrs = {"axis": -1}
    if sizes is not None:
        if opset >= 13:
            inits.append(helper.make_tensor("sizes", TensorProto.INT64, [2], list(sizes)))
            split_inputs.append("sizes")
        else:
            attrs["split"] = list(sizes)
    nodes = [helper.make_node("Split", split_inputs, ["g", "u"], **attrs),
             *_silu_nodes(form, "g", "s"),
             helper.make_node("Mul", ["s", "u"], ["h"]),
             helper.make_node("Identity", ["h"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", dtype, None)]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["u"], ["u_neg"]))
        outputs.append(helper.make_tensor_value_info("u_neg", dtype, None))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", dtype, [2, 3, W])], outputs, inits)
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def _session(proto: onnx.ModelProto):
    return ort.InferenceSession(proto.SerializeToString(), ort_ops.session_options(),
                                providers=["CPUExecutionProvider"])


def _fuse(proto):
    m = ir.serde.deserialize_model(proto)
    result = fuse_swiglu(m, RewriteOptions(swiglu=True))
    return ir.serde.serialize_model(m), result


@pytest.mark.parametrize("form", ["quickgelu", "sigmoid_mul"])
@pytest.mark.parametrize("opset,sizes", [(18, (8, 8)), (11, (8, 8)), (18, None)],
                         ids=["sizes-input", "sizes-attr", "equal-split"])
def test_block_becomes_one_swiglu(form, opset, sizes):
    out, result = _fuse(_model(form, opset, sizes=sizes))
    assert result.fused == 1 and result.details["forms"] == {form: 1} and not result.declined
    ops = collections.Counter((n.domain, n.op_type) for n in out.graph.node)
    assert ops == {("ort_ops", "SwiGLU"): 1, ("", "Identity"): 1}
    assert not [i for i in out.graph.initializer if i.name == "sizes"]  # the unread sizes are gone
    x = (np.random.default_rng(5).standard_normal((2, 3, W)) * 4).astype(np.float32)
    (y,) = _session(out).run(None, {"x": x})
    a, b = x[..., :W // 2].astype(np.float64), x[..., W // 2:].astype(np.float64)
    np.testing.assert_allclose(y, a / (1 + np.exp(-a)) * b, rtol=1e-6, atol=1e-6)


def test_float16_block():
    out, result = _fuse(_model("sigmoid_mul", dtype=TensorProto.FLOAT16))
    assert result.fused == 1
    x = np.random.default_rng(6).standard_normal((2, 3, W)).astype(np.float16)
    (y,) = _session(out).run(None, {"x": x})
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, reference.swiglu(x))


@pytest.mark.parametrize("case,reason", [
    ("unequal", "are not two equal halves"),
    ("extra_reader", "not read only by one Mul"),
    ("alpha", None),
    ("swapped", None),
    ("three_way", None),
])
def test_other_splits_are_left_alone(case, reason):
    """Unequal sizes, a second reader of the up half, QuickGelu with GELU's alpha 1.702, SiLU on
    the second half, a three-way Split: the graph is unchanged (declined with a reason where the
    block looks like an activation, silently where it is not one)."""
    if case == "unequal":
        proto = _model("sigmoid_mul", sizes=(6, 10))
    elif case == "extra_reader":
        proto = _model("quickgelu", extra_reader=True)
    elif case == "alpha":
        proto = _model("quickgelu")
        proto.graph.node[1].attribute[0].f = 1.702
    elif case == "swapped":  # silu(second half) * first half: not SwiGLU's [a | b] order
        proto = _model("sigmoid_mul")
        for n in proto.graph.node[1:]:
            n.input[:] = [{"g": "u", "u": "g"}.get(i, i) for i in n.input]
    else:
        proto = _model("sigmoid_mul")
        proto.graph.node[0].output.append("rest")
        proto.graph.initializer[0].CopyFrom(helper.make_tensor("sizes", TensorProto.INT64, [3], [8, 4, 4]))
    before = [(n.op_type, list(n.input), list(n.output)) for n in proto.graph.node]
    out, result = _fuse(proto)
    assert result.fused == 0
    assert [(n.op_type, list(n.input), list(n.output)) for n in out.graph.node] == before
    if reason is None:
        assert not result.declined
    else:
        assert len(result.declined) == 1 and reason in result.declined[0].reason


def test_on_by_default_and_the_option_turns_it_off():
    """The default rewrite of the 2-layer fixture fuses each layer's MLP activation (no Split left:
    rotary_kv took the Q/K/V ones); swiglu=False leaves the pass out of the report and the gate/up
    Splits in the graph."""
    assert RewriteOptions().swiglu is True
    src = str(FIXTURES / "attention" / "dynamo_sdpa_kv.onnx")
    m, results = ort_ops.rewrite_model(src)
    r = next(r for r in results if r.kind == "swiglu")
    assert r.fused == 2 and not r.declined, r.declined
    ops = collections.Counter(n.op_type for n in m.graph)
    assert ops["SwiGLU"] == 2 and ops["Split"] == 0
    off, results = ort_ops.rewrite_model(src, swiglu=False)
    assert all(r.kind != "swiglu" for r in results)
    ops = collections.Counter(n.op_type for n in off.graph)
    assert ops["SwiGLU"] == 0 and ops["Split"] == 2


@pytest.mark.parametrize("fixture,dtype", [("dynamo_sdpa_kv.onnx", "float32"), ("dynamo_sdpa_kv_fp16.onnx", "float16")])
def test_fixture_mlp_fused_logits_unchanged(fixture, dtype):
    """The 2-layer torch.onnx export (Sigmoid + Mul SiLU): each layer's MLP activation becomes one
    SwiGLU after matmul_concat; the paged model's logits through prefill and decode steps stay
    those of the same rewrite without the pass."""
    from ort_ops.runtime import PagedRunner

    src = str(FIXTURES / "attention" / fixture)
    fused, results = ort_ops.rewrite_model(src, swiglu=True)
    plain, _ = ort_ops.rewrite_model(src, swiglu=False)
    r = next(r for r in results if r.kind == "swiglu")
    assert r.fused == 2 and r.details["forms"] == {"sigmoid_mul": 2} and not r.declined

    def count(m):
        return collections.Counter(n.op_type for n in m.graph)

    cf, cp = count(fused), count(plain)
    assert cf["SwiGLU"] == 2 and cp["Sigmoid"] - cf["Sigmoid"] == 2 and cp["Mul"] - cf["Mul"] == 4
    assert cp["Split"] - cf["Split"] == 2
    runners = [PagedRunner(ir.serde.serialize_model(m).SerializeToString()) for m in (fused, plain)]
    rng = np.random.default_rng(4)
    steps = [{0: rng.integers(3, 100, 19), 1: rng.integers(3, 100, 5)}] + [{0: [int(t)], 1: [int(u)]}
                                                                          for t, u in rng.integers(3, 100, (4, 2))]
    for step in steps:
        a, b = (run.step(step) for run in runners)
        assert np.isfinite(a).all() and np.isfinite(b).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=SWIGLU_REWRITE_LOGITS_ATOL_REL[dtype] * max(1.0, float(np.abs(b).max())))
        assert (a.argmax(-1) == b.argmax(-1)).all()
