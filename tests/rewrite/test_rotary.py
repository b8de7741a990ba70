# SPDX-License-Identifier: MIT
"""The RoPE fusion (ort_ops/rewrite/rotary.py): each exported chain of a paged model becomes one
com.microsoft RotaryEmbedding computing numpy's RoPE, the rewritten fixtures give the logits of
the same rewrite without it through the paged runtime, and chains that differ in any step, or
models whose cos/sin are not one row per token, are left alone.

Expected values come from numpy (``_rope``: rotate_half RoPE in float64 on the graph's own
inputs) or from the unfused model on onnxruntime; never from the pass.
"""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ort_ops.paged_interface import PAGED_META_KEY
from ort_ops.rewrite import pipeline, rewrite_model
from ort_ops.rewrite._graph import float32_twin, has_bfloat16
from ort_ops.rewrite.pipeline import RewriteOptions
from ort_ops.rewrite.rotary import fuse_rotary
from ort_ops.runtime import PagedRunner
from tests.tolerances import ROTARY_FP16_LOGITS_ATOL, ROTARY_LOGITS_ATOL

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
N, D = 3, 8  # heads, head dim of the hand-made graphs
H = D // 2
BASE = 10000.0


# --- hand-made graphs ----------------------------------------------------------------------------


def _graph(dtype=TensorProto.FLOAT, form="rotate_half", split=False, swap=False, scale=None, halves_differ=False,
           batch=1, extra_reader=False, paged=True, transpose=True):
    """One rotated tensor, written as the exporters write it: y [1, T, N, D] (a graph input) ->
    x = Transpose(y, [0, 2, 1, 3]) -> RoPE with cos/sin computed from position_ids [1, T] ->
    the inverse Transpose -> output [1, T, N, D]."""
    h = H
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    inv_freq = (1.0 / BASE ** (np.arange(h) * 2.0 / D)).astype(np.float32)
    inits = [helper.make_tensor("inv_freq", TensorProto.FLOAT, [h], inv_freq),
             helper.make_tensor("ax2", TensorProto.INT64, [1], [2]),
             helper.make_tensor("ax1", TensorProto.INT64, [1], [1]),
             helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
             helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
             helper.make_tensor("h", TensorProto.INT64, [1], [h]),
             helper.make_tensor("big", TensorProto.INT64, [1], [2 ** 63 - 1]),
             helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    nodes = [helper.make_node("Unsqueeze", ["position_ids", "ax2"], ["pos3"]),
             helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["posf", "inv_freq"], ["freqs"])]
    freqs = "freqs"
    if batch > 1:  # the same positions twice along the batch axis: cos/sin [2, T, .]
        nodes.append(helper.make_node("Concat", ["freqs"] * batch, ["freqs_b"], axis=0))
        freqs = "freqs_b"
    if form == "rotate_half":
        second = freqs
        if halves_differ:
            nodes.append(helper.make_node("Mul", [freqs, "two"], ["freqs2"]))
            second = "freqs2"
        nodes.append(helper.make_node("Concat", [freqs, second], ["emb"], axis=-1))
        emb = "emb"
    else:
        emb = freqs
    for fn in ("Cos", "Sin"):
        v = fn.lower()
        nodes.append(helper.make_node(fn, [emb], [f"{v}32"]))
        src = f"{v}32"
        if scale is not None:
            inits.append(helper.make_tensor(f"{v}_scale", TensorProto.FLOAT, [], [scale]))
            nodes.append(helper.make_node("Mul", [src, f"{v}_scale"], [f"{v}_scaled"]))
            src = f"{v}_scaled"
        nodes.append(helper.make_node("Cast", [src], [f"{v}_t"], to=dtype))
        nodes.append(helper.make_node("Unsqueeze", [f"{v}_t", "ax1"], [f"{v}_u"]))
    x = "x"
    if transpose:
        nodes.append(helper.make_node("Transpose", ["y"], ["x"], perm=[0, 2, 1, 3]))
    else:
        x = "y"  # rotated as given: [1, T, N, D] read as if it were [B, N, S, D]

    def mul(a, b, out):
        nodes.append(helper.make_node("Mul", [b, a] if swap else [a, b], [out]))

    if split:
        inits.append(helper.make_tensor("sizes", TensorProto.INT64, [2], [h, h]))
        nodes.append(helper.make_node("Split", [x, "sizes"], ["x1", "x2"], axis=-1))
    else:
        nodes += [helper.make_node("Slice", [x, "zero", "h", "last"], ["x1"]),
                  helper.make_node("Slice", [x, "h", "big", "last"], ["x2"])]
    if form == "rotate_half":
        nodes += [helper.make_node("Neg", ["x2"], ["neg"]),
                  helper.make_node("Concat", ["neg", "x1"], ["rot"], axis=-1)]
        mul(x, "cos_u", "xc")
        mul("rot", "sin_u", "rs")
        nodes.append(helper.make_node("Add", ["rs", "xc"] if swap else ["xc", "rs"], ["roped"]))
    else:  # gpt-oss: Concat(x1 cos - x2 sin, x2 cos + x1 sin)
        mul("x1", "cos_u", "a")
        mul("x2", "sin_u", "b")
        mul("x2", "cos_u", "c")
        mul("x1", "sin_u", "d")
        nodes += [helper.make_node("Sub", ["a", "b"], ["o1"]),
                  helper.make_node("Add", ["d", "c"] if swap else ["c", "d"], ["o2"]),
                  helper.make_node("Concat", ["o1", "o2"], ["roped"], axis=-1)]
    nodes += [helper.make_node("Transpose", ["roped"], ["out_bsnd"], perm=[0, 2, 1, 3]),
              helper.make_node("Identity", ["out_bsnd"], ["out"])]  # the attention that reads it
    outputs = [helper.make_tensor_value_info("out", dtype, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("neg" if form == "rotate_half" else "a", dtype, None))
    inputs = [helper.make_tensor_value_info("y", dtype, [1, "T", N, D]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "T"])]
    graph = helper.make_graph(nodes, "rope", inputs, outputs, inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])  # ORT >= 1.16
    if paged:  # the two keys the pass reads (the runtime's other keys do not matter here)
        helper.set_model_props(model, {PAGED_META_KEY: json.dumps({"position_ids": "position_ids",
                                                                   "input_ids": "input_ids"})})
    return model, np_dt


