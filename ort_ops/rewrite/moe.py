# SPDX-License-Identifier: MIT
"""MoE fusion: mixture-of-experts blocks of exported models become the INT8 chain of DESIGN.md.

    x_TH, topk_ids_TK, topk_w_TK  (the graph's own router, kept as it is)
      -> Cast(ids, int32) -> DynamicQuant(x) -> MoeInitRouting(int8 rows + scales) -> GroupedMatmulSwigluQuant
      -> GroupedMatmulDequant -> MoeFinalizeRouting -> out_TH   (Reshape back to [B, S, H] if the
         block's output had that shape)

Alphabet: T tokens, H hidden size, I intermediate size per expert, E experts, K top-k,
B batch, S sequence.

Expert weights come from constant initializers and are quantized offline per output channel
(``ort_ops.ops._quant.quantize_expert_weights``): gate_up int8 [E, H, 2I] (columns [0, I)
the SiLU gate, [I, 2I) the up projection) with scales [E, 2I], down int8 [E, I, H] with scales
[E, H]. gpt-oss's interleaved gate/up columns (gate = [..., ::2], up = [..., 1::2]) are permuted
offline into that [gate | up] order, and so are its gate_up biases; expert biases go to the
GEMMs' bias inputs (float32 [E, 2I] and [E, H]) and its clamped SwiGLU to
GroupedMatmulSwigluQuant's ``activation="swiglu_oai"`` with the alpha and limit the graph holds.
With the option ``moe_weight_layout="ENK"`` (``ort-ops rewrite --moe-weight-layout ENK``)
gate_up is stored transposed, int8 [E, 2I, H], and GroupedMatmulSwigluQuant says so with its
attribute ``weight_layout="ENK"``: the Hopper wgmma kernel's operand, packed here offline (same
outputs; on CPU "EKN" is the faster layout). ``moe_weight_layout="EN16K4"`` stores both GEMMs'
weights as AMX B tiles, the CPU's AMX layout (CPU only; ``pack_en16k4``): gate_up int8
[E, ceil(2I/16), H/4, 16, 4] and down int8 [E, ceil(H/16), I/4, 16, 4], each node with
weight_layout="EN16K4" (a weight whose K, H or I, is not a multiple of 4 keeps "EKN", warned).
The float reference of what a block computes is ``ort_ops.ops._moe.moe_experts_float``
with the graph's own routing.

Forms handled (what exporters write, see ``graphs/export_moe_fixtures.py`` and
``graphs/export_moe_families.py``): torch.onnx dynamo and legacy with transformers' ``batched_mm``
experts (GatherND of stacked weights, batched MatMul) for Mixtral, Qwen2/3-MoE, DeepSeek-V3 and
gpt-oss,
transformers 5.x's exporter (sort by expert, per-expert unrolled Range/Gather/MatMul/Concat),
optimum's unrolled per-expert loop (NonZero/Gather/three MatMuls/ScatterElements), and the
``com.microsoft`` ``MoE`` / ``QMoE`` nodes (silu with fc3, or interleaved swiglu at alpha 1,
beta 0; QMoE's 8/4-bit codes dequantized, then re-quantized by the rule above). A shared expert
added to a fused block's output runs as one always-on INT8 expert (``_fuse_shared_expert``;
DeepSeek-V3's n_shared_experts are one MLP of their summed width, over the [B, S, H] hidden state).

float16 blocks run the chain on float16 activations (the ops take them) with one Cast of the
float32 output back to float16. bfloat16 blocks run it on float32: a Cast of the hidden state to
float32 in front (exact), one of the output back to bfloat16, the expert weights quantized from
their bfloat16 values as float32; the probe runs the model's float32 twin
(``_graph.float32_twin``), since ORT's CPU provider has no bfloat16 Mul/MatMul. The router is found through Casts (to a float type)
and Identities between its GEMM, its Softmax and the TopK.

Routers kept as the graph computes them: softmax over a linear projection then TopK (Mixtral,
Qwen), TopK of the logits then a Softmax of the K values (gpt-oss, with its router bias), and
DeepSeek-V3's sigmoid router (the selection TopK ranks the scores plus a correction bias,
group-limited by further TopKs; the weights are the unbiased scores gathered at the selected ids,
renormalized and multiplied by routed_scaling_factor).

Not handled (declined with a reason): routers whose weights are neither a softmax of scores nor
sigmoid scores gathered at the selection (e.g. raw top-k logits), activations other than SiLU-gated
and gpt-oss's clamped SwiGLU (a Gelu, or a clamp whose up bounds are not [-limit, limit]), expert
biases in unrolled per-expert forms and in com.microsoft MoE/QMoE nodes, swiglu with alpha != 1
or a limit in com.microsoft nodes, MoE blocks inside subgraphs.

Why graph walking (onnx-ir) rather than onnxscript rewriter patterns: the exported forms differ
in dozens of index-plumbing nodes (OneHot/Tile, ScatterElements/CumSum, NonZero, GatherND) and
the unrolled ones repeat a subgraph E times, which a fixed pattern cannot express. So the pass
anchors on what every form shares and proves the rest:

1. the router: a ``TopK`` over ``Softmax(Gemm|MatMul(x, W_router))`` (or the TopK of the logits
   followed by a Softmax of the K values), or a selection TopK whose ids gather the weights from
   ``Sigmoid(Gemm|MatMul(x, W_router))``, with a constant router weight; the top-k weights are
   followed through the [T, K] chain that renormalizes / rescales them, and used as the graph
   computes them;
2. the block output: a post-dominator of the TopK (every path from the router to the model's
   outputs passes through it); the block is everything between the hidden state and it;
3. structure inside the block: every expert activation is ``x * Sigmoid(x) * up`` (SiLU-gated)
   or ``(Clip(up, -limit, limit) + 1) * a * Sigmoid(alpha * a)`` with ``a = Clip(gate, max=limit)``
   (gpt-oss; alpha and limit read from the graph's constants), all the same (any other activation
   op declines), one gated product for stacked weights or exactly E of them
   for unrolled experts (fewer: a trace specialized to the experts its example input hit, which
   is wrong for other inputs: declined), no non-constant float tensor read besides the hidden
   state (weights must be initializers);
4. the weights' roles (gate / up / down, halves or interleaved columns, orientation, expert order,
   which rank-2 [E, N] constants are biases) are read from the constants
   and confirmed by running the original model on probe inputs (a long prompt hitting every
   expert, and a single token): the block output must equal the float MoE of the extracted
   weights and the graph's routing to float32 rounding (``PROBE_RTOL``), or the block declines.

A candidate that fails any step stays unfused and correct, with the reason in the result.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Iterable

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ort_ops._domain import DOMAIN, OPSET_VERSION
from ort_ops.ops._moe import EKN, EN16K4, OAI_ALPHA, OAI_LIMIT, WEIGHT_LAYOUTS, moe_experts_float, pack_en16k4
from ort_ops.ops._quant import quantize_expert_weights
from ort_ops.rewrite._graph import (Prober, attr_int, const_array, fold_const, has_bfloat16, initializer,
                                    named_values, same_values, synthetic_feeds)
from ort_ops.rewrite.pipeline import Decline, FusionResult

# Activations that are not the SiLU-gated product the chain computes; their presence in a block
# declines it.
OTHER_ACTIVATIONS = frozenset({
    "Gelu", "Erf", "Tanh", "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish",
    "Mish", "Softplus", "Softsign", "PRelu", "ThresholdedRelu", "FastGelu", "BiasGelu", "QuickGelu",
    "Swish", "BiasSplitGelu", "GatedGelu",
})
# Ops that only move or reshape data: skipped when tracing a MatMul operand to its weight.
_PASS_THROUGH = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Cast"})
# The probe compares the block's output with the float MoE of the extracted weights: both are
# float32 computations of the same sums in different orders, so they agree to ~1e-6 relative; a
# wrong interpretation (gate/up swapped, a wrong expert order, a transposed weight) is off by
# O(1). 1e-3 of the output's magnitude separates the two with a wide margin either way.
PROBE_RTOL = 1e-3
# A block with float16 activations rounds its intermediates (x @ W, SiLU, the product, the down
# projection) to 11 significant bits against the float64 reference: 4.3e-4 to 6.8e-4 of the
# output's magnitude on the float16 fixtures, too close to PROBE_RTOL; a wrong interpretation is
# still off by O(1), so 2e-2 keeps a wide margin both ways.
PROBE_RTOL_FP16 = 2e-2
PROBE_TOKENS = (48, 1, 192)  # a prompt, a single decode token, a longer prompt if experts were missed


@dataclasses.dataclass
class _Candidate:
    """One router TopK and what the structural steps found around it."""

    topk: ir.Node
    x: ir.Value                # [T, H] router input (the tokens the experts see)
    hidden: ir.Value           # x itself, or the [B, S, H] tensor x is a reshape of
    num_experts: int
    k: int
    ids: ir.Value              # TopK indices [T, K]
    weights: ir.Value          # routing weights [T, K] as the graph computes them
    routing: str
    outs: list[ir.Value]       # post-dominator values, in order: the block output is one of them
    router_nodes: frozenset = frozenset()  # a sigmoid router's Sigmoid: not an expert activation


@dataclasses.dataclass(frozen=True)
class _Activation:
    """The experts' gated activation as GroupedMatmulSwigluQuant's attributes name it: "swiglu"
    (SiLU(gate) * up) or "swiglu_oai" (gpt-oss's clamped form, with the graph's alpha and limit)."""

    name: str = "swiglu"
    alpha: float = OAI_ALPHA
    limit: float = OAI_LIMIT

    def attrs(self) -> dict:
        return {} if self.name == "swiglu" else {"activation": self.name, "alpha": self.alpha, "limit": self.limit}


SILU = _Activation()


@dataclasses.dataclass
class _Reading:
    """One interpretation of a block's constants as expert weights (x @ W orientation)."""

    w_gate: np.ndarray         # [E, H, I]
    w_up: np.ndarray           # [E, H, I]
    w_down: np.ndarray         # [E, I, H]
    desc: str
    b_gate: np.ndarray | None = None  # [E, I]
    b_up: np.ndarray | None = None    # [E, I]
    b_down: np.ndarray | None = None  # [E, H]


