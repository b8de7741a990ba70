# SPDX-License-Identifier: MIT
"""Hand-built *unfused* MoE blocks for the rewrite's tests (not shipped).

Alphabet: T tokens (symbolic), H hidden, I intermediate per expert, E experts, K top-k.

``build_moe(w, k, ...)`` returns a float32 ModelProto ``x [T, H] -> y [T, H]`` computing the
float MoE of ``ort_ops.testing.moe_layer`` (weights ``MoeWeights``: router [H, E], w_gate_up
[E, H, 2I] gate first, w_down [E, I, H]) in the form optimum's exporter writes for Qwen3-MoE
(optimum-onnx cannot run beside transformers 5.x here, see graphs/export_moe_fixtures.py):
unrolled over every expert, ``Gather`` of the expert's one-hot mask row, ``NonZero``, ``Gather``
of its tokens, three MatMuls (gate, up, down: separate per-expert initializers), the routing
weight, ``ScatterElements(reduction="add")`` + ``Add`` into the output.

Variants, for the rewrite's positive and negative cases:
  routing     "softmax_topk_renorm" (Mixtral / Qwen3), "softmax_topk" (Qwen2 norm_topk_prob
              False), "topk_softmax" (softmax over the K logits), "topk_raw" (no softmax at all:
              the rewrite must decline)
  activation  "silu" (SiLU-gated) or "gelu" (Gelu-gated: must decline)
  const_weights  False makes expert 0's gate weight a graph input (must decline)
  experts_computed  unroll only the first n experts, like a trace specialized to its example
              input (must decline)
  shared      "none", "plain" (a shared SwiGLU expert added to the routed output, DeepSeek) or
              "gated" (times Sigmoid(x @ shared_gate [H, 1]), Qwen2-MoE)

``build_contrib_moe(w, k, normalize, ...)`` returns ``(x [T, H], router_logits [T, E]) -> y`` as
one ``com.microsoft`` ``MoE`` or ``QMoE`` node (weights [E, out, in], ORT >= 1.22 layout).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ort_ops.ops._schema import IR_VERSION, ONNX_OPSET


def build_moe(w, k: int, *, routing: str = "softmax_topk_renorm", activation: str = "silu",
              const_weights: bool = True, experts_computed: int | None = None,
              shared: str = "none", shared_gate=None) -> onnx.ModelProto:
    e, h, i2 = w.w_gate_up.shape
    inter = i2 // 2
    inits, nodes = [], []
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h])]

    def const(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def node(op, ins, outs, **attrs):
        nodes.append(helper.make_node(op, ins, outs, name=outs[0], **attrs))
        return outs[0] if len(outs) == 1 else outs

    # Router: logits = x @ W_router (a Gemm with transB, as torch's Linear exports).
    node("Gemm", ["x", const("router.weight", w.router.T.copy())], ["router_logits"], transB=1)
    kk = const("k", np.array([k], np.int64))
    last = const("last_axis", np.array([-1], np.int64))
    if routing.startswith("softmax"):
        node("Softmax", ["router_logits"], ["router_probs"], axis=-1)
        node("TopK", ["router_probs", kk], ["topk_vals", "topk_ids"], axis=-1)
        weights = "topk_vals"
        if routing == "softmax_topk_renorm":
            node("ReduceSum", ["topk_vals", last], ["topk_sum"], keepdims=1)
            weights = node("Div", ["topk_vals", "topk_sum"], ["topk_weights"])
    else:
        node("TopK", ["router_logits", kk], ["topk_vals", "topk_ids"], axis=-1)
        weights = node("Softmax", ["topk_vals"], ["topk_weights"], axis=-1) if routing == "topk_softmax" \
            else "topk_vals"
    # expert_mask [E, K, T] = one_hot(topk_ids, E).permute(2, 1, 0)
    node("OneHot", ["topk_ids", const("depth", np.array(e, np.int64)), const("onehot_values", np.array([0, 1], np.int64))],
         ["one_hot"], axis=-1)
    node("Transpose", ["one_hot"], ["expert_mask"], perm=[2, 1, 0])
    node("Reshape", [weights, const("flat", np.array([-1], np.int64))], ["weights_flat"])
    kc = const("k_scalar", np.array(k, np.int64))
    zero = const("zero", np.array(0.0, np.float32))
    acc = node("Mul", ["x", zero], ["acc_init"])
    for ex in range(experts_computed if experts_computed is not None else e):
        p = f"expert{ex}"
        node("Gather", ["expert_mask", const(f"{p}.index", np.array(ex, np.int64))], [f"{p}.mask"], axis=0)
        node("NonZero", [f"{p}.mask"], [f"{p}.nz"])
        node("Gather", [f"{p}.nz", const(f"{p}.row0", np.array(0, np.int64))], [f"{p}.slot"], axis=0)
        node("Gather", [f"{p}.nz", const(f"{p}.row1", np.array(1, np.int64))], [f"{p}.tok"], axis=0)
        node("Gather", ["x", f"{p}.tok"], [f"{p}.x"], axis=0)
        gate_w = f"{p}.gate_proj.weight"
        if const_weights or ex != 0:
            const(gate_w, w.w_gate_up[ex][:, :inter].copy())
        else:
            inputs.append(helper.make_tensor_value_info(gate_w, TensorProto.FLOAT, [h, inter]))
        node("MatMul", [f"{p}.x", gate_w], [f"{p}.gate"])
        node("MatMul", [f"{p}.x", const(f"{p}.up_proj.weight", w.w_gate_up[ex][:, inter:].copy())], [f"{p}.up"])
        if activation == "silu":
            node("Sigmoid", [f"{p}.gate"], [f"{p}.sig"])
            node("Mul", [f"{p}.gate", f"{p}.sig"], [f"{p}.act"])
        else:
            node("Gelu", [f"{p}.gate"], [f"{p}.act"])
        node("Mul", [f"{p}.act", f"{p}.up"], [f"{p}.h"])
        node("MatMul", [f"{p}.h", const(f"{p}.down_proj.weight", w.w_down[ex].copy())], [f"{p}.y"])
        # routing weight of (token, slot): weights_flat[tok * K + slot]
        node("Mul", [f"{p}.tok", kc], [f"{p}.tk"])
        node("Add", [f"{p}.tk", f"{p}.slot"], [f"{p}.flat"])
        node("Gather", ["weights_flat", f"{p}.flat"], [f"{p}.w"], axis=0)
        node("Unsqueeze", [f"{p}.w", const(f"{p}.ax1", np.array([1], np.int64))], [f"{p}.w2"])
        node("Mul", [f"{p}.y", f"{p}.w2"], [f"{p}.yw"])
        # index_add_(0, tok, yw): ScatterElements(zeros, tok expanded to [n, H], yw, add)
        node("Unsqueeze", [f"{p}.tok", f"{p}.ax1"], [f"{p}.tok2"])
        node("Shape", [f"{p}.yw"], [f"{p}.shape"])
        node("Expand", [f"{p}.tok2", f"{p}.shape"], [f"{p}.idx"])
        node("ScatterElements", ["acc_init", f"{p}.idx", f"{p}.yw"], [f"{p}.scatter"], axis=0, reduction="add")
        acc = node("Add", [acc, f"{p}.scatter"], [f"{p}.acc"])
    if shared != "none":
        # shared expert (w.shared_gate_up [1, H, 2I'], w.shared_down [1, I', H]) as a dense MLP,
        # "plain": added to the routed output (DeepSeek), "gated": times Sigmoid(x @ shared_gate
        # [H, 1]) first (Qwen2-MoE)
        si = w.shared_gate_up.shape[2] // 2
        node("MatMul", ["x", const("shared.gate_proj.weight", w.shared_gate_up[0][:, :si].copy())], ["shared.gate"])
        node("Sigmoid", ["shared.gate"], ["shared.sig"])
        node("Mul", ["shared.gate", "shared.sig"], ["shared.act"])
        node("MatMul", ["x", const("shared.up_proj.weight", w.shared_gate_up[0][:, si:].copy())], ["shared.up"])
        node("Mul", ["shared.act", "shared.up"], ["shared.h"])
        mlp = node("MatMul", ["shared.h", const("shared.down_proj.weight", w.shared_down[0].copy())], ["shared.y"])
        if shared == "gated":
            node("Gemm", ["x", const("shared_expert_gate.weight", np.asarray(shared_gate, np.float32).T.copy())],
                 ["shared.g"], transB=1)
            node("Sigmoid", ["shared.g"], ["shared.gs"])
            mlp = node("Mul", ["shared.gs", mlp], ["shared.gated"])
        acc = node("Add", [acc, mlp], ["with_shared"])
    node("Identity", [acc], ["y"])
    graph = helper.make_graph(nodes, "moe_unrolled", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])], inits)
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])


def _qmoe_codes(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """ORT QMoE's symmetric per-output-channel rule for W [E, out, in]: uint8 codes with zero point
    128 (8 bits) or 8 (4 bits, two per byte, even element in the low nibble) and scales [E, out]."""
    qmax = 127 if bits == 8 else 7
    scale = (np.abs(w).max(axis=2) / qmax).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, :, None]), -qmax - 1, qmax).astype(np.int32) + (qmax + 1)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q.astype(np.uint8), scale


def build_contrib_moe(w, k: int, normalize: bool = True, with_bias: bool = False, *, op: str = "MoE",
                      layout: str = "fc3", bits: int = 8) -> onnx.ModelProto:
    """One com.microsoft MoE / QMoE node. ``layout`` "fc3": activation silu, gate in fc1 and up
    in fc3 (what transformers' fusion writes; ORT CPU refuses it); "swiglu": activation swiglu
    with interleaved fc1 (swiglu_fusion=1, gate rows even, up rows odd; ORT CPU runs it).
    ``op`` "QMoE" stores the weights as ``bits``-bit codes (``_qmoe_codes``)."""
    e, h, i2 = w.w_gate_up.shape
    inter = i2 // 2
    gate = w.w_gate_up[:, :, :inter].transpose(0, 2, 1)   # [E, I, H]
    up = w.w_gate_up[:, :, inter:].transpose(0, 2, 1)     # [E, I, H]
    down = w.w_down.transpose(0, 2, 1).copy()             # [E, H, I]
    if layout == "fc3":
        mats = {"fc1": gate.copy(), "fc2": down, "fc3": up.copy()}
        attrs = {"activation_type": "silu"}
    else:
        fc1 = np.empty((e, 2 * inter, h), np.float32)
        fc1[:, 0::2], fc1[:, 1::2] = gate, up
        mats = {"fc1": fc1, "fc2": down}
        attrs = {"activation_type": "swiglu", "swiglu_fusion": 1}
    inits, slots = [], {}
    for name, m in mats.items():
        if op == "QMoE":
            q, s = _qmoe_codes(m, bits)
            inits += [numpy_helper.from_array(q, name), numpy_helper.from_array(s, f"{name}_scales")]
            slots[name] = [name, f"{name}_scales"]
        else:
            inits.append(numpy_helper.from_array(m.astype(np.float32), name))
            slots[name] = [name]
    bias = ""
    if with_bias:
        inits.append(numpy_helper.from_array(np.zeros((e, mats["fc1"].shape[1]), np.float32), "fc1_bias"))
        bias = "fc1_bias"
    ins = ["x", "router_logits", *slots["fc1"], bias, *slots["fc2"], ""]
    if "fc3" in slots:
        ins += slots["fc3"]
    if op == "QMoE":
        attrs["expert_weight_bits"] = bits
    node = helper.make_node(op, ins, ["y"], name="moe", domain="com.microsoft", k=k,
                            normalize_routing_weights=int(normalize), **attrs)
    graph = helper.make_graph(
        [node], "contrib_moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h]),
         helper.make_tensor_value_info("router_logits", TensorProto.FLOAT, ["T", e])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])], inits)
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid("com.microsoft", 1)])