def _rope(y: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """rotate_half RoPE of y [1, T, N, D] at ``positions`` [T], float64 (the spec)."""
    inv_freq = (1.0 / BASE ** (np.arange(H) * 2.0 / D)).astype(np.float32).astype(np.float64)
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]          # [T, h]
    c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]     # [1, T, 1, h]
    y = y.astype(np.float64)
    y1, y2 = y[..., :H], y[..., H:]
    return np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], axis=-1)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _fused(proto: onnx.ModelProto):
    m = ir.serde.deserialize_model(proto)
    result = fuse_rotary(m, RewriteOptions())
    return ir.serde.serialize_model(m), result


def _feeds(np_dt, rng, tokens=7):
    y = rng.standard_normal((1, tokens, N, D)).astype(np_dt)
    positions = rng.permutation(40)[:tokens].astype(np.int64)  # any positions: a row per token
    return {"y": y, "position_ids": positions[None]}, positions


def _census(proto) -> collections.Counter:
    return collections.Counter(n.op_type for n in proto.graph.node)


CASES = {
    "slices": {},
    "split": {"split": True},
    "operands_swapped": {"swap": True},
    "scaled_cos_sin": {"scale": 1.25},
    "halves_form": {"form": "halves"},
    "halves_form_swapped": {"form": "halves", "swap": True, "split": True},
}


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_chain_becomes_one_rotary_embedding_with_numpys_rope(case, dtype, rng):
    kw = CASES[case]
    proto, np_dt = _graph(dtype, **kw)
    fused, result = _fused(proto)
    assert result.fused == 1 and not result.declined, result
    assert result.details["forms"] == {kw.get("form", "rotate_half"): 1}
    # Both Transposes and the chain go; the op, its two Reshapes and per cos/sin a cache
    # (Reshape, after a Slice of the first half in the rotate_half form) come in.
    before, after = _census(proto), _census(fused)
    assert after["RotaryEmbedding"] == 1 and after["Transpose"] == 0
    assert not {"Neg", "Sub", "Split"} & set(after) and after["Slice"] == (2 if "form" not in kw else 0)
    # The chain (rotate_half: 2 Slices or a Split, Neg, Concat, 2 Mul, Add; halves: 2 Slices or a
    # Split, 4 Mul, Sub, Add, Concat) and both Transposes out; the op, its 2 Reshapes and the
    # caches (per cos and sin: Slice + Reshape, or a Reshape for halves) in.
    chain = (7 if "form" not in kw else 9) - (1 if kw.get("split") else 0) + 2
    added = 3 + (4 if "form" not in kw else 2)
    removed_unsqueezes = 2  # cos/sin [1, 1, T, W]: the caches read the values under them
    assert len(fused.graph.node) == len(proto.graph.node) - chain + added - removed_unsqueezes
    assert before["Unsqueeze"] - after["Unsqueeze"] == removed_unsqueezes
    feeds, positions = _feeds(np_dt, rng)
    want = _rope(feeds["y"], positions) * (kw.get("scale") or 1.0)  # both cos and sin scaled
    got = _run(fused, feeds).astype(np.float64)
    chain_out = _run(proto, feeds).astype(np.float64)
    # float32: one rounding of a two-term sum (the op) or three (the chain), relative 2^-23 of
    # the terms; float16: the op rounds once (half an ulp, 2^-11 relative), the chain's Mul, Mul
    # and Add each round (1.5 ulps); the inputs are exact in both, cos/sin rounded once to fp16
    # (another ulp of a term).
    tol = 1e-6 if dtype == TensorProto.FLOAT else 2.0 ** -9
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(chain_out, want, rtol=2 * tol, atol=2 * tol)


