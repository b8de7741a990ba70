# SPDX-License-Identifier: MIT
"""The attention rewrite on sliding-window, softcapped and sink attention.

Fixtures (tests/fixtures/attention, made by graphs/export_attention_variants.py): Mistral (a
window of 24 on every layer), Gemma 2 (softcap 2, layer 0 a window of 24, layer 1 global) and
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
VOCAB = 128
MOE = {"gptoss_sinks_kv"}  # its experts stay float here (moe=False): the MoE rewrite's gpt-oss form is tested in test_moe_rewrite.py
# fixture -> per layer (window, softcap, head_sink), and the scale attribute when not 1/sqrt(D)
EXPECTED = {
    "mistral_window_kv": ([(WINDOW, 0.0, None), (WINDOW, 0.0, None)], None),
    "gemma2_softcap_kv": ([(WINDOW, 2.0, None), (0, 2.0, None)], 1.0 / 16),  # query_pre_attn_scalar 256
    "gptoss_sinks_kv": ([(WINDOW, 0.0, SINKS), (0, 0.0, SINKS)], None),
}


def _path(name: str) -> str:
    p = FIXTURES / f"{name}.onnx"
    if not p.is_file():
        pytest.fail(f"fixture {p} missing: run graphs/export_attention_variants.py")
    return str(p)


@functools.cache
def _rewritten(name: str, **options) -> tuple[bytes, object]:
    """(rewritten model bytes, attention FusionResult), once per fixture and options."""
    model, results = rewrite_model(_path(name), moe=False, **options)
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
    # the passes that take the attention pass's QuantizeKVCache (rotary_kv) and the MLP's Split
    # (swiglu) into their ops off: the graph is what the attention pass wrote
    data, result = _rewritten(name, swiglu=False, rotary_kv=False)
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


@pytest.mark.parametrize("window", [4, 20])
@pytest.mark.parametrize("past_kv", [True, False])
def test_windowed_hand_built_decoder_on_the_kernels(window, past_kv):
    """Q.K and P.V unquantized: the paged model equals the original with K/V INT8 emulated over
    prefill and 6 decode steps; the prefill-only model's first logits stay within the INT8
    budget of the original's (prompts of 9 and 27 tokens, longer than both windows)."""
    from graphs.attention import emulate_kv_int8
    from ort_ops.runtime import generate
    from ort_ops.verify import make_prompts
    from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL, ATTN_REWRITE_LOGITS_ATOL

    orig = build_decoder("eager", past_kv=past_kv, mask="window", window=window, seed=3)
    m = ir.serde.deserialize_model(orig)
    assert fuse_paged_attention_int8(m, RewriteOptions(qk_quant="none", pv_quant="none")).fused == LAYERS
    data = ir.serde.serialize_model(m).SerializeToString()
    prompts = make_prompts(64, lengths=(9, 27), seed=4)
    if past_kv:
        a = generate(emulate_kv_int8(orig), prompts, max_new_tokens=6, return_logits=True)
        b = generate(data, prompts, max_new_tokens=6, return_logits=True)
        for x, y in zip(a, b):
            assert x.tokens == y.tokens
            assert np.abs(x.logits - y.logits).max() <= ATTN_REWRITE_EMULATED_LOGITS_ATOL
    else:
        a = generate(orig, prompts, max_new_tokens=1, return_logits=True)
        b = generate(data, prompts, max_new_tokens=1, return_logits=True)
        for x, y in zip(a, b):
            assert np.abs(x.logits[0] - y.logits[0]).max() <= ATTN_REWRITE_LOGITS_ATOL


def test_window_beyond_the_first_long_probe():
    """A window of 9000 (longer than the 8192-key probe) is still measured, by the far probe."""
    orig = build_decoder("eager", past_kv=True, mask="window", window=9000)
    m = ir.serde.deserialize_model(orig)
    result = fuse_paged_attention_int8(m, RewriteOptions())
    assert result.fused == LAYERS, [(d.where, d.reason) for d in result.declined]
    assert [b["window"] for b in result.details["blocks"]] == [9000] * LAYERS


