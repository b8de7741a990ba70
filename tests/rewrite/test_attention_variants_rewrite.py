# SPDX-License-Identifier: MIT
"""The attention rewrite on sliding-window, softcapped and sink attention.

Fixtures (tests/fixtures/attention, made by graphs/export_attention_variants.py): Mistral (a
window of 24 on every layer), Gemma 2 (softcap 5, layer 0 a window of 24, layer 1 global) and
gpt-oss (sinks -1 and 2, layer 0 a window of 24, layer 1 global). Each must fuse every layer
with the window, softcap and sinks of its config (the constants the export script put in the
model), measured from the model, not assumed. Hand-built decoders (graphs/attention.py) check
that the window is the one the mask computes (shorter and longer than the short probe, paged
and prefill-only) and that what is not a sliding window, softcap or sink is declined with a
reason and left as it was.
"""

from __future__ import annotations

import collections
import functools
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from graphs.attention import build_decoder
from ort_ops.rewrite import rewrite_model
from ort_ops.rewrite.paged_attention_int8 import fuse_paged_attention_int8
from ort_ops.rewrite.pipeline import RewriteOptions

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "attention"
LAYERS = 2
# graphs/export_attention_variants.py: WINDOW, the Gemma 2 softcap and scale, the gpt-oss sinks
WINDOW = 24
SINKS = [-1.0, 2.0]
# fixture -> per layer (window, softcap, head_sink), and the scale attribute when not 1/sqrt(D)
EXPECTED = {
    "mistral_window_kv": ([(WINDOW, 0.0, None), (WINDOW, 0.0, None)], None),
    "gemma2_softcap_kv": ([(WINDOW, 5.0, None), (0, 5.0, None)], 1.0 / 16),  # query_pre_attn_scalar 256
    "gptoss_sinks_kv": ([(WINDOW, 0.0, SINKS), (0, 0.0, SINKS)], None),
}


def _path(name: str) -> str:
    p = FIXTURES / f"{name}.onnx"
    if not p.is_file():
        pytest.fail(f"fixture {p} missing: run graphs/export_attention_variants.py")
    return str(p)


@functools.cache
def _rewritten(name: str) -> tuple[bytes, object]:
    model, results = rewrite_model(_path(name), moe=False)
    return ir.serde.serialize_model(model).SerializeToString(), results[0]


def _paged_nodes(model: onnx.ModelProto) -> list[tuple[dict, np.ndarray | None]]:
    """(attributes, head_sink constant or None) of each PagedAttentionInt8, in graph order."""
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    consts.update({t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer})
    out = []
    for n in model.graph.node:
        if n.op_type == "PagedAttentionInt8":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            sink = consts[n.input[8]] if len(n.input) > 8 and n.input[8] else None
            out.append((attrs, sink))
    return out


@pytest.mark.parametrize("name", list(EXPECTED))
def test_variant_fixture_fused_with_its_window_softcap_and_sinks(name):
    data, result = _rewritten(name)
    layers, scale = EXPECTED[name]
    assert result.fused == LAYERS, [(d.where, d.reason) for d in result.declined]
    assert not result.declined
    assert result.details["interface"] == "paged" and result.details["forms"] == {"matmul": LAYERS}
    # the report: every layer, with its window / softcap / sinks
    assert result.details["blocks"] == [
        {"layer": i, "window": w, "softcap": c, "head_sink": s} for i, (w, c, s) in enumerate(layers)]
    m = onnx.load_from_string(data)
    nodes = _paged_nodes(m)
    assert len(nodes) == LAYERS
    # QuantizeKVCache + PagedAttentionInt8 per layer; the attention's Tanh / Concat / Softmax are gone
    census = collections.Counter(n.op_type for n in m.graph.node)
    assert census["QuantizeKVCache"] == LAYERS
    if name != "gptoss_sinks_kv":  # gpt-oss keeps its (unfused here) MoE router's Softmax
        assert census["Softmax"] == 0
    assert census["Tanh"] == (1 if name == "gemma2_softcap_kv" else 0)  # Gemma 2's final logit softcap stays
    by_window = sorted(nodes, key=lambda n: -n[0].get("window", 0))  # layer order is not graph order
    for (attrs, sink), (w, c, s) in zip(by_window, sorted(layers, key=lambda x: -x[0])):
        assert attrs.get("window", 0) == w
        assert attrs.get("softcap", 0.0) == c
        if s is None:
            assert sink is None
        else:
            assert sink.dtype == np.float32 and sink.tolist() == s
        if scale is None:
            assert "scale" not in attrs
        else:
            assert attrs["scale"] == pytest.approx(scale, rel=1e-7)