def test_shared_cos_sin_give_one_cache_per_value(rng):
    """Q and K of a layer (two chains on one cos/sin): two ops, one cos cache and one sin cache."""
    proto, np_dt = _graph()
    g = proto.graph
    k_nodes = []
    rename = {"y": "yk"}
    own = {"x", "x1", "x2", "neg", "rot", "xc", "rs", "roped", "out_bsnd", "out"}
    for n in g.node:
        if n.output[0] in own:
            k = onnx.NodeProto()
            k.CopyFrom(n)
            k.name = f"k_{n.name}"
            k.input[:] = [rename.get(i, f"k_{i}" if i in own else i) for i in n.input]
            k.output[:] = [f"k_{o}" for o in n.output]
            k_nodes.append(k)
    g.node.extend(k_nodes)
    g.input.append(helper.make_tensor_value_info("yk", TensorProto.FLOAT, [1, "T", N, D]))
    g.output.append(helper.make_tensor_value_info("k_out", TensorProto.FLOAT, None))
    fused, result = _fused(proto)
    assert result.fused == 2 and result.details["caches"] == 2, result
    assert _census(fused)["RotaryEmbedding"] == 2 and _census(fused)["Slice"] == 2
    feeds, positions = _feeds(np_dt, rng)
    feeds["yk"] = rng.standard_normal(feeds["y"].shape).astype(np.float32)
    so = ort.SessionOptions()
    sess = ort.InferenceSession(fused.SerializeToString(), so, providers=["CPUExecutionProvider"])
    q, k = sess.run(["out", "k_out"], feeds)
    np.testing.assert_allclose(q, _rope(feeds["y"], positions), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k, _rope(feeds["yk"], positions), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw,reason", [
    ({"halves_differ": True}, "halves may differ"),                   # Concat(f, 2 f): not RoPE's cos
    ({"batch": 2}, "not [1, 1, T, 8]"),                               # cos/sin rows per sequence
    ({"extra_reader": True}, "other readers"),                        # Neg(x2) is also an output
    ({"extra_reader": True, "form": "halves"}, "other readers"),      # x1 * cos likewise
    ({"paged": False}, "not a paged model"),
    ({"transpose": False}, "not Transpose(perm=[0, 2, 1, 3])"),       # x is not the exporter's transpose
])
def test_chains_that_differ_are_left_alone(kw, reason):
    proto, _ = _graph(**kw)
    fused, result = _fused(proto)
    assert result.fused == 0 and len(result.declined) == 1, result
    assert reason in result.declined[0].reason, result.declined[0].reason
    assert fused.graph.node == proto.graph.node