@pytest.mark.parametrize("chunk", [4, 8192])
def test_chunked_attention_declined(chunk):
    """Chunked attention (Llama 4: keys of the query's own chunk) is not a sliding window, also
    with chunks as long as the first long probe (whose last query then sees a whole chunk)."""
    orig = build_decoder("eager", past_kv=True, mask="chunked", window=chunk)
    m = ir.serde.deserialize_model(orig)
    result = fuse_paged_attention_int8(m, RewriteOptions())
    assert result.fused == 0 and result.details["interface"] == "unchanged"
    per_layer = [d for d in result.declined if d.where != "model"]
    assert len(per_layer) == LAYERS and all("not a sliding window" in d.reason for d in per_layer), per_layer


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
    """Gemma 2's softcap with Mul by 6 after Div by 2: not the op's c * tanh(s / c)."""
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
    "softcap-mismatch": ("gemma2_softcap_kv", _softcap_mismatch, "softcap divides by 2.0 and multiplies by 6.0"),
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


# --- the rewritten model under the contract's semantics, without the native kernels ----------------
#
# The rewritten fixtures (qk_quant = pv_quant = "none", the default passes) run on onnx's
# ReferenceEvaluator with the custom ops implemented here from DESIGN.md's text: QuantizeKVCache,
# and the RotaryQuantizeKVCache and SwiGLU that the default rotary_kv and swiglu passes put in
# its and the MLP's place, by their numpy references; PagedAttentionInt8 as float attention over the dequantized cache with the window, softcap and
# head sink of the contract (written out below, not the package's reference, so a misreading of
# the contract by the rewrite and by the reference cannot cancel). The original with its new K/V
# INT8 quantize-dequantized in its own graph (emulate_kv_int8) on stock onnxruntime must give the
# same logits: then the rewrite read the window, softcap, sinks and scale the model computes.


def _contract_attention(q, kc, vc, ks, vs, tables, seq_lens, cu, sink, scale, window, softcap):
    """PagedAttentionInt8 with float Q.K and P.V in float64: query at position p sees keys
    p - window < k <= p (window 0: k <= p); s = scale * q.k; s = c * tanh(s / c) when softcap;
    P = exp(s - m) / (exp(sink - m) + sum exp(s - m)), m = max(sink, max s); out = P @ V."""
    from ort_ops.ops.paged_attention_int8 import gather_sequence

    t, hq, d = q.shape
    hkv = kc.shape[1]
    out = np.zeros((t, hq, d), np.float64)
    for s in range(len(seq_lens)):
        length, rows = int(seq_lens[s]), range(int(cu[s]), int(cu[s + 1]))
        kq, sk, vq, sv = gather_sequence(kc, vc, ks, vs, tables[s], length)
        k = kq.astype(np.float64) * sk[..., None]  # [L, Hkv, D]
        v = vq.astype(np.float64) * sv[..., None]
        for i, row in enumerate(rows):
            p = length - len(rows) + i
            keys = np.arange(length)
            visible = (keys <= p) & ((keys > p - window) if window else True)
            for h in range(hq):
                kv = h // (hq // hkv)
                sc = scale * (k[:, kv, :] @ q[row, h].astype(np.float64))
                if softcap:
                    sc = softcap * np.tanh(sc / softcap)
                sc = sc[visible]
                m = max(sc.max(), sink[h]) if sink is not None else sc.max()
                e = np.exp(sc - m)
                denom = e.sum() + (np.exp(sink[h] - m) if sink is not None else 0.0)
                out[row, h] = (e @ v[visible, kv, :]) / denom
    return out.astype(q.dtype)