@dataclasses.dataclass
class _Block:
    cand: _Candidate
    out: ir.Value
    w: _Reading
    act: _Activation
    form: str
    reshape_to_hidden: bool


class _Declined(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# small graph helpers


def _consumers(v: ir.Value) -> list[ir.Node]:
    return [u.node for u in v.uses()]


def _descendant_nodes(values: Iterable[ir.Value]) -> set[ir.Node]:
    seen: set[ir.Node] = set()
    stack = [n for v in values for n in _consumers(v)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(c for o in n.outputs for c in _consumers(o))
    return seen


def _region(out: ir.Value, within: set[ir.Node]) -> set[ir.Node]:
    """Ancestors of ``out`` (inclusive) that lie in ``within``."""
    seen: set[ir.Node] = set()
    stack = [out.producer()]
    while stack:
        n = stack.pop()
        if n is None or n in seen or n not in within:
            continue
        seen.add(n)
        stack.extend(i.producer() for i in n.inputs if i is not None)
    return seen


def _post_dominators(graph: ir.Graph, node: ir.Node, limit: int = 12) -> list[ir.Node]:
    """Nodes every path from ``node`` to the graph's outputs passes through, in graph order.

    Walks the (topologically sorted) graph once, keeping the edges from already-visited
    descendants that are still open: a descendant is a post-dominator when all open edges
    lead into it.
    """
    desc = _descendant_nodes(node.outputs)
    graph_out = object()
    open_edges: dict[ir.Value, set] = {}

    def open_outputs(n: ir.Node):
        for o in n.outputs:
            cons = set(_consumers(o))
            if o.is_graph_output():
                cons.add(graph_out)
            if cons:
                open_edges[o] = cons

    open_outputs(node)
    found: list[ir.Node] = []
    started = False
    for n in graph:
        if n is node:
            started = True
            continue
        if not started or n not in desc:
            continue
        if open_edges and all(c == {n} for c in open_edges.values()):
            found.append(n)
            if len(found) >= limit:
                break
        for i in n.inputs:
            if i in open_edges:
                open_edges[i].discard(n)
                if not open_edges[i]:
                    del open_edges[i]
        open_outputs(n)
    return found


def _is_last_axis(n: ir.Node, rank_hint: int = 2) -> bool:
    axis = attr_int(n, "axis", -1)
    return axis in (-1, rank_hint - 1)


# ---------------------------------------------------------------------------------------------
# step 1: router


_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


def _through_casts(node: ir.Node | None) -> ir.Node | None:
    """The first producer up the chain that is not an Identity or a Cast to a float type: what
    ``softmax(logits, dtype=float)`` and mixed-precision routers put between the router GEMM,
    its Softmax and the TopK (they change the scores' precision, never the experts chosen)."""
    while node is not None and node.domain in ("", "ai.onnx") and (
            node.op_type == "Identity" or node.op_type == "Cast" and attr_int(node, "to", 0) in _FLOAT_TYPES):
        node = node.inputs[0].producer()
    return node


def _router_projection(src: ir.Node | None) -> tuple[ir.Value, np.ndarray]:
    """(x [T, H], router weight [H, E]) of the router GEMM ``src`` (Gemm, or MatMul by a constant,
    optionally plus a bias), or _Declined."""
    src = _through_casts(src)
    if src is None:
        raise _Declined("the TopK's scores do not come from a router projection")
    if src.op_type == "Add":  # MatMul + bias: it changes only the scores, which the graph keeps computing
        mm_in = src.inputs[0] if const_array(src.inputs[1]) is not None else src.inputs[1]
        src = mm_in.producer()
        if src is None:
            raise _Declined("the router is not a linear projection")
    if src.op_type == "Gemm":
        if attr_int(src, "transA", 0):
            raise _Declined("router Gemm with transA is not expressible")
        w = const_array(src.inputs[1])
        if w is None:
            raise _Declined(f"router weight '{src.inputs[1].name}' is not a constant initializer")
        if attr_int(src, "transB", 0):
            w = w.T
        x = src.inputs[0]
    elif src.op_type == "MatMul":
        w = const_array(src.inputs[1])
        if w is None:
            raise _Declined(f"router weight '{src.inputs[1].name}' is not a constant initializer")
        x = src.inputs[0]
    else:
        raise _Declined(f"the TopK's scores come from {src.op_type}, not a router Gemm/MatMul")
    if w.ndim != 2:
        raise _Declined(f"router weight has rank {w.ndim}, expected 2")
    return x, w


def _find_router(topk: ir.Node) -> tuple[ir.Value, np.ndarray, str]:
    """(x [T, H], router weight [H, E], how the scores reach the TopK) or _Declined, for a softmax
    router: the TopK over Softmax(logits), or over the logits themselves."""
    src = _through_casts(topk.inputs[0].producer())
    softmax_first = src is not None and src.op_type == "Softmax" and src.domain in ("", "ai.onnx")
    if softmax_first:
        if not _is_last_axis(src):
            raise _Declined("the router Softmax is not over the expert axis")
        src = src.inputs[0].producer()
    x, w = _router_projection(src)
    return x, w, "softmax -> topk" if softmax_first else "topk"


def _sigmoid_router(topk: ir.Node) -> tuple[ir.Value, np.ndarray, ir.Node, ir.Node] | None:
    """DeepSeek-V3's router: the selection TopK's ids gather their weights from the unbiased
    scores, ``GatherElements(Sigmoid(x @ W), ids, axis=-1)``; what the TopK itself ranks (the
    scores plus a correction bias, group-limited by further TopKs and a mask) only selects, and
    the graph keeps computing it. Returns (x [T, H], router weight [H, E], the GatherElements, the
    Sigmoid), None when the TopK's ids gather no sigmoid scores, or _Declined."""
    for g in _consumers(topk.outputs[1]):
        if g.op_type != "GatherElements" or g.domain not in ("", "ai.onnx") or g.inputs[1] is not topk.outputs[1]:
            continue
        sig = _through_casts(g.inputs[0].producer())
        if sig is None or sig.op_type != "Sigmoid" or sig.domain not in ("", "ai.onnx"):
            continue
        if not _is_last_axis(g):
            raise _Declined("the routing weights are gathered from the sigmoid scores along another axis "
                            "than the experts'")
        x, w = _router_projection(sig.inputs[0].producer())
        return x, w, g, sig
    return None


def _renormalized(v: ir.Value, reduce_sum: ir.Node) -> ir.Value | None:
    """The output of ``v / ReduceSum(v)`` when ``reduce_sum`` is that ReduceSum, also with a
    constant added to the sum (DeepSeek-V3's ``sum + 1e-20``); None otherwise."""
    sums = [reduce_sum.outputs[0]]
    for a in _consumers(reduce_sum.outputs[0]):
        if a.op_type == "Add" and any(const_array(i) is not None and const_array(i).size == 1 for i in a.inputs):
            sums.append(a.outputs[0])
    for s in sums:
        for d in _consumers(s):
            if d.op_type == "Div" and d.inputs[0] is v and d.inputs[1] is s:
                return d.outputs[0]
    return None


def _follow_weights(values: ir.Value, routing: str) -> tuple[ir.Value, str]:
    """Follows the top-k values through the [T, K] chain exporters write after the TopK (or after
    the GatherElements of a sigmoid router): renormalization (Div by ReduceSum, plus a constant or
    not), Softmax over the K values, Cast, scaling by a constant (DeepSeek-V3's
    routed_scaling_factor). Returns the last tensor of the chain (the routing weights the experts
    are scaled by) and ``routing`` with the steps appended."""
    v, steps = values, []
    for _ in range(8):
        nxt = None
        for n in _consumers(v):
            if n.op_type == "ReduceSum" and n.inputs[0] is v and attr_int(n, "keepdims", 1):
                d = _renormalized(v, n)
                if d is not None:
                    nxt, step = d, "renormalize"
            elif n.op_type == "Softmax" and _is_last_axis(n):
                nxt, step = n.outputs[0], "softmax over the k"
            elif n.op_type == "Cast" and attr_int(n, "to", 0) in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
                nxt, step = n.outputs[0], None
            elif n.op_type in ("Mul", "Div") and n.inputs[0] is v:
                c = const_array(n.inputs[1])
                if c is not None and c.size == 1:
                    nxt, step = n.outputs[0], f"{'x' if n.op_type == 'Mul' else '/'} {float(c.reshape(-1)[0]):g}"
            if nxt is not None:
                break
        if nxt is None:
            break
        v = nxt
        if step:
            steps.append(step)
    return v, routing + "".join(f" -> {s}" for s in steps)


# ---------------------------------------------------------------------------------------------
# step 3: structure inside the block


def _scalar(v: ir.Value | None) -> float | None:
    c = const_array(v)
    return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None


def _other_input(n: ir.Node, v: ir.Value) -> ir.Value | None:
    """The other operand of a binary node that reads ``v``."""
    if len(n.inputs) != 2 or v not in n.inputs:
        return None
    return n.inputs[1] if n.inputs[0] is v else n.inputs[0]


def _clip_bounds(v: ir.Value) -> tuple[ir.Value, float, float] | None:
    """(input, min, max) when ``v`` is Clip(input, min, max) with constant (or absent) bounds."""
    n = v.producer()
    if n is None or n.op_type != "Clip" or n.domain not in ("", "ai.onnx"):
        return None
    ins = list(n.inputs) + [None, None]
    lo = -np.inf if ins[1] is None else _scalar(ins[1])
    hi = np.inf if ins[2] is None else _scalar(ins[2])
    if lo is None or hi is None:
        return None
    return n.inputs[0], lo, hi


def _oai_product(s: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value, _Activation] | None:
    """gpt-oss's clamped SwiGLU around the Sigmoid ``s``, as exported:
    ``(Clip(up, -limit, limit) + 1) * (a * Sigmoid(a * alpha))`` with ``a = Clip(gate, max=limit)``.
    Returns (gate, up, product, activation with the graph's alpha and limit) or None."""
    m = s.inputs[0].producer()
    if m is None or m.op_type != "Mul":
        return None
    a = next((i for i in m.inputs if _clip_bounds(i) is not None), None)
    alpha = _scalar(_other_input(m, a)) if a is not None else None
    if alpha is None:
        return None
    gate, lo, limit = _clip_bounds(a)
    glu = next((n for n in _consumers(s.outputs[0]) if n.op_type == "Mul" and set(n.inputs) == {a, s.outputs[0]}), None)
    if glu is None or lo != -np.inf:
        return None
    for p in _consumers(glu.outputs[0]):
        plus = _other_input(p, glu.outputs[0]) if p.op_type == "Mul" else None
        add = plus.producer() if plus is not None else None
        if add is None or add.op_type != "Add":
            continue
        g = next((i for i in add.inputs if _clip_bounds(i) is not None), None)
        if g is None or _scalar(_other_input(add, g)) != 1.0:
            continue
        up, ulo, uhi = _clip_bounds(g)
        if (ulo, uhi) != (-limit, limit):
            raise _Declined(f"clamped SwiGLU with gate limit {limit} and up clamp [{ulo}, {uhi}]: not "
                            "swiglu_oai's [-limit, limit]")
        if not (np.isfinite(alpha) and np.isfinite(limit) and limit > 0):
            raise _Declined(f"clamped SwiGLU with alpha {alpha}, limit {limit}: swiglu_oai needs finite values, "
                            "limit > 0")
        return gate, up, p.outputs[0], _Activation("swiglu_oai", alpha, limit)
    return None


def _gated_products(graph: ir.Graph, region: set[ir.Node], router_nodes: frozenset = frozenset()
                    ) -> list[tuple[ir.Value, ir.Value, ir.Value, _Activation]]:
    """(gate pre-activation, up, product, activation) of every gated product in the region, in
    graph order (an unrolled loop's order is its expert order): ``a * Sigmoid(a) * b`` (SiLU) or
    gpt-oss's clamped SwiGLU (``_oai_product``). The Sigmoid of a sigmoid router (in
    ``router_nodes``) is not an expert's."""
    out = []
    for s in graph:
        if s not in region or s.op_type != "Sigmoid" or s in router_nodes:
            continue
        a = s.inputs[0]
        silu = next((m for m in _consumers(s.outputs[0]) if m.op_type == "Mul"
                     and set(m.inputs) == {a, s.outputs[0]}), None)
        if silu is None:
            oai = _oai_product(s)
            if oai is None:
                raise _Declined("a Sigmoid in the experts is neither x * Sigmoid(x) (SiLU) nor gpt-oss's clamped "
                                "SwiGLU (Clip(up) + 1) * a * Sigmoid(alpha * a)")
            out.append(oai)
            continue
        prods = [m for m in _consumers(silu.outputs[0]) if m.op_type == "Mul"]
        if len(prods) != 1:
            raise _Declined("the experts' SiLU is not multiplied by an up projection (not SiLU-gated)")
        p = prods[0]
        b = p.inputs[1] if p.inputs[0] is silu.outputs[0] else p.inputs[0]
        out.append((a, b, p.outputs[0], SILU))
    if len({act for *_, act in out}) > 1:
        raise _Declined("the experts use different activations: " + ", ".join(sorted({
            f"{act.name}" + (f" (alpha {act.alpha}, limit {act.limit})" if act.name != "swiglu" else "")
            for *_, act in out})))
    return out


def _check_region(region: set[ir.Node], allowed_inputs: set[ir.Value]) -> None:
    for n in region:
        if n.op_type in OTHER_ACTIVATIONS:
            raise _Declined(f"expert activation {n.op_type} ('{n.name}') is not SiLU-gated")
        if n.domain not in ("", "ai.onnx"):
            raise _Declined(f"the block holds {n.domain}::{n.op_type} ('{n.name}'), which it cannot prove")
        for i in n.inputs:
            if i is None or i in allowed_inputs or (i.producer() in region):
                continue
            if fold_const(i) is not None:
                continue
            dt = i.dtype
            if dt is not None and dt.is_floating_point():
                raise _Declined(f"the block reads '{i.name}', which is not a constant initializer "
                                "(expert weights must be constants)")


def _weight_constants(region: set[ir.Node], h: int) -> list[np.ndarray]:
    """The constants (initializers / Constant nodes) the region reads, directly or through
    constant-only layout ops (per-expert slices of a stacked weight), of rank >= 2."""
    seen, found = set(), []
    stack = [i for n in region for i in n.inputs if i is not None and i.producer() not in region]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        c = const_array(v)
        if c is not None:
            if c.ndim >= 2 and c.size >= h or c.ndim == 2:  # (rank 2: biases [E, N] may be small)
                found.append(c)
            continue
        p = v.producer()
        if p is not None and p not in region and fold_const(v) is not None:
            stack.extend(i for i in p.inputs if i is not None)
    return found


def _trace_weight(v: ir.Value, want_input_dim: int) -> tuple[np.ndarray, int | None, int] | None:
    """Follows an expert activation back to the MatMul/Gemm that produced it.

    Returns (W [in, out] in x @ W orientation, split index or None, number of split parts), or
    None when the producer is not a projection by a constant weight.
    """
    split_idx, parts = None, 1
    n = v.producer()
    for _ in range(6):
        if n is None:
            return None
        if n.op_type in _PASS_THROUGH:
            n = n.inputs[0].producer()
            continue
        if n.op_type == "Split" and split_idx is None:
            split_idx, parts = list(n.outputs).index(v), len(n.outputs)
            if attr_int(n, "axis", 0) not in (-1, 1):
                return None
            v = n.inputs[0]
            n = v.producer()
            continue
        break
    if n.op_type == "MatMul":
        w = fold_const(n.inputs[1])
        if w is None:
            return None
        w = w.reshape(w.shape[-2:]) if w.ndim == 3 and w.shape[0] == 1 else w
    elif n.op_type == "Gemm" and not attr_int(n, "transA", 0):
        w = fold_const(n.inputs[1])
        if w is None or len(n.inputs) > 2 and n.inputs[2] is not None:
            return None
        w = w.T if attr_int(n, "transB", 0) else w
    else:
        return None
    if w.ndim != 2 or w.shape[0] != want_input_dim:
        return None
    return w.astype(np.float32), split_idx, parts


def _down_of(p: ir.Value, inter: int) -> np.ndarray | None:
    """The down projection [I, H] applied to the gated product ``p``."""
    frontier = [p]
    for _ in range(5):
        nxt = []
        for v in frontier:
            for n in _consumers(v):
                if n.op_type in ("MatMul", "Gemm") and n.inputs[0] is v:
                    got = _trace_weight(n.outputs[0], inter)
                    if got is not None and got[1] is None:
                        return got[0]
                if n.op_type in _PASS_THROUGH or n.op_type in ("Gather", "GatherND"):
                    nxt.append(n.outputs[0])
        frontier = nxt
    return None


def _unrolled_weights(products, hidden: int):
    """Per-expert (gate [H, I], up [H, I], down [I, H]) from E gated products, in graph order."""
    experts = []
    for a, b, p, _ in products:
        ga, gb = _trace_weight(a, hidden), _trace_weight(b, hidden)
        if ga is None or gb is None:
            raise _Declined("an unrolled expert's gate/up is not a projection by a constant weight")
        wg, wu = ga[0], gb[0]
        if ga[1] is not None:  # one fused gate_up MatMul, split into halves
            if ga[2] != 2 or gb[1] is None or {ga[1], gb[1]} != {0, 1}:
                raise _Declined("an unrolled expert's gate/up split is not into two halves")
            half = wg.shape[1] // 2
            wg, wu = wg[:, ga[1] * half:(ga[1] + 1) * half], wu[:, gb[1] * half:(gb[1] + 1) * half]
        wd = _down_of(p, wg.shape[1])
        if wd is None or wd.shape != (wg.shape[1], hidden):
            raise _Declined("an unrolled expert's down projection is not a constant weight")
        experts.append((wg, wu, wd))
    return _Reading(np.stack([e[0] for e in experts]), np.stack([e[1] for e in experts]),
                    np.stack([e[2] for e in experts]), "per-expert (unrolled)")


def _stacked_interpretations(consts: list[np.ndarray], e: int, h: int):
    """Every reading of the block's rank-3 [E, ., .] constants as expert weights (``_Reading``):
    first without biases, then with every fitting choice of the rank-2 [E, N] constants as the
    gate/up and down biases (gpt-oss's gate_up_proj_bias / down_proj_bias; the probe decides)."""
    stacks = [c for c in consts if c.ndim == 3 and c.shape[0] == e and h in c.shape[1:]]
    rank2 = [c for c in consts if c.ndim == 2 and c.shape[0] == e]

    def as_in_out(c, in_dim):  # candidate [E, in, out] views of c whose input dim is in_dim
        views = []
        if c.shape[1] == in_dim:
            views.append((c, "x@W"))
        if c.shape[2] == in_dim:
            views.append((c.transpose(0, 2, 1), "linear"))
        return views

    # (gate, up, down, description, how a [E, 2I] gate_up bias splits into gate and up biases)
    halves = [(lambda b, i: (b[:, :i], b[:, i:]), "gate first"), (lambda b, i: (b[:, i:], b[:, :i]), "up first")]
    # gpt-oss interleaves the gate/up columns (gate = [..., ::2], up = [..., 1::2])
    interleaved = [(lambda b, i: (b[:, 0::2], b[:, 1::2]), "interleaved, gate even"),
                   (lambda b, i: (b[:, 1::2], b[:, 0::2]), "interleaved, up even")]
    base = []
    for g, d in itertools.permutations(range(len(stacks)), 2):  # fused gate_up + down
        for gu, gdesc in as_in_out(stacks[g], h):
            if gu.shape[2] % 2:
                continue
            i = gu.shape[2] // 2
            for dn, ddesc in as_in_out(stacks[d], i):
                if dn.shape[2] != h:
                    continue
                for split, how in halves + interleaved:
                    # the weights' columns split like a bias's: apply the same split over [E*H, 2I]
                    wg, wu = (w.reshape(e, h, i) for w in split(gu.reshape(e * h, 2 * i), i))
                    base.append((wg, wu, dn, f"stacked gate_up ({gdesc}, {how})",
                                 lambda b, i=i, split=split: split(b, i) if b.shape[1] == 2 * i else None))
    for gi, ui, di in itertools.permutations(range(len(stacks)), 3):  # separate gate, up, down
        for gg, _ in as_in_out(stacks[gi], h):
            for uu, _ in as_in_out(stacks[ui], h):
                if uu.shape != gg.shape:
                    continue
                for dn, _ in as_in_out(stacks[di], gg.shape[2]):
                    if dn.shape[2] == h:
                        base.append((gg, uu, dn, "stacked gate, up, down", None))
    for wg, wu, wd, desc, _ in base:
        yield _Reading(wg, wu, wd, desc)
    for wg, wu, wd, desc, split in base:
        inter = wg.shape[2]
        gate_up_biases = [None] + [b for b in rank2 if split is not None and b.shape[1] == 2 * inter]
        down_biases = [None] + [b for b in rank2 if b.shape[1] == h]
        for bgu, bd in itertools.product(gate_up_biases, down_biases):
            if bgu is None and bd is None:
                continue
            bg, bu = split(bgu) if bgu is not None else (None, None)
            yield _Reading(wg, wu, wd, desc + " with biases", bg, bu, bd)


# ---------------------------------------------------------------------------------------------
# step 4: probe


def moe_float(x: np.ndarray, ids: np.ndarray, wts: np.ndarray, w: _Reading, act: _Activation = SILU) -> np.ndarray:
    """The float MoE with given routing (``ort_ops.ops._moe.moe_experts_float``): x [T, H],
    ids/wts [T, K] -> float64 [T, H], the reading's optional biases added after each
    projection, ``act`` between them.

    Only the experts ``ids`` name are gathered (a reading is screened on a few tokens, and the
    full weights are gigabytes); they keep their ascending order, so each token's sum is taken in
    the same order as over all experts. An id outside [0, E) names no expert, as there."""
    e = w.w_gate.shape[0]
    ids = np.asarray(ids)
    valid = (ids >= 0) & (ids < e)
    used = np.unique(ids[valid]).astype(np.int64)
    local = np.where(valid, np.searchsorted(used, np.clip(ids, 0, max(e - 1, 0))), used.size)
    gate_up = np.concatenate([w.w_gate[used], w.w_up[used]], axis=2)
    bias = None if w.b_gate is None else np.concatenate([w.b_gate[used], w.b_up[used]], axis=1)
    b_down = None if w.b_down is None else w.b_down[used]
    return moe_experts_float(x, local, wts, gate_up, w.w_down[used], bias, b_down, act.name, act.alpha, act.limit)


def _matches(got: np.ndarray, want: np.ndarray, dtype=np.float32) -> bool:
    """``got`` equals ``want`` (float64) to the probe tolerance of activations of ``dtype``."""
    if got.size != want.size or not np.all(np.isfinite(got)):
        return False
    got = got.astype(np.float64).reshape(want.shape)
    rtol = PROBE_RTOL_FP16 if dtype == np.float16 else PROBE_RTOL
    return float(np.max(np.abs(got - want), initial=0)) <= rtol * max(float(np.max(np.abs(want), initial=0)), 1e-6)


# ---------------------------------------------------------------------------------------------
# candidates


def _already_fused(topk: ir.Node) -> bool:
    """The TopK's ids already feed our MoeInitRouting (a model rewritten before)."""
    users = _consumers(topk.outputs[1])
    users += [u for n in users if n.op_type == "Cast" for u in _consumers(n.outputs[0])]
    return any(n.domain == DOMAIN and n.op_type == "MoeInitRouting" for n in users)


def _hidden_state(x: ir.Value) -> ir.Value:
    """The tensor the router input ``x`` [T, H] is a Reshape/Flatten of (the [B, S, H] hidden
    state), looking through Identities and Casts to a float type (DeepSeek-V3's router reads
    ``hidden.view(-1, H).type(float32)``); ``x`` itself when there is none."""
    v = x
    for _ in range(4):
        p = v.producer()
        if p is None or p.domain not in ("", "ai.onnx"):
            break
        if p.op_type in ("Reshape", "Flatten"):
            return p.inputs[0]
        if not (p.op_type == "Identity" or p.op_type == "Cast" and attr_int(p, "to", 0) in _FLOAT_TYPES):
            break
        v = p.inputs[0]
    return x


def _candidates(graph: ir.Graph) -> tuple[list[_Candidate], list[Decline]]:
    cands, declined = [], []
    topks = [n for n in graph if n.op_type == "TopK" and n.domain in ("", "ai.onnx")
             and not (n.name or "").startswith("moe_int8/")]  # (our own router of a rewritten MoE node)
    # Sigmoid routers first: the TopKs that only narrow their selection (DeepSeek-V3's top-2 per
    # group, top groups) lie between the Sigmoid and the selection TopK and are parts of the
    # router, not candidates.
    sigmoid_routers, router_parts = {}, set()
    for n in topks:
        try:
            found = _sigmoid_router(n)
        except _Declined as e:
            found = e
        if found is not None:
            sigmoid_routers[n] = found
            if not isinstance(found, _Declined):
                router_parts |= _region(n.inputs[0], _descendant_nodes(found[3].outputs))
    for n in topks:
        if n in router_parts:
            continue
        if n.inputs[0].dtype is not None and not n.inputs[0].dtype.is_floating_point():
            continue  # an argsort of expert ids (transformers' grouped form), not a router
        if _already_fused(n):
            continue
        router_nodes: frozenset[ir.Node] = frozenset()
        try:
            found = sigmoid_routers.get(n)
            if isinstance(found, _Declined):
                raise found
            if found is not None:
                x, w_router, gather, sig = found
                groups = sum(1 for p in _region(n.inputs[0], _descendant_nodes(sig.outputs)) if p.op_type == "TopK")
                how = "sigmoid -> " + ("group-limited " if groups else "") + "topk -> gather"
                router_nodes = frozenset({sig})
            else:
                x, w_router, how = _find_router(n)
        except _Declined as e:
            # A TopK over something else (e.g. a sort inside the block) is not a router: only
            # report it when it looks like one (float scores from a projection).
            declined.append(Decline(n.name or "TopK", str(e)))
            continue
        k = const_array(n.inputs[1])
        if k is None or k.size != 1:
            declined.append(Decline(n.name, "top-k count is not a constant"))
            continue
        if attr_int(n, "largest", 1) != 1 or not _is_last_axis(n):
            declined.append(Decline(n.name, "TopK is not the k largest over the expert axis"))
            continue
        if router_nodes:  # the weights are the gathered sigmoid scores, as the graph goes on to use them
            weights, routing = _follow_weights(gather.outputs[0], how)
        else:
            weights, routing = _follow_weights(n.outputs[0], how)
            if not how.startswith("softmax") and "softmax" not in routing:
                declined.append(Decline(n.name, "routing weights are raw top-k logits (no Softmax or sigmoid "
                                        "gather): not a recognized router"))
                continue
        hidden = _hidden_state(x)
        outs = [pd.outputs[0] for pd in _post_dominators(graph, n) if len(pd.outputs) == 1]
        cands.append(_Candidate(n, x, hidden, w_router.shape[1], int(k.reshape(-1)[0]),
                                n.outputs[1], weights, routing, outs, router_nodes))
    return cands, declined


# Each reading is first compared on this many tokens of the first probe: a wrong reading (of the
# dozens the bias and column-order choices make) is off by O(1) on any token, so most are
# rejected at this cost instead of a float64 MoE over every probe token.
PROBE_SCREEN_TOKENS = 4


def _screen(pr: dict, out: ir.Value, cand: _Candidate, reading: _Reading, act: _Activation) -> bool:
    """False when ``reading`` already fails on the first PROBE_SCREEN_TOKENS tokens of probe ``pr``
    (True when that cannot be told here: the full comparison decides)."""
    got, x = pr.get(out.name), pr[cand.x.name]
    if got is None or got.size != x.size:
        return True
    t = PROBE_SCREEN_TOKENS
    want = moe_float(x[:t], pr[cand.ids.name][:t], pr[cand.weights.name][:t], reading, act)
    return _matches(got.reshape(x.shape)[:t], want, x.dtype)


def _analyze(model: ir.Model, cand: _Candidate, probes: list[dict]) -> _Block:
    e = cand.num_experts
    x0 = probes[0][cand.x.name]
    if x0.dtype not in (np.float32, np.float16) or x0.ndim != 2:
        raise _Declined(f"router input is {x0.dtype} of rank {x0.ndim}; only float32/float16 [T, H] blocks "
                        "are fused (the INT8 ops take float32/float16 activations)")
    h = x0.shape[1]
    within = _descendant_nodes([cand.hidden])
    # The reason reported is that of the candidate output that got furthest: a region that reads a
    # non-constant (one reaching past the block, e.g. through the residual Add) says less than an
    # inner region whose experts' structure or probe failed. Equal stages: the last one's.
    last_error, last_stage = "no post-dominator of the router has the block output's shape", -1
    for out in cand.outs:
        region = _region(out, within)
        if cand.topk not in region:
            continue
        stage = 0
        try:
            _check_region(region, {cand.hidden, cand.x})
            stage = 1
            products = _gated_products(model.graph, region, cand.router_nodes)
            if not products:
                raise _Declined("no gated expert MLP (SiLU x * Sigmoid(x) * up, or gpt-oss's clamped SwiGLU) "
                                "between router and output")
            act = products[0][3]
            consts = _weight_constants(region, h)
            if len(products) == 1:
                interps = list(_stacked_interpretations(consts, e, h))
                form = "stacked"
                if not interps:
                    raise _Declined(f"no constant [E={e}, ., .] expert weights hold the H={h} dim")
            elif len(products) == e:
                interps = [_unrolled_weights(products, h)]
                form = "unrolled"
            else:
                raise _Declined(f"the graph computes {len(products)} of {e} experts: a trace specialized to "
                                "its example input (the experts it hit), wrong for other inputs")
        except _Declined as err:
            if stage >= last_stage:
                last_error, last_stage = str(err), stage
            continue
        # Step 4: the probe decides which reading (if any) the graph computes.
        shape_ok = False
        for reading in interps:
            if not _screen(probes[0], out, cand, reading, act):
                continue
            # Every probe has the block's output, of the router input's size: then one float MoE
            # over all probes' tokens (each expert's weights converted once), compared probe by probe.
            ok = True
            for pr in probes:
                got = pr.get(out.name)
                if got is None or got.size != pr[cand.x.name].size:
                    ok = False
                    break
                shape_ok = True
            if ok:
                xs = [pr[cand.x.name] for pr in probes]
                want = moe_float(np.concatenate(xs), np.concatenate([pr[cand.ids.name] for pr in probes]),
                                 np.concatenate([pr[cand.weights.name] for pr in probes]), reading, act)
                ends = np.cumsum([len(x) for x in xs])
                ok = all(_matches(pr[out.name], part, x.dtype)
                         for pr, x, part in zip(probes, xs, np.split(want, ends[:-1])))
            if ok:
                reshape = pr[out.name].ndim != 2
                if reshape and tuple(pr[out.name].shape) != tuple(pr[cand.hidden.name].shape):
                    raise _Declined("the block output's shape is neither [T, H] nor the hidden state's")
                return _Block(cand, out, reading, act, f"{form}: {reading.desc}", reshape)
        if shape_ok:
            last_stage = 2
            last_error = (f"the block output does not equal a {act.name}-gated MoE of its constant weights "
                          "(with or without biases) under the graph's routing on probe inputs")
    raise _Declined(last_error)


# ---------------------------------------------------------------------------------------------
# emission


def check_weight_layout(weight_layout: str) -> None:
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"rewrite: moe_weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}, "
                         f"got '{weight_layout}'")


def _en16k4_or_ekn(q: np.ndarray, what: str, dim: str) -> str:
    """"EN16K4" if ``q`` [E, K, N] can be packed (K % 4 == 0), else "EKN" with a warning naming the
    weight, so that no block is left half rewritten."""
    if q.shape[1] % 4 == 0:
        return EN16K4
    import warnings
    warnings.warn(f"rewrite: moe_weight_layout EN16K4 needs the {dim} to be a multiple of 4, "
                  f"got {q.shape[1]}: this block's {what} weight keeps EKN", stacklevel=3)
    return EKN


def _swiglu_weight(gu_q: np.ndarray, weight_layout: str) -> tuple[np.ndarray, dict]:
    """GroupedMatmulSwigluQuant's weight as stored for ``weight_layout`` and the node attributes:
    "EKN" [E, H, 2I] as quantized (no attribute: the op's default), "ENK" transposed [E, 2I, H],
    "EN16K4" packed as AMX B tiles [E, ceil(2I/16), H/4, 16, 4]. That needs H % 4 == 0; a block
    with another H keeps "EKN" (with a warning), so no block is left half rewritten."""
    check_weight_layout(weight_layout)
    if weight_layout == EN16K4:
        weight_layout = _en16k4_or_ekn(gu_q, "gate/up", "hidden size")
    if weight_layout == EKN:
        return gu_q, {}
    if weight_layout == EN16K4:
        return pack_en16k4(gu_q), {"weight_layout": weight_layout}
    return np.ascontiguousarray(gu_q.transpose(0, 2, 1)), {"weight_layout": weight_layout}


def _down_weight(dn_q: np.ndarray, weight_layout: str) -> tuple[np.ndarray, dict]:
    """GroupedMatmulDequant's weight as stored for ``weight_layout`` and the node attributes:
    "EN16K4" packs it as AMX B tiles [E, ceil(H/16), I/4, 16, 4] (I % 4 == 0, else "EKN" with a
    warning); "EKN" and "ENK" keep [E, I, H] ("ENK" is the Hopper wgmma kernel's gate/up operand;
    GroupedMatmulDequant on the CUDA EP reads "EKN" only)."""
    check_weight_layout(weight_layout)
    if weight_layout != EN16K4 or _en16k4_or_ekn(dn_q, "down", "intermediate size") == EKN:
        return dn_q, {}
    return pack_en16k4(dn_q, "GroupedMatmulDequant"), {"weight_layout": EN16K4}


def emit_int8_chain(graph: ir.Graph, prefix: str, x: ir.Value, ids: ir.Value, weights: ir.Value,
                    w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
                    weight_layout: str = EKN, *, b_gate: np.ndarray | None = None,
                    b_up: np.ndarray | None = None, b_down: np.ndarray | None = None,
                    act: _Activation = SILU) -> tuple[list[ir.Node], ir.Value, int]:
    """The INT8 chain for x [T, H], ids [T, K] (any int), weights [T, K] and float expert weights
    gate/up [E, H, I], down [E, I, H]; ``weight_layout`` "EKN", "ENK" (the gate/up weight then
    stored [E, 2I, H]) or "EN16K4" (both weights as AMX B tiles, ``_swiglu_weight`` /
    ``_down_weight``). Optional biases gate/up [E, I] (both or neither) and down [E, H] become the
    GEMMs' float32 bias inputs ([E, 2I] as [gate | up], like the weight's columns); ``act`` sets
    GroupedMatmulSwigluQuant's activation attributes. Returns (nodes, out [T, H] float32, bytes of
    the INT8 weights, scales and biases). Nodes are not yet inserted."""

    e = w_gate.shape[0]
    gu_q, gu_s = quantize_expert_weights(np.concatenate([w_gate, w_up], axis=2))
    gu_q, gu_attrs = _swiglu_weight(gu_q, weight_layout)
    dn_q, dn_s = quantize_expert_weights(w_down)
    dn_q, dn_attrs = _down_weight(dn_q, weight_layout)
    inits = [initializer(graph, f"{prefix}/gate_up_int8", gu_q),
             initializer(graph, f"{prefix}/gate_up_scale", gu_s),
             initializer(graph, f"{prefix}/down_int8", dn_q),
             initializer(graph, f"{prefix}/down_scale", dn_s)]
    nbytes = gu_q.nbytes + gu_s.nbytes + dn_q.nbytes + dn_s.nbytes
    gu_bias = dn_bias = None
    if b_gate is not None:
        arr = np.concatenate([b_gate, b_up], axis=1).astype(np.float32)
        gu_bias, nbytes = initializer(graph, f"{prefix}/gate_up_bias", arr), nbytes + arr.nbytes
    if b_down is not None:
        arr = np.asarray(b_down, np.float32)
        dn_bias, nbytes = initializer(graph, f"{prefix}/down_bias", arr), nbytes + arr.nbytes
    nodes = []

    def add(op, inputs, num_outputs=1, domain=DOMAIN, tag="", **attrs):
        n = ir.node(op, inputs, attrs or None, domain=domain, num_outputs=num_outputs,
                    name=f"{prefix}/{op}{tag}")
        for j, o in enumerate(n.outputs):
            o.name = f"{prefix}/{op}{tag}_{j}"
        nodes.append(n)
        return n.outputs

    ids32 = add("Cast", [ids], domain="", to=int(ir.DataType.INT32))[0]
    if weights.dtype not in (None, ir.DataType.FLOAT, ir.DataType.FLOAT16):
        weights = add("Cast", [weights], domain="", to=int(ir.DataType.FLOAT))[0]
    x_dtype = x.dtype
    if x_dtype == ir.DataType.BFLOAT16:  # the ops take float32/float16 activations
        x = add("Cast", [x], domain="", tag="_in", to=int(ir.DataType.FLOAT))[0]
    # The token rows are quantized once, before routing; MoeInitRouting gathers the int8 rows and
    # their scales (the same codes as quantizing each gathered copy, K times fewer rows to quantize).
    tq, ts = add("DynamicQuant", [x], 2)
    xq, s2f, groups, xs = add("MoeInitRouting", [tq, ids32, ts], 4, num_experts=e)
    hq, hs, _ = add("GroupedMatmulSwigluQuant", [xq, inits[0], inits[1], xs, groups]
                    + ([gu_bias] if gu_bias is not None else []), 3, **gu_attrs, **act.attrs())
    y = add("GroupedMatmulDequant", [hq, inits[2], inits[3], hs, groups]
            + ([dn_bias] if dn_bias is not None else []), **dn_attrs)[0]
    out = add("MoeFinalizeRouting", [y, s2f, weights])[0]
    if x_dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):  # MoeFinalizeRouting's output is float32
        out = add("Cast", [out], domain="", tag="_out", to=int(x_dtype))[0]
    return nodes, out, nbytes


