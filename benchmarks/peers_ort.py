# SPDX-License-Identifier: MIT
"""ONNX Runtime's own INT8 MoE option as the real op in a whole exported model (issue 21's peers).

    rewrite_to_qmoe("moe.onnx", "moe.qmoe8.onnx", bits=8)      # -> report {"blocks": [...], "declined": [...]}

Every MoE block that ort-ops' MoE rewrite proves (``ort_ops.rewrite.moe``: its candidates, probe
and weight reading, imported, not copied) becomes one ``com.microsoft`` ``QMoE`` node instead of
the ort-ops INT8 chain, so the evaluation compares against what a user of stock onnxruntime gets.

Alphabet: T tokens, H hidden, I intermediate per expert, E experts, K top-k.

The node, in the layout ORT 1.32's QMoE schema documents and its CPU EP runs (checked on single
nodes against the float MoE of the dequantized weights, ``tests/test_eval_peers.py``):

  QMoE(x [T, H], router_logits [T, E], fc1 uint8 [E, 2I, H / pack], fc1_scales [E, 2I], "",
       fc2 uint8 [E, H, I / pack], fc2_scales [E, H], "", "" x 7, [router_weights [T, E]])
  activation_type "swiglu", swiglu_fusion 1 (fc1's rows interleaved: gate rows even, up rows odd),
  activation_alpha 1, activation_beta 0, no swiglu_limit: SiLU(gate) * up; expert_weight_bits 8
  or 4 (pack 1 or 2, even element in the low nibble); no block_size: one scale per output channel,
  symmetric, zero point 128 / 8 (``graphs/moe.py::_qmoe_codes``). Activations stay float32, or
  with ``activations="float16"`` the node runs on float16 (Casts of x, the logits and
  router_weights in front, of the output back to float32; scales stored float16), the type
  ORT's CUDA QMoE kernel is registered for in some onnxruntime-gpu versions.

Routing: QMoE takes the router *logits* and applies softmax and top-k itself. The block's routing
as the MoE rewrite read it maps onto the node as

  softmax -> topk -> renormalize      normalize_routing_weights 1 (Mixtral, Qwen3-MoE)
  topk -> softmax over the k          the same thing (softmax of the k logits = renormalized
                                      softmax over the k), normalize_routing_weights 1 (gpt-oss)
  softmax -> topk                     router_weights = the graph's own softmax [T, E],
                                      normalize_routing_weights 0 (Qwen2-MoE's norm_topk_prob
                                      False). ORT 1.32's CPU QMoE renormalizes the top-k weights
                                      whenever router_weights is absent, whatever
                                      normalize_routing_weights says; with router_weights and 0 it
                                      mixes by the gathered values as they are.

anything else (sigmoid routers, scaled weights) is declined with the routing named. Expert biases
and gpt-oss's clamped SwiGLU are declined too (the node has inputs and attributes for them, but
their layout against ORT's kernels is not verified here). A shared expert stays float: the
graph's own MLP keeps reading the hidden state and adding to the replaced routed output.

Probes: the MoE rewrite proves a block on random token ids and declines it when an expert is never
selected. ``probe_ids`` adds a probe run on real text (e.g. training tokens): the same proof, with
inputs that reach experts a trained router picks on text but not on random ids. An expert the
router never picks stays unproven and its block declined (the tiny moe_shared model's layer 1,
expert 5: not selected on 4096 training tokens either).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QMOE_BITS = (8, 4)
# The routings a QMoE node reproduces, as ort_ops.rewrite.moe names them: -> (normalize_routing_weights,
# whether the graph's softmax goes in as router_weights).
QMOE_ROUTING = {
    "softmax -> topk -> renormalize": (1, False),
    "topk -> softmax over the k": (1, False),
    "softmax -> topk": (0, True),
}


def _router_logits(cand):
    """The router's logits [T, E] (the value QMoE's router_probs input takes) and, for a softmax
    router, the graph's softmax of them; or a reason string."""
    from ort_ops.rewrite import moe

    src = moe._through_casts(cand.topk.inputs[0].producer())
    probs = None
    if src is not None and src.op_type == "Softmax":
        probs = cand.topk.inputs[0]
        src = moe._through_casts(src.inputs[0].producer())
    if src is None or src.op_type not in ("MatMul", "Gemm", "Add"):
        return None, None, "the router's logits are not a projection's output"
    return src.outputs[0], probs, None


