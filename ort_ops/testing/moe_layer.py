# SPDX-License-Identifier: MIT
"""Test and benchmark helpers: a float MoE layer in numpy (random weights, router, the float64
yardstick), and the same layer as the INT8 op chain run through the references (what the
native chain must equal) or built as one ONNX model. What the rewrite needs lives in the op
layer: ``ort_ops.ops._quant.quantize_expert_weights`` and ``ort_ops.ops._moe.moe_experts_float``.

Alphabet: T tokens, H hidden size, I intermediate size per expert, E experts, K top-k.

Float layer (SwiGLU experts, the Mixtral / Qwen-MoE / DeepSeek form; gpt-oss with biases and
``activation="swiglu_oai"``):

    probs_TE      = softmax(x_TH @ router_HE)                      float32
    topk_ids_TK   = the K largest probabilities per token (ties: lower expert id first)
    topk_w_TK     = those probabilities, divided by their sum when ``renormalize``
    expert e:       c = x @ w_gate_up[e] (+ gate_up_bias[e]);  A, G = c[:, :I], c[:, I:]
                    "swiglu":     h = silu(A) * G
                    "swiglu_oai": a = min(A, limit), g = clip(G, -limit, limit),
                                  h = (g + 1) * a * sigmoid(alpha * a)       (gpt-oss)
                    y = h @ w_down[e] (+ down_bias[e])
    out_TH        = sum_j topk_w[t, j] * expert_{topk_ids[t, j]}(x[t])  (+ shared expert(x) if given)

Weights: w_gate_up [E, H, 2I] (columns [0, I) the gate that goes through silu, [I, 2I) the up
projection), w_down [E, I, H]; the optional shared expert has w_gate_up [1, H, 2I'] and
w_down [1, I', H] and is added to every token. Optional biases gate_up_bias [E, 2I] and
down_bias [E, H] (gpt-oss's gate_up_proj_bias / down_proj_bias, gate/up columns de-interleaved
like the weights) go to GroupedMatmulSwigluQuant's and GroupedMatmulDequant's bias input.

INT8 chain (DESIGN.md "MoE"); the router stays float, so the chain's error is the experts' only:

    MoeInitRouting(x, topk_ids)            -> sorted_x [T*K, H], sorted_to_flat, group_list
    DynamicQuant(sorted_x)                 -> xq, x_scale             per row
    GroupedMatmulSwigluQuant(xq, Wq_gu, s_gu, x_scale, group_list) -> hq, h_scale
    GroupedMatmulDequant(hq, Wq_d, s_d, h_scale, group_list)       -> expert_out float32
    shared expert: DynamicQuant(x) -> GroupedMatmulSwigluQuant (E=1) -> GroupedMatmulDequant
    MoeFinalizeRouting(expert_out, sorted_to_flat, topk_w, residual=shared) -> out float32

Weights are quantized offline per output channel, the contract's rule over K:
``weight_scale[e, n] = max_k |W[e, k, n]| / 127`` (``quantize_expert_weights``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ort_ops.ops import (
    dynamic_quant,
    grouped_matmul_dequant,
    grouped_matmul_swiglu_quant,
    moe_finalize_routing,
    moe_init_routing,
)
from ort_ops.ops._moe import OAI_ALPHA, OAI_LIMIT, activation_float, moe_experts_float
from ort_ops.ops._quant import quantize_expert_weights, quantize_rows


@dataclasses.dataclass
class MoeWeights:
    """Float weights of one MoE layer (shapes in the module docstring)."""

    router: np.ndarray                        # [H, E]
    w_gate_up: np.ndarray                     # [E, H, 2I]
    w_down: np.ndarray                        # [E, I, H]
    shared_gate_up: np.ndarray | None = None  # [1, H, 2I']
    shared_down: np.ndarray | None = None     # [1, I', H]
    gate_up_bias: np.ndarray | None = None    # [E, 2I]
    down_bias: np.ndarray | None = None       # [E, H]

    @property
    def num_experts(self) -> int:
        return self.w_gate_up.shape[0]


@dataclasses.dataclass
class QuantizedMoeWeights:
    """INT8 expert weights with per-output-channel float32 scales."""

    gate_up: np.ndarray        # int8 [E, H, 2I]
    gate_up_scale: np.ndarray  # float32 [E, 2I]
    down: np.ndarray           # int8 [E, I, H]
    down_scale: np.ndarray     # float32 [E, H]
    shared_gate_up: np.ndarray | None = None
    shared_gate_up_scale: np.ndarray | None = None
    shared_down: np.ndarray | None = None
    shared_down_scale: np.ndarray | None = None
    gate_up_bias: np.ndarray | None = None  # float32 [E, 2I], not quantized
    down_bias: np.ndarray | None = None     # float32 [E, H]


def random_moe_weights(rng: np.random.Generator, hidden: int, inter: int, num_experts: int,
                       shared_inter: int = 0) -> MoeWeights:
    """Gaussian weights scaled 1/sqrt(fan_in), so activations keep unit size through the layer."""
    def g(*shape, fan_in):
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    w = MoeWeights(router=g(hidden, num_experts, fan_in=hidden),
                   w_gate_up=g(num_experts, hidden, 2 * inter, fan_in=hidden),
                   w_down=g(num_experts, inter, hidden, fan_in=inter))
    if shared_inter:
        w.shared_gate_up = g(1, hidden, 2 * shared_inter, fan_in=hidden)
        w.shared_down = g(1, shared_inter, hidden, fan_in=shared_inter)
    return w


def quantize_moe_weights(w: MoeWeights) -> QuantizedMoeWeights:
    q = QuantizedMoeWeights(*quantize_expert_weights(w.w_gate_up), *quantize_expert_weights(w.w_down))
    if w.shared_gate_up is not None:
        q.shared_gate_up, q.shared_gate_up_scale = quantize_expert_weights(w.shared_gate_up)
        q.shared_down, q.shared_down_scale = quantize_expert_weights(w.shared_down)
    if w.gate_up_bias is not None:
        q.gate_up_bias = np.asarray(w.gate_up_bias, np.float32)
    if w.down_bias is not None:
        q.down_bias = np.asarray(w.down_bias, np.float32)
    return q


def route(x: np.ndarray, router: np.ndarray, top_k: int, renormalize: bool = True):
    """Router softmax and top-k: x [T, H], router [H, E] -> (topk_ids int32 [T, K], topk_w float32 [T, K])."""
    logits = np.asarray(x, np.float32) @ np.asarray(router, np.float32)
    logits = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p = (p / p.sum(axis=-1, keepdims=True)).astype(np.float32)
    # Stable sort on -p: equal probabilities keep the lower expert id first.
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    wts = np.take_along_axis(p, ids, axis=-1)
    if renormalize:
        wts = wts / wts.sum(axis=-1, keepdims=True)
    return ids, wts.astype(np.float32)


def _expert_float(x, w_gate_up, w_down):
    """A plain SwiGLU expert (the shared one) in x's float type."""
    return activation_float(x @ w_gate_up) @ w_down