def test_model_without_rope_is_untouched():
    proto = helper.make_model(helper.make_graph(
        [helper.make_node("Neg", ["a"], ["b"])], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])]))
    fused, result = _fused(proto)
    assert result.fused == 0 and not result.declined and fused.graph.node == proto.graph.node


# --- exported fixtures through the paged runtime -------------------------------------------------

# fixture -> (path, layers' RoPE chains, form)
EXPORTED = {
    "dynamo_sdpa_kv": ("attention/dynamo_sdpa_kv", 4, "rotate_half"),
    "dynamo_sdpa_kv_fp16": ("attention/dynamo_sdpa_kv_fp16", 4, "rotate_half"),
    "dynamo_sdpa_kv_bf16": ("attention/dynamo_sdpa_kv_bf16", 4, "rotate_half"),
    "dynamo_cachepos_kv": ("attention/dynamo_cachepos_kv", 4, "rotate_half"),
    "torchscript_kv": ("attention/torchscript_kv", 4, "rotate_half"),      # Slice bounds from Shape
    "tx_sdpa_kv": ("attention/tx_sdpa_kv", 4, "rotate_half"),
    "gemma2_softcap_kv": ("attention/gemma2_softcap_kv", 4, "rotate_half"),
    "mistral_window_kv": ("attention/mistral_window_kv", 4, "rotate_half"),
    "gptoss_sinks_kv": ("attention/gptoss_sinks_kv", 4, "halves"),         # Split, Sub/Add, scaled cos
    "qwen3moe_tfexport_kv": ("moe/qwen3moe_tfexport_kv", 2, "rotate_half"),  # Q/K norms before RoPE
}


def _plan(rng) -> list[dict]:
    """The steps both models run: a packed prefill of 3 prompts, 3 decode steps and a
    2-sequence step (one decoding, one continuing with 3 tokens), fresh random tokens below the
    fixtures' vocabularies (64 and 128)."""
    steps = [dict(enumerate(rng.integers(3, 60, n).tolist() for n in (5, 11, 17)))]
    steps += [{i: [int(rng.integers(3, 60))] for i in range(3)} for _ in range(3)]
    steps.append({0: [int(rng.integers(3, 60))], 2: rng.integers(3, 60, 3).tolist()})
    return steps


def _logits(model: ir.Model, plan: list[dict]) -> list[np.ndarray]:
    if has_bfloat16(model):  # onnxruntime's CPU provider runs no bfloat16 MatMul: the float32 twin
        model = float32_twin(model)
    runner = PagedRunner(ir.to_proto(model).SerializeToString(), num_blocks=32)
    return [runner.step(step) for step in plan]