def _replace_value(old: ir.Value, new: ir.Value) -> None:
    """Redirects every use of ``old`` to ``new``; a graph output keeps its name."""
    if old.is_graph_output():
        name = old.name
        old.name = f"{name}/unfused"
        new.name = name
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)


def _replace_block(model: ir.Model, block: _Block, weight_layout: str = EKN) -> tuple[int, ir.Value]:
    graph = model.graph
    cand = block.cand
    prefix = f"moe_int8/{cand.topk.name or 'block'}"
    w = block.w
    nodes, out, nbytes = emit_int8_chain(graph, prefix, cand.x, cand.ids, cand.weights, w.w_gate, w.w_up,
                                         w.w_down, weight_layout, b_gate=w.b_gate, b_up=w.b_up, b_down=w.b_down,
                                         act=block.act)
    return nbytes, splice_block(graph, block, prefix, nodes, out)


def probe_candidates(model: ir.Model, cands: list[_Candidate], text_ids: np.ndarray | None = None) -> list[dict]:
    """The probe runs that prove MoE blocks: the arrays of every candidate's router input, routing
    ids and weights, hidden state and post-dominators on runs of the unchanged model. A
    PROBE_TOKENS[0]-token prompt and a single token; ``text_ids`` [S] (real text) when given; a
    longer prompt when the first missed an expert; and, for experts no run picked, one run of a
    copy with the routing ids forced over every expert (``_forced_probe``; when it cannot be made,
    those candidates stay short of experts and decline). Raises what the original model raises on
    a probe."""
    wanted: list[ir.Value] = []
    for c in cands:
        wanted += [c.x, c.ids, c.weights, c.hidden] + c.outs
    wanted = list({id(v): v for v in wanted}.values())
    prober = Prober(model, wanted)

    def run(tokens: int) -> dict:
        return prober.run(synthetic_feeds(prober.model.graph, tokens, np.random.default_rng(tokens)))

    probes = [run(t) for t in PROBE_TOKENS[:2]]
    if text_ids is not None:
        feeds = synthetic_feeds(prober.model.graph, int(text_ids.size), np.random.default_rng(0))
        ids_name = next(n for n in feeds if n.endswith("input_ids"))
        feeds[ids_name] = np.asarray(text_ids, feeds[ids_name].dtype).reshape(1, -1)
        probes.append(prober.run(feeds))
    # A long prompt hitting every expert checks every expert's weights; retry longer if not.
    if any(np.unique(probes[0][c.ids.name]).size < c.num_experts for c in cands):
        probes.append(run(PROBE_TOKENS[2]))
    # Experts no run picked: a router may rarely or never pick an expert on any text, and random
    # routers concentrate deep layers on few experts.
    missed = [c for c in cands if len(_hit(c, probes)) < c.num_experts]
    if missed:
        try:
            probes.append(_forced_probe(model, missed, wanted, probes[0]))
        except Exception:  # noqa: BLE001 - those candidates decline as never-selected experts
            pass
    return probes


