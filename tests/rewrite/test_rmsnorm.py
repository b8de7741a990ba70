# SPDX-License-Identifier: MIT
"""The RMSNorm fusion (ort_ops/rewrite/rmsnorm.py): each exported chain becomes one
SimplifiedLayerNormalization with the chain's function, checked against numpy's RMSNorm and
against the unfused model on onnxruntime; chains that differ in any step are left alone."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ort_ops.rewrite import load_model
from ort_ops.rewrite import _graph as g
from ort_ops.rewrite.pipeline import RewriteOptions
from ort_ops.rewrite.rmsnorm import fuse_rmsnorm

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
H = 16
EPS = 1e-5


def _chain(dtype=TensorProto.FLOAT, square="pow", root="reciprocal", axes=(-1,), keepdims=1, eps=EPS,
           weight_shape=(H,), extra_use=False, weight_input=False, opset=18):
    """A one-norm model y = RMSNorm(x) * w written the way torch.onnx writes it."""
    narrow = dtype != TensorProto.FLOAT
    nodes, inits = [], []
    x32 = "x"
    if narrow:
        nodes.append(helper.make_node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT))
        x32 = "x32"
    if square == "pow":
        inits.append(helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]))
        nodes.append(helper.make_node("Pow", [x32, "two"], ["sq"]))
    else:
        nodes.append(helper.make_node("Mul", [x32, x32], ["sq"]))
    if opset >= 18:
        inits.append(helper.make_tensor("axes", TensorProto.INT64, [len(axes)], list(axes)))
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=keepdims))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["ms"], axes=list(axes), keepdims=keepdims))
    eps_arr = np.full((), eps, np.float32) if np.isscalar(eps) else np.asarray(eps, np.float32)
    inits.append(helper.make_tensor("eps", TensorProto.FLOAT, list(eps_arr.shape), eps_arr.reshape(-1).tolist()))
    nodes += [helper.make_node("Add", ["ms", "eps"], ["var"]), helper.make_node("Sqrt", ["var"], ["rt"])]
    if root == "reciprocal":
        nodes += [helper.make_node("Reciprocal", ["rt"], ["inv"]), helper.make_node("Mul", [x32, "inv"], ["y32"])]
    else:
        nodes.append(helper.make_node("Div", [x32, "rt"], ["y32"]))
    y = "y32"
    if narrow:
        nodes.append(helper.make_node("Cast", ["y32"], ["yn"], to=dtype))
        y = "yn"
    w = np.random.default_rng(1).uniform(0.5, 1.5, weight_shape).astype(helper.tensor_dtype_to_np_dtype(dtype))
    inputs = [helper.make_tensor_value_info("x", dtype, [2, 3, H])]
    if weight_input:
        inputs.append(helper.make_tensor_value_info("w", dtype, list(weight_shape)))
    else:
        inits.append(helper.make_tensor("w", dtype, list(weight_shape), w.reshape(-1).tolist()))
    nodes.append(helper.make_node("Mul", ["w", y], ["out"]))
    nodes.append(helper.make_node("Identity", ["out"], ["out_copy"]))
    outputs = [helper.make_tensor_value_info("out_copy", dtype, None)]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("ms", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "rms", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), w


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _fused(proto: onnx.ModelProto):
    m = ir.serde.deserialize_model(proto)
    result = fuse_rmsnorm(m, RewriteOptions())
    return ir.serde.serialize_model(m), result


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize("square,root,opset", [("pow", "reciprocal", 18), ("mul", "div", 18), ("pow", "div", 17)])
def test_chain_becomes_one_node_with_numpys_rmsnorm(dtype, square, root, opset):
    proto, w = _chain(dtype, square, root, opset=opset)
    fused, result = _fused(proto)
    assert result.fused == 1
    assert [n.op_type for n in fused.graph.node] == ["SimplifiedLayerNormalization", "Identity"]
    x = np.random.default_rng(2).standard_normal((2, 3, H)).astype(helper.tensor_dtype_to_np_dtype(dtype))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + EPS) * w.astype(np.float64)
    got = _run(fused, {"x": x})[0].astype(np.float64)
    chain = _run(proto, {"x": x})[0].astype(np.float64)
    # float32: both within float32 rounding of fp64; float16: the fused node rounds once where
    # the chain rounds y before the weight multiply, so each is within 2 fp16 ulps of fp64.
    tol = 1e-5 if dtype == TensorProto.FLOAT else 2 * 2.0 ** -10
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(chain, want, rtol=tol, atol=tol)


def test_weight_of_shape_1_1_h_becomes_a_1d_scale():
    proto, w = _chain(weight_shape=(1, 1, H))
    fused, result = _fused(proto)
    assert result.fused == 1
    x = np.random.default_rng(3).standard_normal((2, 3, H)).astype(np.float32)
    np.testing.assert_allclose(_run(fused, {"x": x})[0], _run(proto, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [
    {"axes": (1,)},                    # mean over another axis
    {"keepdims": 0},                   # the mean's axis dropped
    {"eps": [EPS, EPS]},               # epsilon not a scalar
    {"extra_use": True},               # an intermediate read elsewhere (a graph output)
    {"weight_input": True},            # the weight not a constant
    {"weight_shape": (2, H)},          # a scale that is not one per channel
])
def test_chains_that_differ_are_left_alone(kw):
    proto, _ = _chain(**kw)
    fused, result = _fused(proto)
    assert result.fused == 0
    assert [n.op_type for n in fused.graph.node] == [n.op_type for n in proto.graph.node]


@pytest.mark.parametrize("name", ["dynamo_sdpa_kv", "dynamo_sdpa_kv_fp16", "tx_sdpa_kv", "mistral_window_kv",
                                  "gptoss_sinks_kv"])
def test_exported_models_keep_their_outputs(name):
    """Every norm of real exports fused, and the model's outputs (logits and presents) those of
    the unfused model to the kernels' rounding."""
    path = FIXTURES / "attention" / f"{name}.onnx"
    m = load_model(str(path))
    n_before = len(list(m.graph))
    result = fuse_rmsnorm(m, RewriteOptions())
    assert result.fused >= 3, result  # two per layer and the final norm
    assert len(list(m.graph)) <= n_before - 6 * result.fused
    assert not [n for n in m.graph if n.op_type in ("Pow", "Reciprocal", "Sqrt")]
    probe = load_model(str(path))
    past = [v for v in probe.graph.inputs if v.name.startswith("past")]
    feeds, _ = g.probe_feeds(probe, past)
    want = _run(onnx.load(str(path)), feeds)
    got = _run(ir.serde.serialize_model(m), feeds)
    fp16 = "fp16" in name
    for a, b in zip(want, got):
        a, b = a.astype(np.float32), b.astype(np.float32)
        scale = float(np.abs(a).max()) or 1.0
        assert float(np.abs(a - b).max()) <= (2e-2 if fp16 else 1e-4) * scale, (name, float(np.abs(a - b).max()))