def _bias64(b, e):
    return None if b is None else np.asarray(b[e], np.float64)


def moe_layer_float(x: np.ndarray, w: MoeWeights, top_k: int, renormalize: bool = True,
                    routing: tuple[np.ndarray, np.ndarray] | None = None, activation: str = "swiglu",
                    alpha: float = OAI_ALPHA, limit: float = OAI_LIMIT) -> np.ndarray:
    """The float MoE layer (float64 arithmetic: the accuracy yardstick). x [T, H] -> [T, H] float32.

    ``routing`` (topk_ids, topk_w) overrides the router so both layers use the same choice.
    ``activation`` ("swiglu" or "swiglu_oai" with ``alpha``, ``limit``) and the weights' optional
    biases apply to the routed experts; the shared expert, if any, is a plain SwiGLU one.
    """
    x64 = np.asarray(x, np.float64)
    ids, wts = routing if routing is not None else route(x, w.router, top_k, renormalize)
    out = moe_experts_float(x64, ids, wts, w.w_gate_up, w.w_down, w.gate_up_bias, w.down_bias, activation,
                            alpha, limit)
    if w.shared_gate_up is not None:
        out += _expert_float(x64, w.shared_gate_up[0].astype(np.float64), w.shared_down[0].astype(np.float64))
    return out.astype(np.float32)


def shared_expert_int8(x: np.ndarray, q: QuantizedMoeWeights) -> np.ndarray:
    """The shared expert as the INT8 chain with one expert holding every row: [T, H] -> float32 [T, H]."""
    xq, xs = dynamic_quant.reference(x)
    gl = np.array([x.shape[0]], np.int64)
    hq, hs, _ = grouped_matmul_swiglu_quant.reference(xq, q.shared_gate_up, q.shared_gate_up_scale, xs, gl)
    return grouped_matmul_dequant.reference(hq, q.shared_down, q.shared_down_scale, hs, gl)


