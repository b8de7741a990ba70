# SPDX-License-Identifier: MIT
"""The graph helpers both rewrite passes share (``ort_ops.rewrite._graph``): which values count as
constants, folding layout ops over constants, synthetic probe feeds and the probe session
(bfloat16 models as their float32 twin, large models from a file). Expected values are numpy's."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from ort_ops.ops._schema import IR_VERSION, ONNX_OPSET
from ort_ops.rewrite import _graph as g


def _model(nodes, inputs, outputs, inits=()) -> ir.Model:
    graph = helper.make_graph(nodes, "helpers", inputs, outputs, list(inits))
    proto = helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    return ir.serde.deserialize_model(proto)


def _values(model: ir.Model) -> dict[str, ir.Value]:
    return {v.name: v for v in g.named_values(model.graph)}


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def test_const_array_reads_initializers_and_constant_nodes_only():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [helper.make_node("Constant", [], ["cf"], value_float=0.25),
             helper.make_node("Constant", [], ["ci"], value_ints=[3, -1]),
             helper.make_node("Constant", [], ["ct"], value=numpy_helper.from_array(w, "ct")),
             helper.make_node("Add", ["x", "w"], ["y"])]
    model = _model(nodes, [_vi("x", TensorProto.FLOAT, [2, 3])], [_vi("y", TensorProto.FLOAT, [2, 3])],
                   [numpy_helper.from_array(w, "w")])
    v = _values(model)
    np.testing.assert_array_equal(g.const_array(v["w"]), w)
    np.testing.assert_array_equal(g.const_array(v["ct"]), w)
    cf, ci = g.const_array(v["cf"]), g.const_array(v["ci"])
    assert cf.dtype == np.float32 and cf == np.float32(0.25)
    assert ci.dtype == np.int64 and ci.tolist() == [3, -1]
    assert g.const_array(v["x"]) is None and g.const_array(v["y"]) is None and g.const_array(None) is None
    assert g.const_scalar(v["cf"]) == 0.25 and g.const_scalar(v["w"]) is None


def test_const_array_refuses_an_initializer_that_is_also_a_graph_input():
    """An initializer listed among the inputs is a default the caller may override: not a constant."""
    w = np.ones((2, 3), np.float32)
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])],
                   [_vi("x", TensorProto.FLOAT, [2, 3]), _vi("w", TensorProto.FLOAT, [2, 3])],
                   [_vi("y", TensorProto.FLOAT, [2, 3])], [numpy_helper.from_array(w, "w")])
    v = _values(model)
    assert v["w"].const_value is not None and v["w"].is_graph_input()
    assert g.const_array(v["w"]) is None
    assert g.fold_const(v["w"]) is None


def test_const_array_gives_bfloat16_as_float32():
    vals = [0.5, -1.25, 3.0, 96.0, -0.0078125, 1.0]  # exactly representable in bfloat16
    t = helper.make_tensor("w", TensorProto.BFLOAT16, [2, 3], vals)
    model = _model([helper.make_node("Identity", ["w"], ["y"])], [], [_vi("y", TensorProto.BFLOAT16, [2, 3])], [t])
    got = g.const_array(_values(model)["w"])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array(vals, np.float32).reshape(2, 3))


def test_fold_const_evaluates_layout_chains_over_constants():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 6, 8)).astype(np.float16)

    def i64(name, a):
        return numpy_helper.from_array(np.array(a, np.int64), name)

    inits = [numpy_helper.from_array(w, "w"), i64("idx", 2), i64("shape", [0, 12, 4]), i64("starts", [1]),
             i64("ends", [7]), i64("axes", [2]), i64("split", [3, 3]), i64("ax0", [0])]
    nodes = [helper.make_node("Transpose", ["w"], ["t"], perm=[0, 2, 1]),          # [4, 8, 6]
             helper.make_node("Reshape", ["t", "shape"], ["r"]),                    # [4, 12, 4]
             helper.make_node("Gather", ["r", "idx"], ["gth"], axis=0),             # [12, 4]
             helper.make_node("Unsqueeze", ["gth", "ax0"], ["u"]),                  # [1, 12, 4]
             helper.make_node("Slice", ["w", "starts", "ends", "axes"], ["s"]),      # [4, 6, 6]
             helper.make_node("Split", ["s", "split"], ["s0", "s1"], axis=2),       # [4, 6, 3] x2
             helper.make_node("Cast", ["s1"], ["c"], to=TensorProto.FLOAT),
             helper.make_node("Squeeze", ["u", "ax0"], ["sq"]),
             helper.make_node("Add", ["c", "x"], ["y"])]                             # not a layout op
    model = _model(nodes, [_vi("x", TensorProto.FLOAT, [4, 6, 3])], [_vi("y", TensorProto.FLOAT, [4, 6, 3])],
                   inits)
    v = _values(model)
    want_r = np.transpose(w, (0, 2, 1)).reshape(4, 12, 4)
    np.testing.assert_array_equal(g.fold_const(v["r"]), want_r)
    np.testing.assert_array_equal(g.fold_const(v["u"]), want_r[2][None])
    np.testing.assert_array_equal(g.fold_const(v["sq"]), want_r[2])
    np.testing.assert_array_equal(g.fold_const(v["s0"]), w[:, :, 1:4])
    c = g.fold_const(v["c"])
    assert c.dtype == np.float32
    np.testing.assert_array_equal(c, w[:, :, 4:7].astype(np.float32))
    assert g.fold_const(v["y"]) is None  # Add of a graph input


def test_synthetic_feeds_shapes_and_values():
    """Batch 1, the asked token count on the symbolic token axis, an empty cache, token ids below the
    vocabulary of the embedding table they index."""
    vocab, h = 11, 4
    emb = numpy_helper.from_array(np.zeros((vocab, h), np.float32), "emb")
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["e"], axis=0),
             helper.make_node("Identity", ["attention_mask"], ["m"]),
             helper.make_node("Identity", ["position_ids"], ["p"]),
             helper.make_node("Identity", ["past_key"], ["pk"]),
             helper.make_node("Identity", ["x"], ["xo"])]
    inputs = [_vi("input_ids", TensorProto.INT64, ["B", "S"]), _vi("attention_mask", TensorProto.INT64, ["B", "L"]),
              _vi("position_ids", TensorProto.INT64, ["B", "S"]),
              _vi("past_key", TensorProto.FLOAT, ["B", 2, "P", "8"]), _vi("x", TensorProto.FLOAT, ["T", h])]
    outputs = [_vi(n, TensorProto.FLOAT, None) for n in ("e", "pk", "xo")]
    outputs += [_vi(n, TensorProto.INT64, None) for n in ("m", "p")]
    model = _model(nodes, inputs, outputs, [emb])
    feeds = g.synthetic_feeds(model.graph, 5, np.random.default_rng(0))
    assert feeds["input_ids"].shape == (1, 5) and feeds["input_ids"].dtype == np.int64
    assert feeds["input_ids"].min() >= 0 and feeds["input_ids"].max() < vocab
    np.testing.assert_array_equal(feeds["attention_mask"], np.ones((1, 5), np.int64))
    np.testing.assert_array_equal(feeds["position_ids"], np.arange(5)[None])
    assert feeds["past_key"].shape == (1, 2, 0, 8)  # "8": a static dim written as a digit string
    assert feeds["x"].shape == (5, h) and feeds["x"].dtype == np.float32
    assert "emb" not in feeds


def _matmul_model(elem) -> ir.Model:
    w = helper.make_tensor("w", elem, [3, 2], [0.5, -1.0, 2.0, 0.25, -3.0, 1.5])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    return _model(nodes, [_vi("x", elem, ["T", 3])], [_vi("y", elem, ["T", 2])], [w])


W32 = np.array([0.5, -1.0, 2.0, 0.25, -3.0, 1.5], np.float32).reshape(3, 2)
X32 = np.array([[1.0, 2.0, -1.0], [0.5, -0.25, 4.0]], np.float32)  # products and sums exact in float32


@pytest.mark.parametrize("inline_limit", [g.PROBE_INLINE_LIMIT, 0], ids=["inline", "from-file"])
def test_prober_reads_intermediates_and_leaves_the_model_unchanged(monkeypatch, inline_limit):
    """An intermediate comes back as numpy computes it, over repeated runs; with the inline limit at 0
    the model is probed from a temporary file with external data (the path of models over 2 GB)."""
    monkeypatch.setattr(g, "PROBE_INLINE_LIMIT", inline_limit)
    model = _matmul_model(TensorProto.FLOAT)
    prober = g.Prober(model, [_values(model)["h"]])
    assert [v.name for v in model.graph.outputs] == ["y"]
    for x in (X32, X32[:1] * 2):
        got = prober.run({"x": x})
        np.testing.assert_array_equal(got["h"], x @ W32)
    np.testing.assert_array_equal(g.run_probe(model, [_values(model)["h"]], {"x": X32})["h"], X32 @ W32)


def test_prober_runs_a_bfloat16_model_as_its_float32_twin():
    model = _matmul_model(TensorProto.BFLOAT16)
    assert g.has_bfloat16(model)
    prober = g.Prober(model, [_values(model)["h"], _values(model)["y"]])
    assert not g.has_bfloat16(prober.model) and g.has_bfloat16(model)
    got = prober.run({"x": X32})
    assert got["h"].dtype == np.float32
    np.testing.assert_array_equal(got["h"], X32 @ W32)
    np.testing.assert_array_equal(got["y"], np.maximum(X32 @ W32, 0))