def _reference_evaluator(model: onnx.ModelProto):
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    from ort_ops._domain import DOMAIN
    from ort_ops.ops import quantize_kv_cache, rotary_quantize_kv_cache, swiglu

    class QuantizeKVCache(OpRun):
        op_domain = DOMAIN

        def _run(self, key, value, slot_mapping, key_cache, value_cache, key_scale, value_scale):
            return tuple(quantize_kv_cache.reference(key, value, slot_mapping, key_cache, value_cache, key_scale,
                                                     value_scale))

        def run(self, *args, **kwargs):  # no attributes: skip OpRun's attribute plumbing
            return self._run(*args)

    class RotaryQuantizeKVCache(OpRun):
        op_domain = DOMAIN

        def _run(self, qkv, cos, sin, slot_mapping, key_cache, value_cache, key_scale, value_scale):
            a = {att.name: onnx.helper.get_attribute_value(att) for att in self.onnx_node.attribute}
            return tuple(rotary_quantize_kv_cache.reference(qkv, cos, sin, slot_mapping, key_cache, value_cache,
                                                            key_scale, value_scale, **a))

        def run(self, *args, **kwargs):
            return self._run(*args)

    class SwiGLU(OpRun):
        op_domain = DOMAIN

        def _run(self, x):
            return (swiglu.reference(x),)

        def run(self, *args, **kwargs):
            return self._run(*args)

    class PagedAttentionInt8(OpRun):
        op_domain = DOMAIN

        def _run(self, q, kc, vc, ks, vs, tables, seq_lens, cu, head_sink=None):
            a = {att.name: onnx.helper.get_attribute_value(att) for att in self.onnx_node.attribute}
            quant = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in a.items() if k.endswith("_quant")}
            assert quant == {"qk_quant": "none", "pv_quant": "none"}, quant
            scale = a.get("scale", 1.0 / np.sqrt(q.shape[-1]))
            return (_contract_attention(q, kc, vc, ks, vs, tables, seq_lens, cu, head_sink, scale,
                                        a.get("window", 0), a.get("softcap", 0.0)),)

        def run(self, *args, **kwargs):
            return self._run(*args)

    return ReferenceEvaluator(model, new_ops=[QuantizeKVCache, RotaryQuantizeKVCache, SwiGLU, PagedAttentionInt8,
                                              simplified_layer_norm_op(), skip_simplified_layer_norm_op(),
                                              rotary_embedding_op()])


def simplified_layer_norm_op():
    """ORT's SimplifiedLayerNormalization (what the RMSNorm fusion writes) for onnx's
    ReferenceEvaluator: x / sqrt(mean(x^2 over the last axis) + epsilon) * scale, in float32."""
    from onnx.reference.op_run import OpRun

    class SimplifiedLayerNormalization(OpRun):
        op_domain = ""

        def _run(self, x, scale):
            a = {att.name: onnx.helper.get_attribute_value(att) for att in self.onnx_node.attribute}
            assert a.get("axis", -1) in (-1, x.ndim - 1) and a.get("stash_type", 1) == 1, a
            x32 = x.astype(np.float32)
            inv = 1.0 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + np.float32(a.get("epsilon", 1e-5)))
            return ((x32 * inv * scale.astype(np.float32)).astype(x.dtype),)

        def run(self, *args, **kwargs):
            return self._run(*args)

    return SimplifiedLayerNormalization


def skip_simplified_layer_norm_op():
    """ORT's com.microsoft SkipSimplifiedLayerNormalization (what the norms pass writes for a norm
    of a residual Add) for onnx's ReferenceEvaluator: the sum of input and skip in float32, its
    RMS norm times gamma (output 0), and the sum in the input's type (output 3, when declared)."""
    from onnx.reference.op_run import OpRun

    class SkipSimplifiedLayerNormalization(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, skip, gamma, bias=None):
            a = {att.name: onnx.helper.get_attribute_value(att) for att in self.onnx_node.attribute}
            h32 = x.astype(np.float32) + skip.astype(np.float32)
            if bias is not None:
                h32 = h32 + bias.astype(np.float32)
            inv = 1.0 / np.sqrt(np.mean(h32 * h32, axis=-1, keepdims=True) + np.float32(a.get("epsilon", 1e-5)))
            y = (h32 * inv * gamma.astype(np.float32)).astype(x.dtype)
            if len(self.onnx_node.output) == 1:
                return (y,)
            return (y, None, None, h32.astype(x.dtype))

        def run(self, *args, **kwargs):
            return self._run(*args)

    return SkipSimplifiedLayerNormalization