def moe_layer_int8_reference(x: np.ndarray, q: QuantizedMoeWeights, topk_ids: np.ndarray,
                             topk_w: np.ndarray, activation: str = "swiglu", alpha: float = OAI_ALPHA,
                             limit: float = OAI_LIMIT) -> np.ndarray:
    """The INT8 op chain (module docstring) through the numpy references: x [T, H] -> float32 [T, H].
    The routed experts take q's biases and ``activation``; the shared expert is plain SwiGLU."""
    x = np.asarray(x, np.float32)
    e = q.gate_up.shape[0]
    sorted_x, s2f, gl = moe_init_routing.reference(x, np.asarray(topk_ids, np.int32), num_experts=e)
    xq, xs = dynamic_quant.reference(sorted_x)
    hq, hs, _ = grouped_matmul_swiglu_quant.reference(xq, q.gate_up, q.gate_up_scale, xs, gl, q.gate_up_bias,
                                                      activation=activation, alpha=alpha, limit=limit)
    expert_out = grouped_matmul_dequant.reference(hq, q.down, q.down_scale, hs, gl, q.down_bias)
    residual = shared_expert_int8(x, q) if q.shared_gate_up is not None else None
    return moe_finalize_routing.reference(expert_out, s2f, topk_w, residual)


QUANT_STEPS = ("x", "gate_up", "h", "down")


def moe_layer_w8a8(x: np.ndarray, w: MoeWeights, routing: tuple[np.ndarray, np.ndarray],
                   quant: tuple[str, ...] = QUANT_STEPS, activation: str = "swiglu", alpha: float = OAI_ALPHA,
                   limit: float = OAI_LIMIT) -> np.ndarray:
    """The chain's W8A8 integer math in float64, each INT8 rounding switchable (the error budget).

    Quantizes by the contract's rule (``quantize_rows``: symmetric, scale = amax / 127, codes
    rint(v * 127 / amax)), then computes in float64, which is exact for the integer products:
      "x"       each routed token's input x [H], per token (DynamicQuant);
      "gate_up" w_gate_up per output channel over H (offline, ``quantize_expert_weights``);
      "h"       the SwiGLU output h [I] per row (GroupedMatmulSwigluQuant's y), the down
                projection's activation;
      "down"    w_down per output channel over I.
    Everything else (matmuls, dequantization, SiLU, the weighted sum) is float64. With every step
    on this is the plain W8A8 layer (per-token symmetric int8 activations, per-channel int8
    weights, integer matmuls, float SwiGLU): the INT8 chain computes the same codes and differs
    only by its float32 dequantization and SwiGLU. With none it is ``moe_layer_float``.
    Biases (float64, not quantized) and ``activation`` as ``moe_layer_float``'s.
    """
    unknown = set(quant) - set(QUANT_STEPS)
    if unknown:
        raise ValueError(f"moe_layer_w8a8: unknown quantization step(s) {sorted(unknown)}, expected {QUANT_STEPS}")

    def rows(a):  # per-row INT8 round trip, float64
        q, s = quantize_rows(np.asarray(a, np.float32), axis=-1)
        return q.astype(np.float64) * s.astype(np.float64)[..., None]

    def weights(a, on):  # one expert's [K, N]: per-output-channel (over K) INT8 round trip, float64
        if not on:
            return np.asarray(a, np.float64)
        q, s = quantize_expert_weights(a[None])
        return q[0].astype(np.float64) * s.astype(np.float64)

    x = np.asarray(x, np.float32)
    xin = rows(x) if "x" in quant else x.astype(np.float64)

    def expert(xe, gu, dn, bgu, bd, act):
        c = xe @ gu
        if bgu is not None:
            c = c + bgu
        h = activation_float(c, act, alpha, limit)
        y = (rows(h) if "h" in quant else h) @ dn
        return y + bd if bd is not None else y

    def run(xe, gate_up, down, bgu=None, bd=None, act="swiglu"):
        return expert(xe, weights(gate_up, "gate_up" in quant), weights(down, "down" in quant), bgu, bd, act)

    ids, wts = routing
    out = np.zeros(x.shape, np.float64)
    for e in range(w.num_experts):
        t, j = np.nonzero(ids == e)
        if t.size:
            y = run(xin[t], w.w_gate_up[e], w.w_down[e], _bias64(w.gate_up_bias, e), _bias64(w.down_bias, e),
                    activation)
            np.add.at(out, t, wts[t, j, None].astype(np.float64) * y)
    if w.shared_gate_up is not None:
        out += run(xin, w.shared_gate_up[0], w.shared_down[0])
    return out.astype(np.float32)


