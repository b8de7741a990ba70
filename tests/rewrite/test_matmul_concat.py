# SPDX-License-Identifier: MIT
"""The joined-projection pass (ort_ops/rewrite/matmul_concat.py): MatMuls of one activation
become one MatMul of the joined weights and a Split; checked against numpy's products and against
the model without the pass; MatMuls it must not join are left alone."""

from __future__ import annotations

import collections
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ort_ops.rewrite.matmul_concat import fuse_matmul_concat
from ort_ops.rewrite.pipeline import RewriteOptions

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
K = 8


def _model(opset=18, dtype=TensorProto.FLOAT):
    """x [2, 3, K] read by: three MatMuls with their own constant weights (widths 4, 6, 2: joined),
    one with a weight fed as a graph input, two sharing one weight, one whose output is a graph
    output (none of those joined), and one with a weight of another row count (reading x2)."""
    rng = np.random.default_rng(7)
    npd = helper.tensor_dtype_to_np_dtype(dtype)
    ws = {f"w{i}": rng.standard_normal((K, n)).astype(npd) for i, n in enumerate((4, 6, 2))}
    ws["shared"] = rng.standard_normal((K, 3)).astype(npd)
    ws["out_w"] = rng.standard_normal((K, 5)).astype(npd)
    ws["other_k"] = rng.standard_normal((K // 2, 3)).astype(npd)
    inits = [helper.make_tensor(n, dtype, a.shape, a.reshape(-1).tolist()) for n, a in ws.items()]
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]) for i in range(3)]
    nodes += [helper.make_node("MatMul", ["x", "wi"], ["yi"]),
              helper.make_node("MatMul", ["x", "shared"], ["ys1"]),
              helper.make_node("MatMul", ["x", "shared"], ["ys2"]),
              helper.make_node("MatMul", ["x", "out_w"], ["yo"]),
              helper.make_node("Slice", ["x", "zero", "half", "last"], ["x2"]),
              helper.make_node("MatMul", ["x2", "other_k"], ["yk"])]
    inits += [helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
              helper.make_tensor("half", TensorProto.INT64, [1], [K // 2]),
              helper.make_tensor("last", TensorProto.INT64, [1], [-1])]
    outs = ["y0", "y1", "y2", "yi", "ys1", "ys2", "yo", "yk"]
    for o in outs:
        if o != "yo":  # read by a node, so that only "yo" is itself a graph output
            nodes.append(helper.make_node("Identity", [o], [f"{o}_out"]))
    graph = helper.make_graph(
        nodes, "mm",
        [helper.make_tensor_value_info("x", dtype, [2, 3, K]), helper.make_tensor_value_info("wi", dtype, [K, 3])],
        [helper.make_tensor_value_info(f"{o}_out" if o != "yo" else o, dtype, None) for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), ws


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("opset", [11, 18])  # Split's sizes as an attribute (< 13) or an input
def test_joins_only_the_independent_constant_weights(opset):
    proto, ws = _model(opset)
    m = ir.serde.deserialize_model(proto)
    result = fuse_matmul_concat(m, RewriteOptions())
    assert result.fused == 1 and result.details["matmuls"] == 3
    assert result.details["widths"] == {"4+6+2": 1}
    out = ir.serde.serialize_model(m)
    ops = collections.Counter(n.op_type for n in out.graph.node)
    assert ops["MatMul"] == 8 - 3 + 1 and ops["Split"] == 1
    names = {i.name for i in out.graph.initializer}
    assert not names & {"w0", "w1", "w2"}  # the joined weight replaced them
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    wi = rng.standard_normal((K, 3)).astype(np.float32)
    got = _run(out, {"x": x, "wi": wi})
    want = [x.astype(np.float64) @ ws[w] for w in ("w0", "w1", "w2")]
    want += [x.astype(np.float64) @ wi, x @ ws["shared"].astype(np.float64), x @ ws["shared"].astype(np.float64),
             x @ ws["out_w"].astype(np.float64), x[..., :K // 2] @ ws["other_k"].astype(np.float64)]
    for g_, w_ in zip(got, want):
        np.testing.assert_allclose(g_, w_, rtol=1e-5, atol=1e-5)


def test_fp16_weights_keep_their_type():
    proto, ws = _model(18, TensorProto.FLOAT16)
    m = ir.serde.deserialize_model(proto)
    assert fuse_matmul_concat(m, RewriteOptions()).fused == 1
    out = ir.serde.serialize_model(m)
    joined = [i for i in out.graph.initializer if i.name.endswith("_joined_weight")]
    assert len(joined) == 1 and joined[0].data_type == TensorProto.FLOAT16 and list(joined[0].dims) == [K, 12]
    x = np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float16)
    got = _run(out, {"x": x, "wi": np.zeros((K, 3), np.float16)})
    for i, w in enumerate(("w0", "w1", "w2")):
        ref = x.astype(np.float64) @ ws[w].astype(np.float64)
        np.testing.assert_allclose(got[i].astype(np.float64), ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())


def test_fixture_projections_joined_logits_unchanged():
    """The 2-layer torch.onnx export (fp16): Q/K/V (3 MatMuls) and gate/up (2) of each layer
    become one MatMul each; the paged model's logits through prefill and decode steps stay those of
    the same rewrite without the pass."""
    import ort_ops
    from ort_ops.runtime import PagedRunner

    src = str(FIXTURES / "attention" / "dynamo_sdpa_kv_fp16.onnx")
    joined, results = ort_ops.rewrite_model(src)
    plain, _ = ort_ops.rewrite_model(src, concat_matmuls=False)
    r = next(r for r in results if r.kind == "matmul_concat")
    assert r.fused == 4 and r.details["matmuls"] == 10
    def count(m):
        return collections.Counter(n.op_type for n in m.graph)["MatMul"]

    assert count(plain) - count(joined) == 6
    runners = [PagedRunner(ir.serde.serialize_model(m).SerializeToString()) for m in (joined, plain)]
    rng = np.random.default_rng(3)
    steps = [{0: rng.integers(3, 100, 21), 1: rng.integers(3, 100, 6)}] + [{0: [int(t)], 1: [int(u)]}
                                                                          for t, u in rng.integers(3, 100, (4, 2))]
    for step in steps:
        a, b = (run.step(step) for run in runners)
        # Each column is the same dot product; fp16 logits agree to rounding of the GEMM's sums.
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * max(1.0, float(np.abs(b).max())))
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_option_off_leaves_the_matmuls():
    import ort_ops

    src = str(FIXTURES / "attention" / "dynamo_sdpa_kv_fp16.onnx")
    m, results = ort_ops.rewrite_model(src, concat_matmuls=False)
    assert all(r.kind != "matmul_concat" for r in results)
    assert not [n for n in m.graph if n.op_type == "Split" and n.name.endswith("_split")]