WINDOWS = [4, 20, 300]  # shorter and longer than the short probe's 12 keys; one not a power of 2


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("past_kv", [True, False])
def test_window_is_measured_from_the_mask(window, past_kv):
    """A hand-built decoder whose mask limits each query to its last ``window`` positions fuses
    with exactly that window (paged and prefill-only)."""
    orig = build_decoder("eager", past_kv=past_kv, mask="window", window=window)
    m = ir.serde.deserialize_model(orig)
    result = fuse_paged_attention_int8(m, RewriteOptions())
    assert result.fused == LAYERS, [(d.where, d.reason) for d in result.declined]
    assert [b["window"] for b in result.details["blocks"]] == [window] * LAYERS
    nodes = _paged_nodes(ir.serde.serialize_model(m))
    assert [a["window"] for a, _ in nodes] == [window] * LAYERS


def _edit(name: str, edit) -> onnx.ModelProto:
    m = onnx.load(_path(name))
    edit(m)
    return m


def _node(m: onnx.ModelProto, op_type: str, index: int = 0) -> onnx.NodeProto:
    return [n for n in m.graph.node if n.op_type == op_type][index]


def _set_const_input(m: onnx.ModelProto, node: onnx.NodeProto, slot: int, value: np.ndarray) -> None:
    """Points ``node``'s input ``slot`` at a new initializer holding ``value``."""
    name = f"{node.name}_edited_{slot}"
    m.graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    node.input[slot] = name


def _softcap_mismatch(m):
    """Gemma 2's softcap with Mul by 6 after Div by 5: not the op's c * tanh(s / c)."""
    tanh = _node(m, "Tanh")
    mul = next(n for n in m.graph.node if n.op_type == "Mul" and tanh.output[0] in n.input)
    _set_const_input(m, mul, 1 - list(mul.input).index(tanh.output[0]), np.array(6.0, np.float32))


def _attention_slices(m):
    return [n for n in m.graph.node if n.op_type == "Slice" and any(
        p.op_type == "Softmax" and p.output[0] == n.input[0] for p in m.graph.node)]


def _sink_slice_front(m):
    """gpt-oss's Slice [..., :-1] made [..., 1:]: the sink column kept, a key dropped."""
    for s in _attention_slices(m):
        _set_const_input(m, s, 1, np.array([1], np.int64))
        _set_const_input(m, s, 2, np.array([np.iinfo(np.int64).max], np.int64))


def _sink_not_constant(m):
    """gpt-oss's sinks times max(attention_mask) (1 on every real batch, but computed from an
    input): the rewrite cannot prove it constant."""
    producer = {o: n for n in m.graph.node for o in n.output}
    cats = [producer[s.input[0]].input[0] for s in _attention_slices(m)]  # Softmax input
    for i, cat_out in enumerate(cats):
        sub = producer[cat_out]
        cat = producer[sub.input[0]] if sub.op_type == "Sub" else sub
        am = onnx.helper.make_node("Cast", ["attention_mask"], [f"am_f{i}"], to=onnx.TensorProto.FLOAT)
        one = onnx.helper.make_node("ReduceMax", [f"am_f{i}"], [f"am_max{i}"], keepdims=0)
        mul = onnx.helper.make_node("Mul", [cat.input[1], f"am_max{i}"], [f"sink_x{i}"])
        cat.input[1] = f"sink_x{i}"
        at = list(m.graph.node).index(cat)
        for k, n in enumerate((am, one, mul)):
            m.graph.node.insert(at + k, n)


NEGATIVE = {
    "softcap-mismatch": ("gemma2_softcap_kv", _softcap_mismatch, "softcap divides by 5.0 and multiplies by 6.0"),
    "sink-slice-front": ("gptoss_sinks_kv", _sink_slice_front, "not sliced to [..., :-1]"),
    "sink-not-constant": ("gptoss_sinks_kv", _sink_not_constant, "(sinks) is not a constant"),
}


@pytest.mark.parametrize("case", list(NEGATIVE))
def test_inexpressible_variant_declined(case):
    """What is not the op's softcap or sink is declined with its reason; the model is unchanged."""
    name, edit, reason = NEGATIVE[case]
    orig = _edit(name, edit)
    m = ir.serde.deserialize_model(orig)
    result = fuse_paged_attention_int8(m, RewriteOptions())
    assert result.fused == 0 and result.details["interface"] == "unchanged"
    per_layer = [d for d in result.declined if d.where != "model"]
    assert per_layer and any(reason in d.reason for d in per_layer), per_layer
    after = ir.serde.serialize_model(m)
    assert collections.Counter(n.op_type for n in after.graph.node) == collections.Counter(
        n.op_type for n in orig.graph.node)