def _residual_norm(dtype=TensorProto.FLOAT, shape=(2, 3, H), const_skip=False, sum_is_output=False):
    """h = a + b; y = RMSNorm(h) * w (the torch.onnx chain of _chain); r = h + c reads the sum as
    the next residual Add does. Outputs y and r (and h itself when sum_is_output)."""
    chain, w = _chain(dtype)
    npd = helper.tensor_dtype_to_np_dtype(dtype)
    g_ = chain.graph
    nodes = [helper.make_node("Add", ["a", "b"], ["x"])] + list(g_.node)
    nodes.append(helper.make_node("Add", ["x", "c"], ["r"]))
    inits = list(g_.initializer)
    inputs = [helper.make_tensor_value_info(n, dtype, list(shape)) for n in ("a", "c")]
    if const_skip:
        b = np.random.default_rng(5).standard_normal(shape).astype(npd)
        inits.append(onnx.numpy_helper.from_array(b, "b"))
    else:
        inputs.append(helper.make_tensor_value_info("b", dtype, list(shape)))
    outputs = [helper.make_tensor_value_info("out_copy", dtype, None), helper.make_tensor_value_info("r", dtype, None)]
    if sum_is_output:
        outputs.append(helper.make_tensor_value_info("x", dtype, None))
    graph = helper.make_graph(nodes, "res", inputs, outputs, inits,
                              value_info=[helper.make_tensor_value_info("x", dtype, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), w


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_norm_of_a_residual_add_becomes_skip_simplified_layer_norm(dtype):
    """Add + RMSNorm -> one SkipSimplifiedLayerNormalization whose output 3 (the sum) feeds the
    next residual Add: y against numpy's RMSNorm of a + b in float64, r against a + b + c."""
    proto, w = _residual_norm(dtype)
    m = ir.serde.deserialize_model(proto)
    result = fuse_rmsnorm(m, RewriteOptions())
    assert result.fused == 1 and result.details["skip"] == 1
    out = ir.serde.serialize_model(m)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 1 and "SimplifiedLayerNormalization" not in ops
    assert ops.count("Add") == 1  # only the next residual Add is left
    npd = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal((2, 3, H)).astype(npd) for _ in range(3))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    y, r = ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, {"a": a, "b": b, "c": c})
    h = a.astype(np.float64) + b.astype(np.float64)
    want = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * w.astype(np.float64)
    tol = 1e-5 if dtype == TensorProto.FLOAT else 4e-3  # float32 arithmetic; fp16: one output rounding
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol)
    h_rounded = (a + b).astype(np.float64)  # the sum the kernel hands on, in the model's type
    np.testing.assert_allclose(r.astype(np.float64), (h_rounded.astype(npd) + c).astype(np.float64), rtol=0,
                               atol=4e-3 if dtype == TensorProto.FLOAT16 else 1e-6)


@pytest.mark.parametrize("kw", [{"const_skip": True}, {"shape": (3, H)}, {"sum_is_output": True}],
                         ids=["constant-input", "rank-2", "sum-is-a-graph-output"])
def test_residual_adds_it_must_not_take_stay(kw):
    """A constant addend (a bias, not a residual), inputs the kernel does not take as
    [batch, sequence, hidden], or a sum that is itself a graph output: the norm is fused alone."""
    proto, _ = _residual_norm(**kw)
    m = ir.serde.deserialize_model(proto)
    result = fuse_rmsnorm(m, RewriteOptions())
    assert result.fused == 1 and result.details["skip"] == 0
    assert [n.op_type for n in m.graph].count("Add") == 2


def test_exported_layers_take_the_skip_norm():
    """The 2-layer torch.onnx export: every norm but the first (which reads the embedding) sums its
    residual in the kernel; outputs those of the unfused model as in the test above."""
    path = FIXTURES / "attention" / "dynamo_sdpa_kv.onnx"
    m = load_model(str(path))
    result = fuse_rmsnorm(m, RewriteOptions())
    assert (result.fused, result.details["skip"]) == (5, 4)
    skip = [n for n in m.graph if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert len(skip) == 4 and sum(len(n.outputs) == 4 for n in skip) == 3  # the final norm's sum has no other reader