def _hit(cand: _Candidate, probes: list[dict]) -> set:
    """The experts ``cand``'s router picked on any of ``probes``."""
    return set(np.unique(np.concatenate([p[cand.ids.name].reshape(-1) for p in probes])).tolist())


def _forced_probe(model: ir.Model, cands: list[_Candidate], wanted: list[ir.Value], probe: dict) -> dict:
    """``wanted``'s values on a copy of ``model`` in which each candidate's routing ids [T, K] are a
    graph input fed (t * K + j) mod E: every expert gets tokens, K distinct ones a token. The ids
    are all the experts read of the router (the routing weights come as the graph computes them),
    so the block's output on this probe is what its experts make of these assignments, which is
    what _analyze checks our reading of their weights against. ``probe`` (an ordinary probe's
    arrays) gives the ids' element type. The arrays come back under the original values' names,
    the ids as fed."""
    work = model.clone()
    by_name = {v.name: v for v in named_values(work.graph)}
    tokens = max(PROBE_TOKENS[0], max(-(-2 * c.num_experts // c.k) for c in cands))
    feeds = synthetic_feeds(work.graph, tokens, np.random.default_rng(tokens))
    forced = {}
    for c in cands:
        ids = by_name[c.ids.name]
        dtype = probe[c.ids.name].dtype
        if c.k > c.num_experts or probe[c.ids.name].ndim != 2 or ids.is_graph_output():
            raise _Declined(f"routing ids {c.ids.name} cannot be forced")
        arr = (np.arange(tokens * c.k) % c.num_experts).reshape(tokens, c.k).astype(dtype)
        value = ir.Value(name=f"ort_ops_forced_ids/{c.ids.name}", type=ir.TensorType(ir.DataType.from_numpy(dtype)),
                         shape=ir.Shape([tokens, c.k]))
        work.graph.inputs.append(value)
        ids.replace_all_uses_with(value)
        feeds[value.name] = arr
        forced[c.ids.name] = arr
    out = Prober(work, same_values(work, wanted)).run(feeds)
    out.update(forced)
    return out


def splice_block(graph: ir.Graph, block: _Block, prefix: str, nodes: list[ir.Node], out: ir.Value) -> ir.Value:
    """Puts ``nodes`` (a replacement of ``block`` whose result is ``out`` [T, H]) after the block's
    output node and makes every use of the block's output read ``out`` (reshaped to the hidden
    state's shape where the block's output had it). Returns the value that replaced it."""
    if block.reshape_to_hidden:
        shp = ir.node("Shape", [block.cand.hidden], name=f"{prefix}/Shape")
        rs = ir.node("Reshape", [out, shp.outputs[0]], name=f"{prefix}/Reshape")
        shp.outputs[0].name, rs.outputs[0].name = f"{prefix}/Shape_0", f"{prefix}/Reshape_0"
        nodes = nodes + [shp, rs]
        out = rs.outputs[0]
    graph.insert_after(block.out.producer(), nodes)
    _replace_value(block.out, out)
    return out


def _dense_projection(v: ir.Value) -> tuple[ir.Value, np.ndarray] | None:
    """(input, W [in, out]) when ``v`` is MatMul(x, W) or Gemm(x, W[, transB]) with a constant W
    and no bias; None otherwise."""
    n = v.producer()
    if n is None or n.domain not in ("", "ai.onnx"):
        return None
    if n.op_type == "MatMul":
        w = const_array(n.inputs[1])
    elif n.op_type == "Gemm" and not attr_int(n, "transA", 0) and (len(n.inputs) < 3 or n.inputs[2] is None):
        w = const_array(n.inputs[1])
        if w is not None and attr_int(n, "transB", 0):
            w = w.T
        if n.attributes.get("alpha") is not None and n.attributes["alpha"].as_float() != 1.0:
            return None
    else:
        return None
    if w is None or w.ndim != 2:
        return None
    return n.inputs[0], w.astype(np.float32)


def _fuse_shared_expert(graph: ir.Graph, routed_out: ir.Value, prefix: str,
                        weight_layout: str = EKN, proven: Iterable[tuple] = ()) -> dict | None:
    """The shared expert added to a fused routed output (Qwen2-MoE: ``routed + Sigmoid(x @ g) *
    mlp(x)``; DeepSeek: ``routed + mlp(x)``) goes through the same INT8 GEMM ops as one expert
    that every token uses: DynamicQuant -> GroupedMatmulSwigluQuant -> GroupedMatmulDequant with
    E = 1 and group_list = [T]. Only the MLP is replaced; its gate stays float.

    The match is structural and needs no probe: ``down(silu(x @ Wg) * (x @ Wu))`` with constant
    weights, one input x of rank 2, is exactly what the chain computes before quantization.
    Measured on the Qwen2-MoE fixture: logits rel. L2 vs torch 0.0053 -> 0.0085, shared weights
    98304 -> 25600 bytes.

    The routed output may reach the Add through Casts to a float type (the exporters' trace of
    ``routed.to(dtype)``) and the graph's Reshape of it back to [B, S, H] (DeepSeek-V3's
    ``.view(*orig_shape)``). The MLP's input qualifies when the graph says it is float [T, H], or
    when it is one of ``proven`` ((value, dtype, rank) triples): the router's input or the hidden
    state it reshapes, whose dtype and rank the probe runs showed (the legacy exporter records no
    shapes). An MLP over the [B, S, H] hidden state (DeepSeek-V3's ``shared_experts(residuals)``)
    runs on its Reshape to [B*S, H] and gets its output back in the input's shape.
    A float16 MLP gets its float16 output back through a Cast (GroupedMatmulDequant gives float32)."""
    proven = list(proven)
    adds = []  # (consumer, the routed value it reads)
    frontier = [routed_out]
    for _ in range(3):
        nxt = []
        for v in frontier:
            for n in _consumers(v):
                if n.op_type == "Cast" and attr_int(n, "to", 0) in _FLOAT_TYPES or n.op_type == "Reshape":
                    nxt.append(n.outputs[0])
                else:
                    adds.append((n, v))
        frontier = nxt
    for add, routed in adds:
        if add.op_type != "Add" or len(add.inputs) != 2:
            continue
        s = add.inputs[1] if add.inputs[0] is routed else add.inputs[0]
        mlp_out = s
        p = s.producer()
        if p is not None and p.op_type == "Mul":
            a, b = p.inputs
            pa, pb = a.producer(), b.producer()
            if pa is not None and pa.op_type == "Sigmoid":
                mlp_out = b
            elif pb is not None and pb.op_type == "Sigmoid":
                mlp_out = a
        down = _dense_projection(mlp_out)
        if down is None:
            continue
        prod, wd = down
        m = prod.producer()
        if m is None or m.op_type != "Mul":
            continue
        for silu_v, up_v in (tuple(m.inputs), tuple(m.inputs)[::-1]):
            sn = silu_v.producer()
            if sn is None or sn.op_type != "Mul":
                continue
            g = next((i for i in sn.inputs if (i.producer() is not None and i.producer().op_type == "Sigmoid"
                      and i.producer().inputs[0] in sn.inputs)), None)
            if g is None:
                continue
            gate_v = g.producer().inputs[0]
            gp, up = _dense_projection(gate_v), _dense_projection(up_v)
            if gp is None or up is None or gp[0] is not up[0]:
                continue
            x, wg = gp
            wu = up[1]
            x_dtype, rank = next(((dt, r) for v, dt, r in proven if v is x), (None, None))
            if x_dtype is None and x.shape is not None and len(x.shape) >= 2:
                x_dtype, rank = x.dtype, len(x.shape)
            if x_dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16) or wu.shape != wg.shape or \
                    wd.shape != (wg.shape[1], wg.shape[0]):
                continue
            return _emit_shared(graph, prefix, x, wg, wu, wd, mlp_out, weight_layout, x_dtype, rank)
    return None


def _emit_shared(graph, prefix, x, wg, wu, wd, mlp_out, weight_layout: str = EKN,
                 x_dtype=ir.DataType.FLOAT, rank: int = 2) -> dict:

    gu_q, gu_s = quantize_expert_weights(np.concatenate([wg, wu], axis=1)[None])
    gu_q, gu_attrs = _swiglu_weight(gu_q, weight_layout)
    dn_q, dn_s = quantize_expert_weights(wd[None])
    dn_q, dn_attrs = _down_weight(dn_q, weight_layout)
    inits = [initializer(graph, f"{prefix}/{n}", a) for n, a in
             [("gate_up_int8", gu_q), ("gate_up_scale", gu_s), ("down_int8", dn_q), ("down_scale", dn_s)]]
    nodes = []

    def add(op, inputs, num_outputs=1, domain=DOMAIN, **attrs):
        # The first node of each op type keeps the plain name; the reshapes of a rank-3 MLP's input
        # and output repeat Reshape and Shape, so later ones get a suffix.
        name = f"{prefix}/{op}" + "".join(f"_{k}" for k in [sum(m.op_type == op for m in nodes)] if k)
        n = ir.node(op, inputs, attrs or None, domain=domain, num_outputs=num_outputs, name=name)
        for j, o in enumerate(n.outputs):
            o.name = f"{name}_{j}"
        nodes.append(n)
        return n.outputs

    x_in = x
    if rank != 2:  # [..., H] -> [T, H]: the GEMM ops take rows
        x = add("Reshape", [x, initializer(graph, f"{prefix}/shape_TH", np.array([-1, wg.shape[0]], np.int64))],
                domain="")[0]
    # group_list = [T]: one expert, every row. Made by Range(T, T + 1, 1), not by the Shape itself:
    # ORT's CUDA EP keeps a Shape output in host memory and would put a host-to-device copy node in
    # front of the ops, and a session with a copy node refuses CUDA-graph capture; Range takes its
    # start / limit / delta from host memory and writes its output on the device.
    t = add("Reshape", [add("Shape", [x], domain="", start=0, end=1)[0],
                        initializer(graph, f"{prefix}/scalar", np.array([], np.int64))], domain="")[0]
    one = initializer(graph, f"{prefix}/one", np.array(1, np.int64))
    groups = add("Range", [t, add("Add", [t, one], domain="")[0], one], domain="")[0]
    if x_dtype == ir.DataType.BFLOAT16:  # the ops take float32/float16 activations
        x = add("Cast", [x], domain="", to=int(ir.DataType.FLOAT))[0]
    xq, xs = add("DynamicQuant", [x], 2)
    hq, hs, _ = add("GroupedMatmulSwigluQuant", [xq, inits[0], inits[1], xs, groups], 3, **gu_attrs)
    y = add("GroupedMatmulDequant", [hq, inits[2], inits[3], hs, groups], **dn_attrs)[0]
    if x_dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):  # GroupedMatmulDequant's output is float32
        y = add("Cast", [y], domain="", to=int(x_dtype))[0]
    if rank != 2:  # the MLP's output has its input's shape (the down projection maps I back to H)
        y = add("Reshape", [y, add("Shape", [x_in], domain="")[0]], domain="")[0]
    graph.insert_after(mlp_out.producer(), nodes)
    _replace_value(mlp_out, y)
    return {"intermediate": wg.shape[1], "weight_bytes_before": wg.nbytes + wu.nbytes + wd.nbytes,
            "weight_bytes_after": gu_q.nbytes + gu_s.nbytes + dn_q.nbytes + dn_s.nbytes}


# ---------------------------------------------------------------------------------------------
# com.microsoft MoE


def _dequantize_qmoe(q: ir.Value, scales: ir.Value, bits: int) -> np.ndarray:
    """QMoE weights [E, out, in/pack] uint8 + scales [E, out] -> float32 [E, out, in].

    ORT's symmetric rule (checked against ORT 1.31's CPU QMoE on hand-built nodes):
    W = scale * (q - zero_point), zero point 128 for 8 bits and 8 for 4 bits, two 4-bit values
    per byte with the even element in the low nibble.
    """
    qa, sa = const_array(q), const_array(scales)
    if qa is None or sa is None:
        raise _Declined("QMoE weights or scales are not constant initializers")
    if qa.dtype != np.uint8 or qa.ndim != 3 or sa.ndim != 2 or sa.shape != qa.shape[:2]:
        raise _Declined("QMoE weights/scales are not uint8 [E, out, in/pack] with per-channel [E, out] scales "
                        "(block-wise scales are not handled)")
    if bits == 8:
        codes = qa.astype(np.float32) - 128.0
    elif bits == 4:
        codes = np.empty(qa.shape[:2] + (qa.shape[2] * 2,), np.float32)
        codes[..., 0::2] = (qa & 0x0F).astype(np.float32) - 8.0
        codes[..., 1::2] = (qa >> 4).astype(np.float32) - 8.0
    else:
        raise _Declined(f"QMoE expert_weight_bits {bits} is not 4 or 8")
    return (codes * sa.astype(np.float32)[:, :, None]).astype(np.float32)


def _contrib_weights(node: ir.Node) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I], description) of a com.microsoft MoE/QMoE.

    Handled: activation "silu" with fc3 (gate = fc1, up = fc3), and "swiglu" with interleaved
    fc1 (swiglu_fusion=1: gate = even rows, up = odd rows; ORT's CPU kernels agree) at alpha 1,
    beta 0 and no limit, where it is exactly SiLU(gate) * up."""
    a = node.attributes
    qmoe = node.op_type == "QMoE"
    ins = list(node.inputs) + [None] * 12
    if qmoe:
        fc1, fc1_s, fc1_b, fc2, fc2_s, fc2_b, fc3, fc3_s, fc3_b = ins[2:11]
        if any(v is not None for v in list(node.inputs)[11:]):
            raise _Declined("QMoE zero-point / extra inputs are not handled")
    else:
        fc1, fc1_b, fc2, fc2_b, fc3, fc3_b = ins[2:8]
    if any(b is not None for b in (fc1_b, fc2_b, fc3_b)):
        # The chain takes biases (gpt-oss's, proved by the probe in the torch forms); for these
        # nodes their layout against ORT's kernels is not verified.
        raise _Declined("expert biases of a com.microsoft MoE/QMoE node are not handled (their layout "
                        "against ORT's kernels is not verified)")
    act = a["activation_type"].as_string() if "activation_type" in a else "relu"
    if attr_int(node, "use_sparse_mixer", 0):
        raise _Declined("use_sparse_mixer routing is not expressible")
    if qmoe and not attr_int(node, "normalize_routing_weights", 0):
        # The contrib spec says the top-k weights are then left unnormalized, but ORT 1.31's CPU
        # QMoE renormalizes them anyway (its MoE does not): which one the model means is unknown.
        raise _Declined("QMoE with normalize_routing_weights=0 is ambiguous (ORT's CPU QMoE "
                        "renormalizes regardless)")
    if qmoe and attr_int(node, "block_size", 0) > 0:
        raise _Declined("block-wise QMoE scales are not handled")
    fusion = attr_int(node, "swiglu_fusion", 0)
    bits = attr_int(node, "expert_weight_bits", 4)

    def weights(v, s):
        if v is None:
            return None
        if qmoe:
            return _dequantize_qmoe(v, s, bits)
        w = const_array(v)
        if w is None:
            raise _Declined("expert weights are not constant initializers")
        return w.astype(np.float32)

    w1, w2 = weights(fc1, fc1_s if qmoe else None), weights(fc2, fc2_s if qmoe else None)
    if act == "silu" and fc3 is not None and fusion == 0:
        w3 = weights(fc3, fc3_s if qmoe else None)
        gate, up, desc = w1, w3, "silu(fc1) * fc3"
    elif act == "swiglu" and fusion == 1 and fc3 is None:
        alpha = a["activation_alpha"].as_float() if "activation_alpha" in a else 1.0
        beta = a["activation_beta"].as_float() if "activation_beta" in a else 0.0
        limit = a["swiglu_limit"].as_float() if "swiglu_limit" in a else float("inf")
        if alpha != 1.0 or beta != 0.0 or np.isfinite(limit):
            raise _Declined(f"swiglu with alpha {alpha}, beta {beta}, limit {limit} in a com.microsoft node is not "
                            "handled (only alpha 1, beta 0, no limit: SiLU(gate) * up)")
        gate, up, desc = w1[:, 0::2], w1[:, 1::2], "swiglu interleaved"
    elif act == "swiglu":
        raise _Declined(f"swiglu_fusion={fusion}{' with fc3' if fc3 is not None else ''}: layout not verified")
    else:
        raise _Declined(f"activation '{act}'{' without fc3' if fc3 is None else ''} is not SiLU-gated")
    e, inter, h = gate.shape
    if up.shape != gate.shape or w2.shape != (e, h, inter):
        raise _Declined(f"expert weight shapes {gate.shape}/{up.shape}/{w2.shape} are not "
                        "[E, I, H]/[E, I, H]/[E, H, I]")
    return gate, up, w2, desc + (f", {bits}-bit" if qmoe else "")


def _fuse_contrib(model: ir.Model, node: ir.Node, weight_layout: str = EKN) -> dict:
    """Replaces one com.microsoft MoE / QMoE node (weights [E, out, in], ORT >= 1.22 layout)."""
    where = node.name or node.op_type
    x, logits = node.inputs[0], node.inputs[1]
    if x.dtype not in (None, ir.DataType.FLOAT):
        raise _Declined(f"input is {x.dtype}, only float32 blocks are fused")
    gate, up, down, wdesc = _contrib_weights(node)
    e, inter, h = gate.shape
    bytes_before = sum(int(const_array(v).nbytes) for v in list(node.inputs)[2:] if v is not None)
    k = attr_int(node, "k", 1)
    graph = model.graph
    prefix = f"moe_int8/{where}"
    pre: list[ir.Node] = []

    def add(op, inputs, num_outputs=1, **attrs):
        n = ir.node(op, inputs, attrs or None, num_outputs=num_outputs, name=f"{prefix}/{op}_{len(pre)}")
        for j, o in enumerate(n.outputs):
            o.name = f"{prefix}/{op}_{len(pre)}_{j}"
        pre.append(n)
        return n.outputs

    x2 = x
    if x.shape is None or len(x.shape) != 2:
        x2 = add("Reshape", [x, initializer(graph, f"{prefix}/shape_TH", np.array([-1, h], np.int64))])[0]
    probs = add("Softmax", [logits], axis=-1)[0]
    vals, ids = add("TopK", [probs, initializer(graph, f"{prefix}/k", np.array([k], np.int64))], 2,
                    axis=-1, largest=1, sorted=1)
    wts = vals
    if attr_int(node, "normalize_routing_weights", 0):
        s = add("ReduceSum", [vals, initializer(graph, f"{prefix}/axis", np.array([-1], np.int64))], keepdims=1)[0]
        wts = add("Div", [vals, s])[0]
    nodes, out, nbytes = emit_int8_chain(graph, prefix, x2, ids, wts, gate.transpose(0, 2, 1),
                                         up.transpose(0, 2, 1), down.transpose(0, 2, 1), weight_layout)
    nodes = pre + nodes
    if x2 is not x:
        shp = ir.node("Shape", [x], name=f"{prefix}/Shape")
        rs = ir.node("Reshape", [out, shp.outputs[0]], name=f"{prefix}/Reshape")
        shp.outputs[0].name, rs.outputs[0].name = f"{prefix}/Shape_0", f"{prefix}/Reshape_0"
        nodes += [shp, rs]
        out = rs.outputs[0]
    graph.insert_after(node, nodes)
    _replace_value(node.outputs[0], out)
    return {"where": where, "form": f"com.microsoft {node.op_type} ({wdesc})", "experts": e, "top_k": k,
            "intermediate": inter, "routing": "softmax -> topk" + (" -> renormalize" if attr_int(
                node, "normalize_routing_weights", 0) else ""),
            "weight_bytes_before": bytes_before, "weight_bytes_after": nbytes}


# ---------------------------------------------------------------------------------------------


def fuse_moe(model: ir.Model, options=None) -> FusionResult:
    """Replaces every provable MoE block of ``model`` (changed in place) with the INT8 chain.

    Returns a FusionResult: ``fused`` blocks, ``declined`` candidates with reasons, and
    ``details["blocks"]``: per block its form, experts, top-k, routing and weight bytes before
    (float32) and after (int8 + float32 scales).
    """
    result = FusionResult(kind="moe")
    layout = getattr(options, "moe_weight_layout", EKN)
    check_weight_layout(layout)  # before any change to the model
    blocks_info: list[dict] = []
    graph = model.graph
    for node in list(graph):
        if node.domain == "com.microsoft" and node.op_type in ("MoE", "QMoE"):
            try:
                blocks_info.append(_fuse_contrib(model, node, layout))
                result.fused += 1
            except _Declined as e:
                result.declined.append(Decline(node.name or node.op_type, str(e)))
    if result.fused:
        model.opset_imports.setdefault(DOMAIN, OPSET_VERSION)
        RemoveUnusedNodesPass()(model)

    cands, declined = _candidates(graph)
    result.declined += declined
    bf16 = has_bfloat16(model)
    if bf16:
        # The chain's activations get Casts around them by the router input's recorded dtype; the
        # probe (on the float32 twin) shows float32 for a bfloat16 value, so it cannot tell.
        for c in [c for c in cands if c.x.dtype is None]:
            result.declined.append(Decline(c.topk.name, "a bfloat16 model whose router input has no recorded "
                                           "element type: the Casts the INT8 chain needs cannot be placed"))
            cands.remove(c)
    if cands:
        probes, probe_error = [], None
        try:
            probes = probe_candidates(model, cands)
        except Exception as e:  # the original model itself fails on a probe: nothing is provable
            probe_error = ("the original model fails on probe inputs (a 1-token or longer prompt): a graph "
                           "specialized to its example input, e.g. a trace of the experts it hit, cannot be "
                           f"fused ({str(e).splitlines()[0][:300]})")
        blocks = []
        for c in cands:
            if probe_error:
                result.declined.append(Decline(c.topk.name, probe_error))
                continue
            hit = _hit(c, probes)
            try:
                if len(hit) < c.num_experts:
                    raise _Declined(f"experts {sorted(set(range(c.num_experts)) - hit)} were never selected "
                                    "on probe inputs, so their weights cannot be verified")
                blocks.append(_analyze(model, c, probes))
            except _Declined as e:
                result.declined.append(Decline(c.topk.name, str(e)))
        shared_int8 = getattr(options, "moe_shared_expert", "int8") == "int8"
        for b in blocks:
            nbytes, out = _replace_block(model, b, layout)
            result.fused += 1
            info = {
                "where": b.cand.topk.name, "form": b.form, "experts": b.cand.num_experts,
                "top_k": b.cand.k, "intermediate": b.w.w_gate.shape[2], "routing": b.cand.routing,
                "activation": b.act.name if b.act.name == "swiglu" else
                f"{b.act.name} (alpha {b.act.alpha:g}, limit {b.act.limit:g})",
                # (a bfloat16 model's weights were read as float32: two bytes each in the model)
                "weight_bytes_before": sum(a.nbytes for a in (b.w.w_gate, b.w.w_up, b.w.w_down, b.w.b_gate,
                                                              b.w.b_up, b.w.b_down) if a is not None) // (2 if bf16 else 1),
                "weight_bytes_after": nbytes}
            # The router's input and the hidden state it reshapes: dtype and rank as the probes saw them
            # (the same rank on every probe, the last dim H); in a bfloat16 model the graph's dtype,
            # since the probe ran its float32 twin.
            proven = [(v, v.dtype if bf16 else ir.DataType.from_numpy(probes[0][v.name].dtype),
                       probes[0][v.name].ndim)
                      for v in (b.cand.x, b.cand.hidden)
                      if len({p[v.name].ndim for p in probes}) == 1 and probes[0][v.name].ndim >= 2
                      and all(p[v.name].shape[-1] == b.w.w_gate.shape[1] for p in probes)
                      and (v.dtype is not None or not bf16)]
            shared = (_fuse_shared_expert(graph, out, f"moe_int8/{b.cand.topk.name}/shared", layout,
                                          proven=proven) if shared_int8 else None)
            if shared:
                info["shared_expert"] = shared
                info["weight_bytes_before"] += shared["weight_bytes_before"]
                info["weight_bytes_after"] += shared["weight_bytes_after"]
            blocks_info.append(info)
        if blocks:
            model.opset_imports.setdefault(DOMAIN, OPSET_VERSION)
            RemoveUnusedNodesPass()(model)
    result.details["blocks"] = blocks_info
    if blocks_info:
        result.details["weight_layout"] = layout
    # For ``ort-ops rewrite``'s one-line summary: blocks per form, and the expert weight bytes.
    result.details["forms"] = dict(collections.Counter(b["form"].split(":")[0].split(" (")[0] for b in blocks_info))
    if blocks_info:
        result.details["forms"]["expert weight bytes"] = "{} -> {}".format(
            sum(b["weight_bytes_before"] for b in blocks_info), sum(b["weight_bytes_after"] for b in blocks_info))
        if layout != EKN:
            result.details["forms"]["weight layout"] = layout
    return result