def _fc_weights(block, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(fc1 codes [E, 2I, H / pack], fc1 scales [E, 2I], fc2 codes [E, H, I / pack], fc2 scales
    [E, H]) of the block's float weights (x @ W orientation: gate/up [E, H, I], down [E, I, H])."""
    from graphs.moe import _qmoe_codes

    w = block.w
    e, h, inter = w.w_gate.shape
    fc1 = np.empty((e, 2 * inter, h), np.float32)
    fc1[:, 0::2] = w.w_gate.transpose(0, 2, 1)        # gate rows even,
    fc1[:, 1::2] = w.w_up.transpose(0, 2, 1)          # up rows odd (swiglu_fusion 1)
    q1, s1 = _qmoe_codes(fc1, bits)
    q2, s2 = _qmoe_codes(np.ascontiguousarray(w.w_down.transpose(0, 2, 1), np.float32), bits)
    return q1, s1, q2, s2


def _emit_qmoe(model, block, bits: int, logits, probs, normalize: int,
               activations: str = "float32") -> tuple[int, str]:
    """Inserts the QMoE node (and a Reshape back to the hidden state's shape when the block's output
    had it) and redirects the block output's users to it. ``activations`` "float16" puts Casts of
    x, the logits and router_weights to float16 in front, stores the scales in float16 (the node's
    T2 as its T) and Casts the output back to float32. Returns (bytes of codes and scales, name)."""
    import onnx_ir as ir

    from ort_ops.rewrite import _graph as g
    from ort_ops.rewrite import moe

    graph = model.graph
    cand = block.cand
    prefix = f"qmoe{bits}{'_fp16' if activations == 'float16' else ''}/{cand.topk.name or 'block'}"
    q1, s1, q2, s2 = _fc_weights(block, bits)
    if activations == "float16":
        s1, s2 = s1.astype(np.float16), s2.astype(np.float16)
    inits = [g.initializer(graph, f"{prefix}/{n}", a)
             for n, a in (("fc1", q1), ("fc1_scales", s1), ("fc2", q2), ("fc2_scales", s2))]
    nodes = []

    def cast(v, to, tag):
        n = ir.node("Cast", [v], {"to": int(to)}, name=f"{prefix}/Cast_{tag}")
        n.outputs[0].name = f"{prefix}/Cast_{tag}_0"
        nodes.append(n)
        return n.outputs[0]

    x = cand.x
    if activations == "float16":
        x, logits = cast(x, ir.DataType.FLOAT16, "x"), cast(logits, ir.DataType.FLOAT16, "logits")
        probs = None if probs is None else cast(probs, ir.DataType.FLOAT16, "router_weights")
    ins = [x, logits, inits[0], inits[1], None, inits[2], inits[3]]
    if probs is not None:
        ins += [None] * 7 + [probs]                      # router_weights is input 14
    node = ir.node("QMoE", ins, {"k": cand.k, "normalize_routing_weights": normalize,
                                 "activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0,
                                 "activation_beta": 0.0, "expert_weight_bits": bits},
                   domain="com.microsoft", name=f"{prefix}/QMoE")
    node.outputs[0].name = f"{prefix}/QMoE_0"
    nodes.append(node)
    out = node.outputs[0]
    if activations == "float16":
        out = cast(out, ir.DataType.FLOAT, "out")
    moe.splice_block(graph, block, prefix, nodes, out)
    return sum(a.nbytes for a in (q1, s1, q2, s2)), node.name


def rewrite_to_qmoe(src, dst, bits: int = 8, *, probe_ids: np.ndarray | None = None,
                    activations: str = "float32") -> dict:
    """Writes ``src`` (an exported float32 model) to ``dst`` with every MoE block the MoE rewrite
    proves replaced by a ``com.microsoft`` ``QMoE`` node of ``bits``-bit expert weights, on float32
    activations or, with ``activations="float16"``, on float16 ones (Casts around the node: the
    type ORT's CUDA QMoE kernels are registered for in some versions).

    Returns {"blocks": [{where, experts, top_k, routing, normalize_routing_weights,
    router_weights, weight_bytes_before, weight_bytes_after}], "declined": [{where, reason}]};
    ``dst`` is written only when at least one block was replaced.
    """
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from ort_ops.rewrite import moe
    from ort_ops.rewrite._graph import has_bfloat16

    if bits not in QMOE_BITS:
        raise ValueError(f"rewrite_to_qmoe: bits must be one of {QMOE_BITS}, got {bits}")
    if activations not in ("float32", "float16"):
        raise ValueError(f"rewrite_to_qmoe: activations must be float32 or float16, got {activations!r}")
    src = Path(src)
    if not src.is_file():
        raise FileNotFoundError(f"rewrite_to_qmoe: model '{src}' does not exist")
    model = ir.load(str(src))
    report = {"blocks": [], "declined": []}
    if has_bfloat16(model):
        report["declined"].append({"where": src.name, "reason": "bfloat16 model: QMoE here takes float32 "
                                   "activations only"})
        return report
    cands, declined = moe._candidates(model.graph)
    report["declined"] += [{"where": d.where, "reason": d.reason} for d in declined]
    # The probes fuse_moe proves blocks with, plus the text probe when given.
    probes = moe.probe_candidates(model, cands, probe_ids) if cands else []
    done = []
    for c in cands:
        hit = moe._hit(c, probes)
        try:
            if len(hit) < c.num_experts:
                raise moe._Declined(f"experts {sorted(set(range(c.num_experts)) - hit)} were never selected "
                                    "on probe inputs, so their weights cannot be verified")
            block = moe._analyze(model, c, probes)
            if probes[0][c.x.name].dtype != np.float32:
                raise moe._Declined(f"activations are {probes[0][c.x.name].dtype}; QMoE here takes float32")
            if c.routing not in QMOE_ROUTING:
                raise moe._Declined(f"routing '{c.routing}' is not one QMoE computes ({', '.join(QMOE_ROUTING)})")
            if block.act.name != "swiglu" or any(b is not None for b in (block.w.b_gate, block.w.b_up,
                                                                            block.w.b_down)):
                raise moe._Declined("expert biases or a clamped SwiGLU: QMoE's layout for them is not verified here")
            logits, probs, why = _router_logits(c)
            if why:
                raise moe._Declined(why)
        except moe._Declined as e:
            report["declined"].append({"where": c.topk.name, "reason": str(e)})
            continue
        done.append((block, logits, probs))
    for block, logits, probs in done:
        c = block.cand
        normalize, with_probs = QMOE_ROUTING[c.routing]
        nbytes, name = _emit_qmoe(model, block, bits, logits, probs if with_probs else None, normalize,
                                  activations)
        report["blocks"].append({
            "where": c.topk.name, "node": name, "experts": c.num_experts, "top_k": c.k, "routing": c.routing,
            "normalize_routing_weights": normalize, "router_weights": with_probs, "bits": bits,
            "activations": activations,
            "weight_bytes_before": sum(a.nbytes for a in (block.w.w_gate, block.w.w_up, block.w.w_down)),
            "weight_bytes_after": nbytes})
    if done:
        model.opset_imports.setdefault("com.microsoft", 1)
        RemoveUnusedNodesPass()(model)
        ir.save(model, str(dst))
    return report


def node_providers(model, op_type: str, providers, tokens: int = 8) -> list[str]:
    """The execution providers that ran each ``op_type`` node of ``model`` in one Run on a
    ``tokens``-token prompt with an empty cache (onnxruntime's profile says; a node the CUDA EP does
    not take falls back to the CPU EP without an error, and this is how a row tells)."""
    import onnx_ir as ir
    import onnxruntime as ort

    from ort_ops.rewrite._graph import synthetic_feeds

    feeds = synthetic_feeds(ir.load(str(model)).graph, tokens, np.random.default_rng(0))
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(model), so, providers=providers)
    sess.run(None, feeds)
    prof = Path(sess.end_profiling())
    try:
        events = json.loads(prof.read_text())
    finally:
        prof.unlink(missing_ok=True)
    seen = {}
    for ev in events:
        args = ev.get("args") or {}
        if ev.get("cat") == "Node" and args.get("op_name") == op_type and "provider" in args:
            seen[ev["name"].rsplit("_kernel_time", 1)[0]] = args["provider"]
    return [seen[k] for k in sorted(seen)]