def rotary_embedding_op():
    """ORT's com.microsoft RotaryEmbedding (what the RoPE fusion writes) for onnx's
    ReferenceEvaluator, rotate_half (interleaved 0) on the whole head: x [B, S, N*D] (or
    [B, N, S, D]) with D = 2 * the caches' width; token s of a batch row at position
    position_ids[0] + s (shape [1]) or position_ids[b, s]; computed in float32."""
    from onnx.reference.op_run import OpRun

    class RotaryEmbedding(OpRun):
        op_domain = "com.microsoft"

        def _run(self, x, position_ids, cos_cache, sin_cache):
            a = {att.name: onnx.helper.get_attribute_value(att) for att in self.onnx_node.attribute}
            assert not a.get("interleaved", 0) and not a.get("rotary_embedding_dim", 0), a
            h = cos_cache.shape[1]
            bnsh = x.ndim == 4
            x32 = x.astype(np.float32)
            if not bnsh:  # [B, S, N*D] -> [B, N, S, D]
                b_, s_ = x.shape[:2]
                x32 = x32.reshape(b_, s_, -1, 2 * h).transpose(0, 2, 1, 3)
            s_ = x32.shape[2]
            pos = (position_ids.reshape(-1)[0] + np.arange(s_))[None, :] if position_ids.size == 1 else position_ids
            c = cos_cache.astype(np.float32)[pos][:, None]  # [B or 1, 1, S, h]
            t = sin_cache.astype(np.float32)[pos][:, None]
            x1, x2 = x32[..., :h], x32[..., h:]
            out = np.concatenate([x1 * c - x2 * t, x2 * c + x1 * t], axis=-1)
            if not bnsh:
                out = out.transpose(0, 2, 1, 3).reshape(x.shape)
            return (out.astype(x.dtype),)

        def run(self, *args, **kwargs):
            return self._run(*args)

    return RotaryEmbedding


