# SPDX-License-Identifier: MIT
"""The rotary_kv pass (ort_ops/rewrite/rotary_kv.py): each layer's Split -> RotaryEmbedding(Q, K)
-> QuantizeKVCache becomes one RotaryQuantizeKVCache on the fp32 and fp16 fixtures; blocks that
differ (another reader of the rotated K, other cos caches, a Transpose chain that reorders, other
split sizes) are declined with their reason and left as they were; the pass is on by default and
rotary_kv=False turns it off; the rewritten model decodes like the one without the pass (needs
the op in the library: skipped when the loaded library does not register it)."""

from __future__ import annotations

import collections
import functools
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ort_ops
from ort_ops.rewrite.pipeline import RewriteOptions
from ort_ops.rewrite.rotary_kv import fuse_rotary_kv
from tests.tolerances import ROTARY_KV_REWRITE_LOGITS_ATOL_REL

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "attention"
FP32, FP16 = FIXTURES / "dynamo_sdpa_kv.onnx", FIXTURES / "dynamo_sdpa_kv_fp16.onnx"
LAYERS = 2
FUSED_AWAY = ("RotaryEmbedding", "QuantizeKVCache")


@functools.cache
def _op_registered() -> bool:
    """Whether the loaded library registers RotaryQuantizeKVCache (a session of a one-node model
    is created, or refused for an unknown op)."""
    f, i8, i64 = TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT64
    ins = [helper.make_tensor_value_info("qkv", f, [1, 256]), helper.make_tensor_value_info("cos", f, [1, 32]),
           helper.make_tensor_value_info("sin", f, [1, 32]), helper.make_tensor_value_info("slots", i64, [1]),
           helper.make_tensor_value_info("kc", i8, [1, 1, 16, 64]), helper.make_tensor_value_info("vc", i8, [1, 1, 64, 16]),
           helper.make_tensor_value_info("ks", f, [1, 1, 16]), helper.make_tensor_value_info("vs", f, [1, 1, 16])]
    outs = {"q": f, "kc_out": i8, "vc_out": i8, "ks_out": f, "vs_out": f}
    node = helper.make_node("RotaryQuantizeKVCache", [i.name for i in ins], list(outs), domain="ort_ops",
                            num_heads=2, kv_num_heads=1, interleaved=0)
    graph = helper.make_graph([node], "probe", ins, [helper.make_tensor_value_info(o, t, None) for o, t in outs.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ort_ops", 1)],
                              ir_version=9)
    try:
        ort.InferenceSession(model.SerializeToString(), ort_ops.session_options(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any refusal means the op is not there
        return False
    return True


needs_op = pytest.mark.skipif("not _op_registered()", reason="the loaded ort_ops library does not register "
                              "RotaryQuantizeKVCache (set ORT_OPS_LIBRARY to a build with the op)")


@functools.cache
def _plain(path: pathlib.Path) -> bytes:
    """The fixture rewritten by the default passes but rotary_kv (the rotary_kv pass's input: the
    Q/K/V Split, the RotaryEmbeddings and the QuantizeKVCache of each layer)."""
    m, _ = ort_ops.rewrite_model(str(path), rotary_kv=False)
    # else a test "against the rewrite without the pass" would compare the pass with itself
    assert not any(n.op_type == "RotaryQuantizeKVCache" for n in m.graph)
    return ir.serde.serialize_model(m).SerializeToString()


def _model(path: pathlib.Path = FP32) -> ir.Model:
    return ir.serde.deserialize_model(onnx.load_from_string(_plain(path)))


def _ops(m: ir.Model) -> collections.Counter:
    return collections.Counter(n.op_type for n in m.graph)


def _signature(m: ir.Model) -> list:
    return [(n.op_type, [i.name if i is not None else "" for i in n.inputs], [o.name for o in n.outputs]) for n in m.graph]


def _fuse(m: ir.Model):
    return fuse_rotary_kv(m, RewriteOptions(rotary_kv=True))


def _node(m: ir.Model, op_type: str, index: int = 0) -> ir.Node:
    return [n for n in m.graph if n.op_type == op_type][index]


@pytest.mark.parametrize("path", [FP32, FP16], ids=["fp32", "fp16"])
def test_fixture_one_op_per_layer(path):
    """One RotaryQuantizeKVCache a layer reading the joined projection; no rotary, QuantizeKVCache
    or Q/K/V Split left (the MLP's gate/up Splits stay: the swiglu pass off, which would fuse
    them); the caches keep their names; the graph passes onnx.checker (the norms pass off: its
    SimplifiedLayerNormalization is ORT's, which the checker does not know)."""
    m, results = ort_ops.rewrite_model(str(path), rotary_kv=True, swiglu=False, norms=False)
    r = results[-1]
    assert r.kind == "rotary_kv" and r.fused == LAYERS and not r.declined, r.declined
    ops = _ops(m)
    assert ops["RotaryQuantizeKVCache"] == LAYERS and not any(ops[o] for o in FUSED_AWAY)
    assert ops["Split"] == LAYERS  # the gate/up Splits
    for layer, node in enumerate(n for n in m.graph if n.op_type == "RotaryQuantizeKVCache"):
        assert node.domain == "ort_ops"
        assert {k: a.value for k, a in node.attributes.items()} == {"num_heads": 2, "kv_num_heads": 1, "interleaved": 0}
        assert [o.name for o in node.outputs[1:]] == [f"kv_cache_out.{layer}.{c}" for c in
                                                      ("key", "value", "key_scale", "value_scale")]
        assert [i.name for i in node.inputs[3:]] == ["slot_mapping"] + [f"kv_cache.{layer}.{c}" for c in
                                                                        ("key", "value", "key_scale", "value_scale")]
        flat = node.inputs[0].producer()
        assert flat.op_type == "Reshape" and flat.inputs[0].producer().op_type == "MatMul"
        assert ir.convenience.get_const_tensor(flat.inputs[1]).numpy().tolist() == [-1, (2 + 2 * 1) * 64]
        (pa,) = [u.node for u in node.outputs[0].uses()]
        assert pa.op_type == "PagedAttentionInt8" and pa.inputs[0] is node.outputs[0]
    assert "rotary_position_offset" not in m.graph.initializers  # read by the removed rotaries only
    proto = ir.serde.serialize_model(m)
    onnx.checker.check_model(proto)
    if _op_registered():  # ORT loads it (the numeric tests below run it)
        ort.InferenceSession(proto.SerializeToString(), ort_ops.session_options(), providers=["CPUExecutionProvider"])


def test_on_by_default_and_the_option_turns_it_off():
    """The default rewrite runs the pass last and reports every layer fused (the graph that of
    rotary_kv=True); rotary_kv=False leaves the pass out of the report and each layer's two
    RotaryEmbeddings and QuantizeKVCache in the graph."""
    assert RewriteOptions().rotary_kv is True
    m, results = ort_ops.rewrite_model(str(FP32))
    r = results[-1]
    assert r.kind == "rotary_kv" and r.fused == LAYERS and not r.declined, r.declined
    assert _ops(m)["RotaryQuantizeKVCache"] == LAYERS and not any(_ops(m)[o] for o in FUSED_AWAY)
    on, _ = ort_ops.rewrite_model(str(FP32), rotary_kv=True)
    assert _signature(m) == _signature(on)
    off, results = ort_ops.rewrite_model(str(FP32), rotary_kv=False)
    assert all(r.kind != "rotary_kv" for r in results)
    assert _ops(off)["RotaryEmbedding"] == 2 * LAYERS and _ops(off)["QuantizeKVCache"] == LAYERS
    assert not _ops(off)["RotaryQuantizeKVCache"]


def _unchanged_decline(m: ir.Model, reason: str, declined: int = 1) -> None:
    before = _signature(m)
    r = _fuse(m)
    assert r.fused == LAYERS - declined and len(r.declined) == declined, r.declined
    assert reason in r.declined[0].reason, r.declined[0].reason
    if declined == LAYERS:
        assert _signature(m) == before


def test_declines_an_extra_reader_of_the_rotated_key():
    """The rotated K also a graph output (a 'present'): declined; the other layer is fused."""
    m = _model()
    rot = _node(m, "RotaryEmbedding", 1)  # layer 0's K
    ident = ir.node("Identity", [rot.outputs[0]], name="present_key")
    ident.outputs[0].name, ident.outputs[0].dtype = "present.0.key", rot.outputs[0].dtype
    m.graph.insert_after(rot, ident)
    m.graph.outputs.append(ident.outputs[0])
    _unchanged_decline(m, "has another reader or is a graph output")
    assert _ops(m)["RotaryEmbedding"] == 2 and "present.0.key" in [o.name for o in m.graph.outputs]


def test_declines_rotaries_of_other_cos_caches():
    """K's rotary reads a cos cache of its own (same values, another node): declined."""
    m = _model()
    k_rot = _node(m, "RotaryEmbedding", 1)
    cache = k_rot.inputs[2].producer()
    other = ir.node("Reshape", list(cache.inputs), name="other_cos_cache")
    other.outputs[0].name, other.outputs[0].dtype = "other_cos_cache", cache.outputs[0].dtype
    m.graph.insert_after(cache, other)
    k_rot.replace_input_with(2, other.outputs[0])
    _unchanged_decline(m, "different cos/sin caches")


def test_declines_a_transpose_chain_that_reorders():
    """The V chain's Transposes composed to [0, 2, 3, 1] on [B, S, 1, D] (not the identity, and
    moving a non-unit axis): declined. The same chain as exported (perms composing to the
    identity) is what the fixture's layers fuse through."""
    m = _model()
    qkv = _node(m, "QuantizeKVCache")
    t2 = qkv.inputs[1].producer().inputs[0].producer()
    assert t2.op_type == "Transpose" and t2.inputs[0].producer().op_type == "Transpose"
    t2.attributes["perm"] = ir.AttrInt64s("perm", [0, 1, 3, 2])
    _unchanged_decline(m, "the element order may change")


def test_accepts_unit_axis_transposes_and_squeezes():
    """A Transpose moving only a size-1 axis (layer 0's single kv head) and an Unsqueeze/Squeeze
    pair inserted into the K chain keep the element order: fused."""
    m = _model()
    qkv = _node(m, "QuantizeKVCache")
    bsnd = qkv.inputs[0].producer().inputs[0]  # the rotated K [B, S, 1, D]
    bsnd.shape = ir.Shape([None, None, 1, 64])
    t = ir.node("Transpose", [bsnd], attributes={"perm": [0, 2, 1, 3]}, name="unit_axis_transpose")
    axes = ir.Value(name="axes0", const_value=ir.tensor(np.array([0], np.int64)))
    m.graph.register_initializer(axes)
    un = ir.node("Unsqueeze", [t.outputs[0], axes], name="extra_unsqueeze")
    sq = ir.node("Squeeze", [un.outputs[0], axes], name="extra_squeeze")
    for n in (t, un, sq):
        n.outputs[0].name, n.outputs[0].dtype = n.name, bsnd.dtype
    m.graph.insert_after(bsnd.producer(), [t, un, sq])
    qkv.inputs[0].producer().replace_input_with(0, sq.outputs[0])
    r = _fuse(m)
    assert r.fused == LAYERS and not r.declined, r.declined
    assert not any(n.name in ("unit_axis_transpose", "extra_unsqueeze", "extra_squeeze") for n in m.graph)


def test_declines_a_split_of_other_sizes():
    """Split sizes that are not [Hq*D, Hkv*D, Hkv*D]: declined."""
    m = _model()
    split = _node(m, "QuantizeKVCache").inputs[1]
    while split.producer().op_type != "Split":
        split = split.producer().inputs[0]
    node = split.producer()
    sizes = ir.Value(name="odd_sizes", const_value=ir.tensor(np.array([128, 96, 32], np.int64)))
    m.graph.register_initializer(sizes)
    node.replace_input_with(1, sizes)
    _unchanged_decline(m, "are not [Hq*D, Hkv*D, Hkv*D] = [128, 64, 64]")


def test_declines_without_rotaries():
    """Rotary pass off: no RotaryEmbedding to fuse, every layer declined with the reason."""
    m, results = ort_ops.rewrite_model(str(FP32), rotary=False, rotary_kv=True)
    r = results[-1]
    assert r.fused == 0 and len(r.declined) == LAYERS
    assert all("not a com.microsoft RotaryEmbedding" in d.reason for d in r.declined)


@needs_op
@pytest.mark.parametrize("path,dtype", [(FP32, "float32"), (FP16, "float16")] + [
    (FIXTURES / f"{name}.onnx", "float32") for name in ("tx_sdpa_kv", "mistral_window_kv", "gemma2_softcap_kv",
                                                         "dynamo_cachepos_kv", "gptoss_sinks_kv")],
    ids=["fp32", "fp16", "tx_sdpa", "mistral_window", "gemma2_softcap", "cachepos", "gptoss_bias_after_split"])
def test_fixture_logits_unchanged(path, dtype):
    """The rewritten model with the pass against the same rewrite without it, through a prefill of
    two sequences and decode steps: logits within the tolerance, greedy tokens identical (the
    float32 exports of other forms too: transformers' SDPA, a sliding window, Gemma 2's softcap,
    cache_position plumbing, gpt-oss's Q/K/V biases after the Split, folded into one Add)."""
    from ort_ops.runtime import PagedRunner

    fused, results = ort_ops.rewrite_model(str(path), rotary_kv=True)
    assert results[-1].fused == LAYERS
    runners = [PagedRunner(ir.serde.serialize_model(m).SerializeToString()) for m in (fused, _model(path))]
    rng = np.random.default_rng(7)
    steps = [{0: rng.integers(3, 100, 21), 1: rng.integers(3, 100, 6)}] + [{0: [int(t)], 1: [int(u)]}
                                                                          for t, u in rng.integers(3, 100, (5, 2))]
    for step in steps:
        a, b = (run.step(step) for run in runners)
        assert np.isfinite(a).all() and np.isfinite(b).all()
        atol = ROTARY_KV_REWRITE_LOGITS_ATOL_REL[dtype] * max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
        assert (a.argmax(-1) == b.argmax(-1)).all()


@needs_op
def test_fixture_greedy_generation_identical():
    """Greedy decoding of the fp32 fixture, the model's own tokens fed back: the same tokens with
    and without the pass."""
    from ort_ops.runtime import PagedRunner

    fused, _ = ort_ops.rewrite_model(str(FP32), rotary_kv=True)
    runners = [PagedRunner(ir.serde.serialize_model(m).SerializeToString()) for m in (fused, _model(FP32))]
    tokens = []
    for run in runners:
        seq = {0: [5, 9, 3, 17, 4, 11, 30], 1: [8, 6, 2]}
        out = []
        for _ in range(8):
            nxt = run.step(seq).argmax(-1)
            out.append(nxt.tolist())
            seq = {0: [int(nxt[0])], 1: [int(nxt[1])]}
        tokens.append(out)
    assert tokens[0] == tokens[1]


def _with_qkv_bias(path: pathlib.Path) -> ir.Model:
    """The default rewrite with a bias Add between each joined Q/K/V MatMul and its Split (Qwen2's
    projections, as matmul_concat joins them)."""
    m = _model(path)
    rng = np.random.default_rng(3)
    for split in [n for n in m.graph if n.op_type == "Split" and len(n.outputs) == 3]:
        x = split.inputs[0]
        dtype = x.dtype.numpy()
        bias = ir.Value(name=f"{x.name}_bias", const_value=ir.tensor((rng.standard_normal(256) * 0.1).astype(dtype)))
        m.graph.register_initializer(bias)
        add = ir.node("Add", [x, bias], name=f"{x.name}_add_bias")
        add.outputs[0].name, add.outputs[0].dtype = f"{x.name}_biased", x.dtype
        m.graph.insert_before(split, add)
        split.replace_input_with(0, add.outputs[0])
    return m


@pytest.mark.parametrize("path,dtype", [(FP32, "float32"), (FP16, "float16")], ids=["fp32", "fp16"])
def test_bias_before_the_split(path, dtype):
    """A bias Add before the Split: fused, the op reading the biased projection; logits as
    without the pass when the library has the op."""
    fused = _with_qkv_bias(path)
    r = _fuse(fused)
    assert r.fused == LAYERS and not r.declined, r.declined
    for node in (n for n in fused.graph if n.op_type == "RotaryQuantizeKVCache"):
        assert node.inputs[0].producer().inputs[0].producer().op_type == "Add"
    if not _op_registered():
        return
    from ort_ops.runtime import PagedRunner

    runners = [PagedRunner(ir.serde.serialize_model(m).SerializeToString()) for m in (fused, _with_qkv_bias(path))]
    for step in ({0: [5, 9, 3, 17, 4, 11, 30, 6], 1: [8, 6, 2]}, {0: [7], 1: [9]}, {0: [12], 1: [4]}):
        a, b = (run.step(step) for run in runners)
        atol = ROTARY_KV_REWRITE_LOGITS_ATOL_REL[dtype] * max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_declines_a_bias_on_the_key_only():
    """A bias Add after the Split on K alone (not Q and V): declined."""
    m = _model()
    split = next(n for n in m.graph if n.op_type == "Split" and len(n.outputs) == 3)
    k = split.outputs[1]
    bias = ir.Value(name="k_bias", const_value=ir.tensor(np.full(64, 0.5, np.float32)))
    m.graph.register_initializer(bias)
    readers = list(k.uses())
    add = ir.node("Add", [k, bias], name="k_bias_add")
    add.outputs[0].name, add.outputs[0].dtype = "k_biased", k.dtype
    for use in readers:
        use.node.replace_input_with(use.idx, add.outputs[0])
    m.graph.insert_after(split, add)
    _unchanged_decline(m, "on some of Q, K, V only")