def relative_l2(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want||_2 / ||want||_2 over the whole tensor (float64)."""
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300))


def build_moe_int8_model(q: QuantizedMoeWeights, top_k: int, renormalize: bool = True,
                         router_in_graph: bool = True, opset_imports=None, activation: str = "swiglu",
                         alpha: float = OAI_ALPHA, limit: float = OAI_LIMIT):
    """The INT8 chain as one ONNX model, the expert weights as initializers.

    ``router_in_graph``: inputs ``x`` [T, H] float32 and ``router_logits`` [T, E] float32; the
    model runs Softmax, TopK (ties: lower expert id first), the optional renormalization and a
    Cast of the ids to int32 before the chain (com.microsoft.MoE's interface). Otherwise the
    inputs are ``x``, ``topk_ids`` int32 [T, K] and ``topk_weights`` float32 [T, K].
    Output ``out`` float32 [T, H]. T is symbolic. q's biases and ``activation`` (with alpha,
    limit) go to the routed experts' GroupedMatmulSwigluQuant / GroupedMatmulDequant.
    """
    from onnx import TensorProto, helper, numpy_helper

    from ort_ops._domain import DOMAIN, OPSET_VERSION
    from ort_ops.ops._schema import IR_VERSION, ONNX_OPSET

    e, h, _ = q.gate_up.shape
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (q.gate_up, "w_gate_up"), (q.gate_up_scale, "w_gate_up_scale"),
        (q.down, "w_down"), (q.down_scale, "w_down_scale")]]
    nodes = []
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h])]
    if router_in_graph:
        inputs.append(helper.make_tensor_value_info("router_logits", TensorProto.FLOAT, ["T", e]))
        inits.append(numpy_helper.from_array(np.array([top_k], np.int64), "k"))
        nodes += [helper.make_node("Softmax", ["router_logits"], ["probs"], axis=-1),
                  helper.make_node("TopK", ["probs", "k"], ["topk_p", "topk_i64"], axis=-1)]
        if renormalize:
            inits.append(numpy_helper.from_array(np.array([-1], np.int64), "last_axis"))
            nodes += [helper.make_node("ReduceSum", ["topk_p", "last_axis"], ["topk_sum"], keepdims=1),
                      helper.make_node("Div", ["topk_p", "topk_sum"], ["topk_weights"])]
        else:
            nodes.append(helper.make_node("Identity", ["topk_p"], ["topk_weights"]))
        nodes.append(helper.make_node("Cast", ["topk_i64"], ["topk_ids"], to=TensorProto.INT32))
    else:
        inputs += [helper.make_tensor_value_info("topk_ids", TensorProto.INT32, ["T", top_k]),
                   helper.make_tensor_value_info("topk_weights", TensorProto.FLOAT, ["T", top_k])]
    d = {"domain": DOMAIN}
    gu_in = ["xq", "w_gate_up", "w_gate_up_scale", "x_scale", "group_list"]
    dn_in = ["hq", "w_down", "w_down_scale", "h_scale", "group_list"]
    if q.gate_up_bias is not None:
        inits.append(numpy_helper.from_array(np.asarray(q.gate_up_bias, np.float32), "w_gate_up_bias"))
        gu_in.append("w_gate_up_bias")
    if q.down_bias is not None:
        inits.append(numpy_helper.from_array(np.asarray(q.down_bias, np.float32), "w_down_bias"))
        dn_in.append("w_down_bias")
    act = {} if activation == "swiglu" else {"activation": activation, "alpha": float(alpha), "limit": float(limit)}
    nodes += [
        helper.make_node("DynamicQuant", ["x"], ["tq", "t_scale"], **d),
        helper.make_node("MoeInitRouting", ["tq", "topk_ids", "t_scale"],
                         ["xq", "sorted_to_flat", "group_list", "x_scale"], num_experts=e, **d),
        helper.make_node("GroupedMatmulSwigluQuant", gu_in, ["hq", "h_scale", "h_offset"], **act, **d),
        helper.make_node("GroupedMatmulDequant", dn_in, ["expert_out"], **d),
    ]
    fin_inputs = ["expert_out", "sorted_to_flat", "topk_weights"]
    if q.shared_gate_up is not None:
        inits += [numpy_helper.from_array(a, n) for a, n in [
            (q.shared_gate_up, "s_gate_up"), (q.shared_gate_up_scale, "s_gate_up_scale"),
            (q.shared_down, "s_down"), (q.shared_down_scale, "s_down_scale")]]
        nodes += [
            # The shared expert is a one-expert group holding every token: group_list = [T].
            helper.make_node("Shape", ["x"], ["s_group_list"], start=0, end=1),
            helper.make_node("DynamicQuant", ["x"], ["s_xq", "s_x_scale"], **d),
            helper.make_node("GroupedMatmulSwigluQuant", ["s_xq", "s_gate_up", "s_gate_up_scale", "s_x_scale",
                                                         "s_group_list"], ["s_hq", "s_h_scale", "s_h_offset"], **d),
            helper.make_node("GroupedMatmulDequant", ["s_hq", "s_down", "s_down_scale", "s_h_scale", "s_group_list"],
                             ["shared_out"], **d),
        ]
        fin_inputs.append("shared_out")
    nodes.append(helper.make_node("MoeFinalizeRouting", fin_inputs, ["out"], **d))
    graph = helper.make_graph(nodes, "moe_int8", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", h])], inits)
    return helper.make_model(graph, ir_version=IR_VERSION,
                             opset_imports=opset_imports or [helper.make_opsetid("", ONNX_OPSET),
                                                             helper.make_opsetid(DOMAIN, OPSET_VERSION)])