def _paged_prefill_logits(model: onnx.ModelProto, prompts: list[list[int]], block_size: int = 16) -> np.ndarray:
    """Last-token logits [S, V] of one packed prefill of ``prompts`` on the ReferenceEvaluator."""
    from ort_ops.paged_interface import cache_input_name
    from ort_ops.runtime import paged_metadata

    meta = paged_metadata(model)
    blocks = [-(-len(p) // block_size) for p in prompts]
    tables = np.zeros((len(prompts), max(blocks)), np.int32)
    slots, start = [], 0
    for s, (p, nb) in enumerate(zip(prompts, blocks)):
        tables[s, :nb] = np.arange(start, start + nb)
        slots += [start * block_size + i for i in range(len(p))]
        start += nb
    feeds = {"input_ids": np.array([sum(prompts, [])], np.int64),
             "position_ids": np.array([sum((list(range(len(p))) for p in prompts), [])], np.int64),
             "slot_mapping": np.array(slots, np.int64), "block_tables": tables,
             "seq_lens": np.array([len(p) for p in prompts], np.int32),
             "cu_seqlens_q": np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int32)}
    for layer, (hkv, d) in enumerate(meta["layer_dims"]):
        feeds[cache_input_name(layer, "key")] = np.zeros((start, hkv, block_size, d), np.int8)
        feeds[cache_input_name(layer, "value")] = np.zeros((start, hkv, d, block_size), np.int8)
        for part in ("key_scale", "value_scale"):
            feeds[cache_input_name(layer, part)] = np.zeros((start, hkv, block_size), np.float32)
    logits = _reference_evaluator(model).run([meta["logits"]], feeds)[0][0]
    if meta["logits_rows"] == "all":  # lm_head not a plain MatMul (Gemma 2's final softcap): every token's
        logits = logits[feeds["cu_seqlens_q"][1:] - 1]
    return logits


@pytest.mark.parametrize("name", list(EXPECTED))
def test_rewritten_variant_matches_the_original_under_the_contract(name):
    """Two prompts longer than the window (31 and 44 tokens), packed in one prefill: the
    rewritten model under the contract's semantics equals the original with K/V INT8 emulated."""
    import onnxruntime as ort

    from graphs.attention import emulate_kv_int8
    from ort_ops.verify import make_prompts
    from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL

    model, _ = rewrite_model(_path(name), moe=False, qk_quant="none", pv_quant="none")
    rewritten = ir.serde.serialize_model(model)
    # the default rewrite's prologue and MLP ops (Gemma 2's MLP is GELU; gpt-oss's a float MoE here)
    census = collections.Counter(n.op_type for n in rewritten.graph.node)
    assert census["RotaryQuantizeKVCache"] == LAYERS and census["QuantizeKVCache"] == 0
    assert census["SwiGLU"] == (LAYERS if name == "mistral_window_kv" else 0)
    prompts = make_prompts(128, lengths=(31, 44), seed=5, avoid=(2,))
    got = _paged_prefill_logits(rewritten, prompts)
    emulated = emulate_kv_int8(onnx.load(_path(name)))
    sess = ort.InferenceSession(emulated.SerializeToString(), providers=["CPUExecutionProvider"])
    for p, row in zip(prompts, got):
        feeds = {"input_ids": np.array([p], np.int64), "attention_mask": np.ones((1, len(p)), np.int64),
                 "position_ids": np.arange(len(p))[None]}
        for i in sess.get_inputs():
            if i.name.startswith("past"):
                feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        want = sess.run(["logits"], feeds)[0][0, -1]
        assert np.all(np.isfinite(row))
        err = np.abs(want - row).max()
        assert err <= ATTN_REWRITE_EMULATED_LOGITS_ATOL, (name, len(p), err)


# --- on the native CPU kernels and the paged runtime -----------------------------------------------


@pytest.mark.parametrize("name", list(EXPECTED))
def test_variant_equals_emulated_kv_quantization_on_the_kernels(name):
    """With Q.K and P.V unquantized, the rewritten model on the CPU kernels and the paged runtime
    equals the original with its K/V INT8 emulated, prefill and 12 decode steps, 3 prompts at once,
    contexts up to 53 positions: the windowed layers drop the first blocks, the global layers of
    Gemma 2 and gpt-oss still read them (the runtime keeps every block of a live sequence)."""
    from graphs.attention import emulate_kv_int8
    from ort_ops.runtime import generate
    from ort_ops.verify import make_prompts
    from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL

    model, _ = rewrite_model(_path(name), moe=False, qk_quant="none", pv_quant="none")
    data = ir.serde.serialize_model(model).SerializeToString()
    prompts = make_prompts(128, lengths=(20, 30, 41), seed=9)
    assert max(map(len, prompts)) + 12 > 2 * WINDOW
    a = generate(emulate_kv_int8(onnx.load(_path(name))), prompts, max_new_tokens=12, return_logits=True)
    b = generate(data, prompts, max_new_tokens=12, return_logits=True)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        assert np.all(np.isfinite(y.logits))
        err = np.abs(x.logits - y.logits)
        assert err.max() <= ATTN_REWRITE_EMULATED_LOGITS_ATOL, (err.max(), np.unravel_index(err.argmax(), err.shape))


@pytest.mark.parametrize("name", list(EXPECTED))
def test_variant_verify_agreement_beyond_the_window(name):
    """``ort-ops verify``'s check, s8/s8: 4 prompts of 5-23 tokens, 32 greedy tokens (contexts up
    to 55 > the window of 24), teacher-forced agreement >= 0.95, lengths and EOS matching."""
    from ort_ops.verify import make_prompts, verify
    from tests.tolerances import ATTN_REWRITE_GREEDY_AGREEMENT, ATTN_REWRITE_LOGITS_ATOL

    data, _ = _rewritten(name)
    prompts = make_prompts(VOCAB, avoid=(2,))  # verify's default prompts (EOS 2 from the metadata)
    report = verify(_path(name), data, prompts=prompts, max_new_tokens=32, eos_token_id=None)
    o = report["overall"]
    print(name, o)
    longest = max(p["prompt_len"] + len(p["tokens_original"]) for p in report["prompts"])
    assert report["rewritten_interface"] == "paged"
    assert longest > 2 * WINDOW
    assert o["token_agreement"] >= ATTN_REWRITE_GREEDY_AGREEMENT
    assert o["length_match"] and o["eos_match"]
    if name not in MOE:
        assert o["logits_max_abs_err"] <= ATTN_REWRITE_LOGITS_ATOL
        return
    # gpt-oss (a float MoE after the attention): the original itself moves by up to ~0.8 on some
    # steps when only its K/V are INT8 (emulated in its graph), as README's "Logit spikes on MoE
    # models" describes. What the rewrite must do is equal that: fed the original's tokens, the
    # rewritten model with Q.K and P.V unquantized equals the emulated original on these prompts.
    from graphs.attention import emulate_kv_int8
    from ort_ops.runtime import generate
    from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL

    forced = [p["tokens_original"] for p in report["prompts"]]
    model, _ = rewrite_model(_path(name), moe=False, qk_quant="none", pv_quant="none")
    a = generate(emulate_kv_int8(onnx.load(_path(name))), prompts, max_new_tokens=32, return_logits=True,
                 forced_tokens=forced)
    b = generate(ir.serde.serialize_model(model).SerializeToString(), prompts, max_new_tokens=32,
                 return_logits=True, forced_tokens=forced)
    for x, y in zip(a, b):
        assert np.abs(x.logits - y.logits).max() <= ATTN_REWRITE_EMULATED_LOGITS_ATOL


def test_cli_report_lists_each_layer(tmp_path, capsys):
    """``ort-ops rewrite`` prints every fused layer with its window and sinks (gpt-oss: layer 0
    sliding, layer 1 global, both with the sinks -1 and 2)."""
    from ort_ops.cli import main

    assert main(["rewrite", "--quiet", "--no-moe", _path("gptoss_sinks_kv"), str(tmp_path / "out.onnx")]) == 0
    text = capsys.readouterr().out
    assert "attention: 2 block(s) fused (matmul: 2), interface: paged" in text
    assert "    layer 0: window 24, head_sink [-1, 2]\n" in text
    assert "    layer 1: no window, head_sink [-1, 2]\n" in text


# --- com.microsoft GroupQueryAttention (onnxruntime-genai's form) ------------------------------


def _gqa_node_output(q, k, v, past_k, past_v, **attrs) -> np.ndarray:
    """One GroupQueryAttention node on stock onnxruntime: q [S, Hq, D], k/v [S, Hkv, D], past
    [P, Hkv, D] (batch 1, no rotary); ``head_sink`` in attrs becomes input 11. Returns [S, Hq, D]."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    s, hq, d = q.shape
    hkv, p = k.shape[1], past_k.shape[0]
    sink = attrs.pop("head_sink", None)
    names = ["q", "k", "v", "pk", "pv", "seqlens_k", "total"] + (["", "", "", "", "sink"] if sink is not None else [])
    node = helper.make_node("GroupQueryAttention", names, ["o", "ok", "ov"], domain="com.microsoft", num_heads=hq,
                            kv_num_heads=hkv, **attrs)
    f = lambda n, shape: helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
    inputs = [f("q", [1, s, hq * d]), f("k", [1, s, hkv * d]), f("v", [1, s, hkv * d]), f("pk", [1, hkv, p, d]),
              f("pv", [1, hkv, p, d]), helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])] + ([f("sink", [hq])] if sink is not None else [])
    graph = helper.make_graph([node], "gqa", inputs, [f("o", None), f("ok", None), f("ov", None)])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 20),
                                                                  helper.make_opsetid("com.microsoft", 1)])
    feeds = {"q": q.reshape(1, s, -1), "k": k.reshape(1, s, -1), "v": v.reshape(1, s, -1),
             "pk": past_k.transpose(1, 0, 2)[None], "pv": past_v.transpose(1, 0, 2)[None],
             "seqlens_k": np.array([p + s - 1], np.int32), "total": np.array(p + s, np.int32)}
    if sink is not None:
        feeds["sink"] = np.asarray(sink, np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["o"], feeds)[0].reshape(s, hq, d)


@pytest.mark.parametrize("past,seq", [(30, 1), (30, 5), (0, 20)])
def test_gqa_attributes_mean_the_ops_window_softcap_and_sink(past, seq):
    """The mapping the rewrite relies on, checked on onnxruntime itself: a GroupQueryAttention
    with local_window_size 8, softcap 1.5 and head_sink equals the contract's attention with
    window 8 (not 9: local_window_size counts the query's own key), softcap 1.5 and that sink."""
    rng = np.random.default_rng(past + seq)
    hq, hkv, d = 2, 1, 64
    q = (rng.standard_normal((seq, hq, d)) * 2).astype(np.float32)
    k = rng.standard_normal((past + seq, hkv, d)).astype(np.float32)
    v = rng.standard_normal((past + seq, hkv, d)).astype(np.float32)
    sink = np.array(SINKS, np.float32)
    got = _gqa_node_output(q, k[past:], v[past:], k[:past], v[:past], local_window_size=8, softcap=1.5,
                           head_sink=sink)
    # the contract on a one-block "cache" holding K/V as floats: codes = values, scales = 1
    want = {}
    for window in (8, 9):
        want[window] = np.zeros((seq, hq, d))
        for i in range(seq):
            pos = past + i
            keys = np.arange(pos + 1)
            vis = keys > pos - window
            for h in range(hq):
                s = 1.5 * np.tanh((k[: pos + 1, 0] @ q[i, h].astype(np.float64)) / np.sqrt(d) / 1.5)[vis]
                m = max(s.max(), sink[h])
                e = np.exp(s - m)
                want[window][i, h] = (e @ v[: pos + 1, 0][vis]) / (e.sum() + np.exp(sink[h] - m))
    assert np.abs(got - want[8]).max() <= 1e-5
    if past + seq > 8:
        assert np.abs(got - want[9]).max() > 1e-2  # the test tells 8 from 9


def test_gqa_window_softcap_sink_fused_and_agree():
    """A genai-style GroupQueryAttention decoder with local_window_size 8, softcap 1.5 and sinks
    fuses with window 8, softcap 1.5 and head_sink; teacher-forced on the original's tokens
    (prompts of 9-21 tokens, 8 new ones) its logits stay within the INT8 budget."""
    from ort_ops.runtime import generate
    from ort_ops.verify import make_prompts
    from tests.tolerances import ATTN_REWRITE_LOGITS_ATOL

    from graphs.attention import build_gqa_decoder

    orig = build_gqa_decoder(local_window_size=8, softcap=1.5, head_sink=SINKS, seed=5)
    m = ir.serde.deserialize_model(orig)
    result = fuse_paged_attention_int8(m, RewriteOptions())
    assert result.fused == LAYERS and not result.declined, result.declined
    assert result.details["blocks"] == [{"layer": i, "window": 8, "softcap": 1.5, "head_sink": SINKS}
                                        for i in range(LAYERS)]
    data = ir.serde.serialize_model(m).SerializeToString()
    for p in make_prompts(64, lengths=(9, 21), seed=6):
        a = generate(orig, [p], max_new_tokens=8, return_logits=True)[0]
        t = generate(data, [p], forced_tokens=[a.tokens], return_logits=True)[0]
        assert np.abs(a.logits - t.logits).max() <= ATTN_REWRITE_LOGITS_ATOL


# --- the ONNX Attention op (opset 23) with softcap ----------------------------------------------


def test_onnx_attention_softcap_is_applied_before_the_mask():
    """The mapping the rewrite relies on, on onnxruntime: Attention(softcap=c) with a causal mask
    equals softmax(c * tanh(scale * q.k / c) + mask) (the op's order), not c * tanh((s + mask) / c)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    b, h, s, t, d = 1, 2, 5, 12, 64
    q = (rng.standard_normal((b, h, s, d)) * 2).astype(np.float32)
    k = rng.standard_normal((b, h, t, d)).astype(np.float32)
    v = rng.standard_normal((b, h, t, d)).astype(np.float32)
    mask = np.where(np.arange(t)[None] <= np.arange(t - s, t)[:, None], 0, -np.inf).astype(np.float32)[None, None]
    f = lambda n, shape: helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
    node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y"], softcap=1.5)
    graph = helper.make_graph([node], "a", [f("q", [b, h, s, d]), f("k", [b, h, t, d]), f("v", [b, h, t, d]),
                                            f("m", [1, 1, s, t])], [f("y", None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"q": q, "k": k, "v": v, "m": mask})[0]
    scores = (q.astype(np.float64) @ k.transpose(0, 1, 3, 2)) / np.sqrt(d)

    def attend(x):
        p = np.exp(x - x.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v

    assert np.abs(attend(1.5 * np.tanh(scores / 1.5) + mask) - y).max() <= 1e-5
    assert np.abs(attend(1.5 * np.tanh((scores + mask) / 1.5)) - y).max() > 1e-2


def test_onnx_attention_softcap_fused_on_the_kernels():
    """dynamo_attn23_kv with softcap 1.5 set on its Attention nodes: fused with softcap 1.5; with
    Q.K and P.V unquantized it equals that model with K/V INT8 emulated (dropping the softcap in
    the rewritten model moves its logits by 0.4, measured)."""
    from graphs.attention import emulate_kv_int8
    from ort_ops.runtime import generate
    from ort_ops.verify import make_prompts
    from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL

    orig = onnx.load(_path("dynamo_attn23_kv"))
    for n in orig.graph.node:
        if n.op_type == "Attention":
            n.attribute.append(onnx.helper.make_attribute("softcap", 1.5))
    m = ir.serde.deserialize_model(orig)
    result = fuse_paged_attention_int8(m, RewriteOptions(qk_quant="none", pv_quant="none"))
    assert result.fused == LAYERS, result.declined
    assert [b["softcap"] for b in result.details["blocks"]] == [1.5] * LAYERS
    data = ir.serde.serialize_model(m).SerializeToString()
    prompts = make_prompts(128, lengths=(6, 15), seed=2)
    a = generate(emulate_kv_int8(orig), prompts, max_new_tokens=6, return_logits=True)
    b = generate(data, prompts, max_new_tokens=6, return_logits=True)
    for x, y in zip(a, b):
        assert x.tokens == y.tokens
        assert np.abs(x.logits - y.logits).max() <= ATTN_REWRITE_EMULATED_LOGITS_ATOL


def test_gpt_oss_kv_model_fuses_attention_and_moe_together():
    """The whole gpt-oss fixture through both passes: sink attention (window on layer 0) and the
    MoE blocks with expert biases and swiglu_oai, in one paged model."""
    model, results = rewrite_model(ir.load(_path("gptoss_sinks_kv")), block_size=16)
    kinds = {r.kind: r for r in results}
    assert kinds["attention"].fused == 2 and kinds["moe"].fused == 2, [
        (d.where, d.reason) for r in results for d in r.declined]
    proto = ir.to_proto(model)
    census = collections.Counter(n.op_type for n in proto.graph.node)
    assert census["PagedAttentionInt8"] == 2 and census["GroupedMatmulSwigluQuant"] == 2
    sinks = [n for n in proto.graph.node if n.op_type == "PagedAttentionInt8" and len(n.input) > 8 and n.input[8]]
    acts = {onnx.helper.get_attribute_value(a) for n in proto.graph.node if n.op_type == "GroupedMatmulSwigluQuant"
            for a in n.attribute if a.name == "activation"}
    assert len(sinks) == 2 and acts == {b"swiglu_oai"}