@pytest.mark.parametrize("name", list(EXPORTED))
def test_exported_model_keeps_its_logits(name, rng):
    """The paged rewrite with the pass against the same rewrite without it, the same tokens on
    both: every chain fused, two Transposes gone with each, and the logits of the unfused model."""
    path, chains, form = EXPORTED[name]
    # Q.K and P.V unquantized: what is left of INT8 is the K/V cache, whose codes only move at
    # rounding ties (ROTARY_LOGITS_ATOL).
    plain, results = rewrite_model(str(FIXTURES / f"{path}.onnx"), moe=False, rotary=False,
                                   qk_quant="none", pv_quant="none")
    assert "rotary" not in [r.kind for r in results]
    fused = plain.clone()
    result = fuse_rotary(fused, RewriteOptions())
    assert result.fused == chains and not result.declined, [(d.where, d.reason) for d in result.declined]
    assert result.details["forms"] == {form: chains} and result.details["transposes_removed"] == chains
    before, after = _census(ir.to_proto(plain)), _census(ir.to_proto(fused))
    assert after["RotaryEmbedding"] == chains and before["RotaryEmbedding"] == 0
    assert before["Transpose"] - after["Transpose"] == 2 * chains  # the exporter's and the attention's
    if form == "rotate_half":
        assert before["Neg"] - after["Neg"] == chains and after["Neg"] == 0
    else:
        assert before["Sub"] - after["Sub"] == chains
    # Each chain: at least 7 nodes (rotate_half; 8 for halves) and 2 Transposes out, the op and
    # its 2 Reshapes in; per cos/sin value at most a Slice and a Reshape in.
    per_chain = (7 if form == "rotate_half" else 8) + 2 - 3
    assert sum(after.values()) <= sum(before.values()) - per_chain * chains + 2 * result.details["caches"]
    plan = _plan(rng)
    atol = ROTARY_FP16_LOGITS_ATOL if name.endswith("fp16") else ROTARY_LOGITS_ATOL
    for step, (a, b) in enumerate(zip(_logits(plain, plan), _logits(fused, plan))):
        assert a.shape == b.shape and np.all(np.isfinite(b))
        err = float(np.abs(a - b).max())
        assert err <= atol, (name, step, err)


def test_pipeline_runs_it_after_attention_and_the_option_turns_it_off(monkeypatch):
    """rewrite_model fuses the chains by default (kind "rotary", after "attention"); rotary=False
    gives what the pipeline without the pass gives, byte for byte. The swiglu and rotary_kv passes
    off (rotary_kv would take the RotaryEmbeddings into its op): the census is the rotary pass's."""
    path = str(FIXTURES / "attention" / "dynamo_sdpa_kv.onnx")
    later_off = {"swiglu": False, "rotary_kv": False}
    model, results = rewrite_model(path, moe=False, **later_off)
    kinds = [r.kind for r in results]
    assert kinds.index("rotary") == kinds.index("attention") + 1
    assert results[kinds.index("rotary")].fused == 4
    off, results = rewrite_model(path, moe=False, rotary=False, **later_off)
    assert "rotary" not in [r.kind for r in results]
    # 2 layers x (Q, K), one cos/sin pair for all: per chain Mul x2, Slice x2, Neg, Concat, Add
    # and 2 Transposes out, RotaryEmbedding and 2 Reshapes in; once, a Slice and a Reshape per
    # cos and sin in, and the Unsqueeze under each out.
    delta = _census(ir.to_proto(model))
    delta.subtract(_census(ir.to_proto(off)))
    assert {k: v for k, v in delta.items() if v} == {"Mul": -8, "Slice": -8 + 2, "Neg": -4, "Concat": -4, "Add": -4,
                                                     "Transpose": -8, "Unsqueeze": -2, "Reshape": 8 + 2,
                                                     "RotaryEmbedding": 4}
    monkeypatch.setattr(pipeline, "FUSIONS", [f for f in pipeline.FUSIONS if f[0] != "rotary"])
    without, _ = rewrite_model(path, moe=False, **later_off)
    assert ir.to_proto(off).SerializeToString() == ir.to_proto(without).SerializeToString()


def test_cli_flag():
    from ort_ops.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["rewrite", "a.onnx", "b.onnx"]).rotary is True
    assert parser.parse_args(["rewrite", "a.onnx", "b.onnx", "--no-rotary"]).rotary is False
