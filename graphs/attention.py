# SPDX-License-Identifier: MIT
"""Hand-built *unfused* decoders for the attention rewrite's tests (not shipped).

    build_decoder(form="eager", *, layers=2, hq=2, hkv=1, head_dim=64, past_kv=True,
                  mask="causal", seed=0) -> onnx.ModelProto

A tiny decoder in the layout exporters write: token + learned position embeddings (so positions
matter), per layer Q/K/V projections, [B, S, H*D] -> [B, H, S, D], repeat_kv (Unsqueeze, Expand,
Reshape) when Hq > Hkv, the attention in the chosen form, output projection and a residual;
lm_head at the end. Inputs ``input_ids``, ``attention_mask`` [B, P+S], ``position_ids`` and, with
``past_kv``, ``past_key_values.{i}.key/value`` [B, Hkv, P, D]; outputs ``logits`` and
``present.{i}.key/value``.

Forms: "eager" (MatMul, Mul(scale), Add(mask), Softmax, MatMul) and "sdpa" (q and K^T each times
sqrt(scale), Add(mask), Softmax, Where(IsNaN), MatMul).
Masks: "causal" (causal + key padding from attention_mask) and "window" (the same limited to the
last ``window`` positions, default 4: the op's ``window``), what the ops express, and the ones
they cannot: "chunked" (keys of the query's own chunk of ``window`` positions, Llama 4's chunked
attention), "none" (no mask: bidirectional), "bias" (an ALiBi-like additive bias). ``softmax_axis=2`` normalizes over queries (not attention).

``emulate_kv_int8(model)`` inserts the contract's per-token, per-head INT8 quantize/dequantize of
the new K and V (round half to even, scale = amax/127) before they are cached: the rewritten model
with ``qk_quant=pv_quant="none"`` must equal it up to float rounding.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN = 64
VOCAB = 64
OPSET = 20
NEG = np.float32(-3.4028235e38)


class _B:
    """A small graph builder: ``b.op("MatMul", [x, w])`` returns the output name."""

    def __init__(self, seed: int):
        self.nodes, self.inits = [], []
        self.n = 0
        self.rng = np.random.default_rng(seed)

    def name(self, hint: str) -> str:
        self.n += 1
        return f"{hint}_{self.n}"

    def const(self, arr, hint="c") -> str:
        nm = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), nm))
        return nm

    def weight(self, *shape, std=0.1) -> str:
        return self.const((self.rng.standard_normal(shape) * std).astype(np.float32), "w")

    def op(self, op_type, inputs, outputs=None, **attrs):
        outs = outputs or [self.name(op_type.lower())]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), **attrs))
        return outs[0] if len(outs) == 1 else outs


def _ints(b: _B, v) -> str:
    return b.const(np.array(v, np.int64), "shape")


def _mask(b: _B, kind: str, ids: str, am: str, window: int = 4) -> str | None:
    """[B, 1, S, P+S] additive float mask (0 = visible) from attention_mask and positions."""
    if kind == "none":
        return None
    total = b.op("Gather", [b.op("Shape", ["attention_mask"]), _ints(b, 1)], axis=0)
    seq = b.op("Gather", [b.op("Shape", [ids]), _ints(b, 1)], axis=0)
    past = b.op("Sub", [total, seq])
    i = b.op("Unsqueeze", [b.op("Range", [past, total, _ints(b, 1)]), _ints(b, [1])])  # [S, 1]
    j = b.op("Unsqueeze", [b.op("Range", [_ints(b, 0), total, _ints(b, 1)]), _ints(b, [0])])  # [1, T]
    if kind == "bias":
        dist = b.op("Cast", [b.op("Sub", [j, i])], to=TensorProto.FLOAT)
        causal = b.op("LessOrEqual", [j, i])
        bias = b.op("Mul", [dist, b.const(np.float32(0.5))])
        m = b.op("Where", [causal, bias, b.const(NEG)])
        return b.op("Unsqueeze", [m, _ints(b, [0, 1])])
    allowed = b.op("LessOrEqual", [j, i])
    if kind == "window":
        allowed = b.op("And", [allowed, b.op("Greater", [j, b.op("Sub", [i, _ints(b, window)])])])
    elif kind == "chunked":  # keys in the query's own chunk of ``window`` positions
        same = b.op("Equal", [b.op("Div", [j, _ints(b, window)]), b.op("Div", [i, _ints(b, window)])])
        allowed = b.op("And", [allowed, same])
    pad = b.op("Greater", [b.op("Unsqueeze", [am, _ints(b, [1, 2])]), _ints(b, 0)])  # [B, 1, 1, T]
    allowed = b.op("And", [b.op("Unsqueeze", [allowed, _ints(b, [0, 1])]), pad])
    return b.op("Where", [allowed, b.const(np.float32(0)), b.const(NEG)])


def _repeat_kv(b: _B, x: str, hkv: int, rep: int, d: int) -> str:
    if rep == 1:
        return x
    shp = b.op("Shape", [x])
    bsz = b.op("Slice", [shp, _ints(b, [0]), _ints(b, [1])])
    slen = b.op("Slice", [shp, _ints(b, [2]), _ints(b, [3])])
    u = b.op("Unsqueeze", [x, _ints(b, [2])])
    e = b.op("Expand", [u, b.op("Concat", [bsz, _ints(b, [hkv, rep]), slen, _ints(b, [d])], axis=0)])
    return b.op("Reshape", [e, b.op("Concat", [bsz, _ints(b, [hkv * rep]), slen, _ints(b, [d])], axis=0)])


def build_decoder(form: str = "eager", *, layers: int = 2, hq: int = 2, hkv: int = 1, head_dim: int = 64,
                  past_kv: bool = True, mask: str = "causal", softmax_axis: int = -1,
                  window: int = 4, seed: int = 0) -> onnx.ModelProto:
    """A float decoder as documented in the module docstring."""
    if form not in ("eager", "sdpa"):
        raise ValueError(f"build_decoder: form must be 'eager' or 'sdpa', got '{form}'")
    b = _B(seed)
    d, rep = head_dim, hq // hkv
    h = b.op("Add", [b.op("Gather", [b.weight(VOCAB, HIDDEN, std=1.0), "input_ids"], axis=0),
                     b.op("Gather", [b.weight(1024, HIDDEN, std=0.5), "position_ids"], axis=0)])
    m = _mask(b, mask, "input_ids", "attention_mask", window)
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB])]
    scale = 1.0 / np.sqrt(d)
    for layer in range(layers):
        def heads(x, n):
            r = b.op("Reshape", [x, _ints(b, [0, 0, n, d])])
            return b.op("Transpose", [r], perm=[0, 2, 1, 3])  # [B, S, n*D] -> [B, n, S, D]

        q = heads(b.op("MatMul", [h, b.weight(HIDDEN, hq * d)]), hq)
        k = heads(b.op("MatMul", [h, b.weight(HIDDEN, hkv * d)]), hkv)
        v = heads(b.op("MatMul", [h, b.weight(HIDDEN, hkv * d)]), hkv)
        if past_kv:
            pk, pv = f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"
            for n in (pk, pv):
                inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", hkv, "past", d]))
            k = b.op("Concat", [pk, k], [f"present.{layer}.key"], axis=2)
            v = b.op("Concat", [pv, v], [f"present.{layer}.value"], axis=2)
            for n in (f"present.{layer}.key", f"present.{layer}.value"):
                outputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", hkv, "total", d]))
        kr, vr = _repeat_kv(b, k, hkv, rep, d), _repeat_kv(b, v, hkv, rep, d)
        kt = b.op("Transpose", [kr], perm=[0, 1, 3, 2])
        if form == "eager":
            s = b.op("Mul", [b.op("MatMul", [q, kt]), b.const(np.float32(scale))])
        else:
            c = b.const(np.float32(np.sqrt(scale)))
            s = b.op("MatMul", [b.op("Mul", [q, c]), b.op("Mul", [kt, c])])
        if m is not None:
            s = b.op("Add", [s, m])
        p = b.op("Softmax", [s], axis=softmax_axis)
        if form == "sdpa":
            p = b.op("Where", [b.op("IsNaN", [p]), b.const(np.float32(0)), p])
        o = b.op("MatMul", [p, vr])  # [B, Hq, S, D]
        o = b.op("Reshape", [b.op("Transpose", [o], perm=[0, 2, 1, 3]), _ints(b, [0, 0, hq * d])])
        h = b.op("Add", [h, b.op("MatMul", [o, b.weight(hq * d, HIDDEN)])])
    b.op("MatMul", [h, b.weight(HIDDEN, VOCAB, std=0.3)], ["logits"])
    graph = helper.make_graph(b.nodes, f"decoder_{form}_{mask}", inputs, outputs, b.inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model)
    return model


def build_gqa_decoder(*, layers: int = 2, hq: int = 2, hkv: int = 1, head_dim: int = 64,
                      packed_qkv: bool = True, local_window_size: int = -1,
                      rotary_interleaved: int = 0, past_kv: bool = True, softcap: float = 0.0,
                      head_sink=None, seed: int = 0) -> onnx.ModelProto:
    """The ``com.microsoft`` GroupQueryAttention form onnxruntime-genai's builder and ORT's
    transformer optimizer write: packed QKV [B, S, (Hq+2Hkv)*D], do_rotary=1 with cos/sin caches,
    seqlens_k = sum(attention_mask) - 1, past/present [B, Hkv, P, D]; no position_ids input (GQA
    derives positions from the past length). Runs on stock ORT CPU (right-padded or unpadded).
    ``past_kv=False``: a prefill graph that starts the cache (no past inputs, present outputs).
    ``local_window_size``, ``softcap`` and ``head_sink`` (float32 [hq], a constant input 11) as
    onnxruntime-genai writes them for sliding-window, softcapped and sink models."""
    b = _B(seed)
    d = head_dim
    h = b.op("Gather", [b.weight(VOCAB, HIDDEN, std=1.0), "input_ids"], axis=0)
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB])]
    seqlens_k = b.op("Cast", [b.op("Sub", [b.op("ReduceSum", ["attention_mask", _ints(b, [1])], keepdims=0),
                                           _ints(b, 1)])], to=TensorProto.INT32)
    total = b.op("Cast", [b.op("Gather", [b.op("Shape", ["attention_mask"]), _ints(b, 1)], axis=0)],
                 to=TensorProto.INT32)
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = np.arange(1024)[:, None] * inv[None, :]
    cos, sin = b.const(np.cos(ang).astype(np.float32), "cos_cache"), b.const(np.sin(ang).astype(np.float32), "sin_cache")
    for layer in range(layers):
        pk, pv = (f"past_key_values.{layer}.key", f"past_key_values.{layer}.value") if past_kv else ("", "")
        for n in (pk, pv) if past_kv else ():
            inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", hkv, "past", d]))
        for n in (f"present.{layer}.key", f"present.{layer}.value"):
            outputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", hkv, "total", d]))
        if packed_qkv:
            qkv = [b.op("MatMul", [h, b.weight(HIDDEN, (hq + 2 * hkv) * d)]), "", ""]
        else:
            qkv = [b.op("MatMul", [h, b.weight(HIDDEN, n * d)]) for n in (hq, hkv, hkv)]
        sink = [] if head_sink is None else ["", "", b.const(np.asarray(head_sink, np.float32), "head_sink")]
        o = b.op("GroupQueryAttention", qkv + [pk, pv, seqlens_k, total, cos, sin] + sink,
                 [b.name("gqa"), f"present.{layer}.key", f"present.{layer}.value"], domain="com.microsoft",
                 num_heads=hq, kv_num_heads=hkv, do_rotary=1, rotary_interleaved=rotary_interleaved,
                 local_window_size=local_window_size, softcap=float(softcap))[0]
        h = b.op("Add", [h, b.op("MatMul", [o, b.weight(hq * d, HIDDEN)])])
    b.op("MatMul", [h, b.weight(HIDDEN, VOCAB, std=0.3)], ["logits"])
    graph = helper.make_graph(b.nodes, "decoder_gqa", inputs, outputs, b.inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", OPSET),
                                                                  helper.make_opsetid("com.microsoft", 1)])


def emulate_kv_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with each new K/V (second input of a past Concat, or a K/V that feeds repeat_kv
    or the key transpose in prefill graphs found by the rewrite's decoder) replaced by its INT8
    quantize-dequantize per (token, head) along head_dim. Works on KV-cache models: the new K/V is
    the Concat's second input."""
    import onnx_ir as ir

    from ort_ops.rewrite.paged_attention_int8 import _find_past, _skip_copies

    m = ir.serde.deserialize_model(model)
    past = _find_past(m)
    axes_as_input = m.opset_imports.get("", 1) >= 18  # ReduceMax takes axes as an input from 18

    def c(val, dt=np.float32):
        return ir.node("Constant", [], attributes={"value": ir.tensor(np.array(val, dt))})

    for node in list(m.graph):
        if node.op_type != "Concat" or len(node.inputs) != 2 or _skip_copies(node.inputs[0]) not in past:
            continue
        new = node.inputs[1]
        n127, axes = c(127.0), c([-1], np.int64)
        absn = ir.node("Abs", [new])
        if axes_as_input:
            amax = ir.node("ReduceMax", [absn.outputs[0], axes.outputs[0]], attributes={"keepdims": 1})
        else:
            amax = ir.node("ReduceMax", [absn.outputs[0]], attributes={"keepdims": 1, "axes": [-1]})
        div = ir.node("Div", [n127.outputs[0], amax.outputs[0]])  # 127 / amax first (the contract)
        zero = c(0.0)  # amax == 0 (an all-zero K/V, e.g. a zero embedding row): codes 0, not 0 * inf
        is0 = ir.node("Equal", [amax.outputs[0], zero.outputs[0]])
        inv = ir.node("Where", [is0.outputs[0], zero.outputs[0], div.outputs[0]])
        mul = ir.node("Mul", [new, inv.outputs[0]])
        rnd = ir.node("Round", [mul.outputs[0]])  # half to even
        scale = ir.node("Div", [amax.outputs[0], n127.outputs[0]])
        deq = ir.node("Mul", [rnd.outputs[0], scale.outputs[0]])
        m.graph.insert_before(node, [n127, axes, absn, amax, div, zero, is0, inv, mul, rnd, scale, deq])
        node.replace_input_with(1, deq.outputs[0])
    return ir.serde.serialize_model(m)
