# SPDX-License-Identifier: MIT
"""A layer's attention prologue, Split -> RotaryEmbedding(Q), RotaryEmbedding(K) -> QuantizeKVCache,
as one ``ort_ops.RotaryQuantizeKVCache`` node.

Alphabet: T packed tokens of a paged step, Hq / Hkv query / key-value heads, D head dim, R rotary
width (<= D), W = (Hq + 2 * Hkv) * D.

After the attention, rotary and matmul_concat passes, each decoder layer of a paged model computes

    X [1, T, W] or [T, W]  (the joined Q/K/V projection)
    q, k, v = Split(X, [Hq*D, Hkv*D, Hkv*D], axis=-1)
    q' = RotaryEmbedding(layout(q), [0], cos, sin)      com.microsoft; cos/sin [T, R/2] per token
    k' = RotaryEmbedding(layout(k), [0], cos, sin)
    caches = QuantizeKVCache(layout(k'), layout(v), slot_mapping, caches)       [T, Hkv, D] each
    PagedAttentionInt8(layout(q') [T, Hq, D], caches, ...)

A bias Add of a constant per column on each of q, k and v (matmul_concat keeps a joined
projection's biases after its Split; Qwen2, gpt-oss) is taken as one Add of the joined biases
before the op (the same sums). ``layout`` is any chain of Reshape, Squeeze, Unsqueeze, Identity and Transpose nodes that
keeps the element order (exporters write [B, S, N, D] <-> [B, N, S, D] Transposes in pairs). This
pass replaces the Split, both rotaries, the layout chains and the QuantizeKVCache by

    query, caches = RotaryQuantizeKVCache(Reshape(X, [-1, W]), cos, sin, slot_mapping, caches)

(ort_ops domain; DESIGN.md "RotaryQuantizeKVCache"), the cache outputs keeping the QuantizeKVCache
outputs' names (the paged runtime binds the caches by name) and ``query`` [T, Hq, D] read by the
PagedAttentionInt8. Row t of cos/sin is token t's exactly when the rotaries read the caches at
offset 0 with one row of packed tokens (the paged interface's batch 1), which is what the rotary
pass builds; the pass requires the paged metadata and the constant zero offset.

A QuantizeKVCache is declined, with its reason, when any step differs: a layout chain that is
not provably order-preserving (its Transposes, taken in adjacent runs, must compose to the
identity or move only axes of static size 1), a rotary that is not com.microsoft's, rotaries of
Q and K with different caches or attributes, a Split with other sizes or axis, an intermediate
value with another reader or that is a graph output (e.g. the rotated K as a ``present``), cos/sin
not the rotary pass's [-1, R/2] per-token caches.

On by default (``RewriteOptions.rotary_kv``; ``--no-rotary-kv`` leaves the chain): on the GPU
it takes 3 kernels a layer out of a decode step (benchmarks/NOTES_generate_cuda.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from ort_ops._domain import DOMAIN, OPSET_VERSION
from ort_ops.paged_interface import PAGED_META_KEY
from ort_ops.rewrite import _graph as g
from ort_ops.rewrite.pipeline import Decline, FusionResult, RewriteOptions

MS_DOMAIN = "com.microsoft"
OP = "RotaryQuantizeKVCache"
_LAYOUT = ("Reshape", "Squeeze", "Unsqueeze", "Identity", "Transpose")
# The element types RotaryQuantizeKVCache takes (DESIGN.md).
_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


@dataclasses.dataclass
class _Block:
    qkv: ir.Node            # the QuantizeKVCache
    pa: ir.Node             # the PagedAttentionInt8 reading its caches
    split: ir.Node
    q_rot: ir.Node
    k_rot: ir.Node
    hq: int
    hkv: int
    d: int
    biases: list[ir.Node]  # the per-part bias Adds after the Split (Q, K, V), or none


def _bias(add: ir.Node) -> np.ndarray:
    """The constant operand of a bias Add ``_through_bias`` took."""
    return next(a for a in (g.const_array(i) for i in add.inputs) if a is not None)


def _through_bias(v: ir.Value) -> tuple[ir.Value, ir.Node | None]:
    """(the Split output, the Add) when ``v`` is a Split output plus a constant bias of one value
    per column (matmul_concat keeps a joined projection's biases after its Split), else (v, None)."""
    n = v.producer()
    if _is(n, "Add"):
        for i in (0, 1):
            bias = g.const_array(n.inputs[1 - i])
            x = n.inputs[i]
            if bias is not None and bias.ndim >= 1 and bias.size == bias.shape[-1] and _is(x.producer(), "Split"):
                return x, n
    return v, None


def _is(node: ir.Node | None, op_type: str, domain: str = "") -> bool:
    return (node is not None and node.op_type == op_type
            and node.domain in ({domain, "ai.onnx"} if domain == "" else {domain}))


def _walk(v: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """Follows ``v`` back through layout-only nodes: (the first value not made by one, the nodes
    passed, nearest first)."""
    chain: list[ir.Node] = []
    while True:
        n = v.producer()
        if n is None or n.domain not in ("", "ai.onnx") or n.op_type not in _LAYOUT or not n.inputs:
            return v, chain
        chain.append(n)
        v = n.inputs[0]


def _perm(node: ir.Node) -> list[int] | None:
    perm = g.attr_ints(node, "perm")
    if perm is not None:
        return perm
    r = g.rank(node.inputs[0])  # no perm: the axes reversed
    return None if r is None else list(range(r))[::-1]


def _order_reason(chain: list[ir.Node]) -> str | None:
    """Why the layout chain ``chain`` (nearest first, as ``_walk`` gives it) may change the
    element order, None when it provably keeps it. Reshape, Squeeze, Unsqueeze and Identity keep
    it by definition; each run of adjacent Transposes must compose to the identity or move only
    axes whose static size is 1."""
    nodes = chain[::-1]  # data-flow order
    i = 0
    while i < len(nodes):
        if nodes[i].op_type != "Transpose":
            i += 1
            continue
        j = i
        while j < len(nodes) and nodes[j].op_type == "Transpose":
            j += 1
        run = nodes[i:j]
        names = g.node_names(run)
        composed = None
        for t in run:  # out[a] = in[perm[a]]: perm then perm2 reads in[perm[perm2[a]]]
            p = _perm(t)
            if p is None or (composed is not None and len(p) != len(composed)):
                return f"Transpose {t.name or ''} has no perm and an input of unknown rank"
            composed = p if composed is None else [composed[a] for a in p]
        if composed != sorted(composed):
            x = run[0].inputs[0]
            # Moving axes of size 1 keeps the order: the other axes must stay in order.
            moved = [a for a in composed if g.dim(x, a) != 1]
            if moved != sorted(moved):
                return (f"Transpose(s) {names} permute the axes by {composed} (input shape "
                        f"{x.shape}): the element order may change")
        i = j
    return None


def _heads(v: ir.Value) -> tuple[int, int] | None:
    """(heads, head dim) of a [T, H, D] value: its static dims, or its Reshape's constant."""
    if g.rank(v) == 3 and g.dim(v, 1) is not None and g.dim(v, 2) is not None:
        return g.dim(v, 1), g.dim(v, 2)
    n = g.producer(v, "Reshape")
    shape = g.const_array(n.inputs[1]) if n is not None and len(n.inputs) > 1 else None
    if shape is not None and shape.size == 3 and shape[1] > 0 and shape[2] > 0:
        return int(shape[1]), int(shape[2])
    return None


def _split_reason(split: ir.Node, sizes: list[int]) -> str | None:
    if len(split.outputs) != 3:
        return f"Split has {len(split.outputs)} outputs, not 3"
    x = split.inputs[0]
    r = g.rank(x)
    got, why = g.last_axis_split(split)
    if why:
        return why
    if got is None and g.dim(x, -1) is not None and g.dim(x, -1) % 3 == 0:  # three equal parts
        got = [g.dim(x, -1) // 3] * 3
    if got != sizes:
        return f"Split sizes {got} are not [Hq*D, Hkv*D, Hkv*D] = {sizes}"
    if r is not None and r not in (2, 3):
        return f"the joined projection has rank {r}, not [T, W] or [1, T, W]"
    if r == 3 and g.dim(x, 0) not in (1, None):
        return f"the joined projection's batch is {g.dim(x, 0)}, not 1"
    return None


def _half(cache: ir.Value) -> int | None:
    """R/2 of a per-token cos/sin cache: the rotary pass's Reshape(., [-1, R/2])."""
    n = g.producer(cache, "Reshape")
    shape = g.const_array(n.inputs[1]) if n is not None and len(n.inputs) > 1 else None
    if shape is None or shape.size != 2 or int(shape[0]) != -1 or int(shape[1]) <= 0:
        return None
    return int(shape[1])


def _zero_offset(v: ir.Value | None) -> bool:
    arr = g.const_array(v)
    return arr is not None and arr.size == 1 and arr.ndim <= 1 and int(arr.reshape(())) == 0


def _rank3(v: ir.Value) -> bool:
    """True when ``v`` is known to be 3-D ([B, S, N*D]: RotaryEmbedding's token-major layout)."""
    if g.rank(v) is not None:
        return g.rank(v) == 3
    n = g.producer(v, "Reshape")
    shape = g.const_array(n.inputs[1]) if n is not None and len(n.inputs) > 1 else None
    return shape is not None and shape.size == 3


def _rotary_reason(q_rot: ir.Node, k_rot: ir.Node, hq: int, hkv: int, d: int) -> str | None:
    if q_rot.inputs[2] is not k_rot.inputs[2] or q_rot.inputs[3] is not k_rot.inputs[3]:
        return "the rotaries of Q and K read different cos/sin caches"
    for name in ("interleaved", "rotary_embedding_dim", "is_packed_batching"):
        if g.attr_int(q_rot, name, 0) != g.attr_int(k_rot, name, 0):
            return f"the rotaries of Q and K differ in '{name}'"
    if g.attr_int(q_rot, "is_packed_batching", 0):
        return "the rotaries use packed batching"
    for rot, heads in ((q_rot, hq), (k_rot, hkv)):
        scale = rot.attributes.get("scale")
        if scale is not None and float(scale.value) != 1.0:
            return f"RotaryEmbedding {rot.name} has scale {float(scale.value)}, not 1"
        if g.attr_int(rot, "num_heads", 0) not in (0, heads):
            return f"RotaryEmbedding {rot.name} has num_heads {g.attr_int(rot, 'num_heads')}, not {heads}"
        if not _zero_offset(rot.inputs[1]):
            return f"RotaryEmbedding {rot.name}'s position input is not the constant zero offset"
        if not _rank3(rot.inputs[0]):
            return f"RotaryEmbedding {rot.name}'s input is not known to be 3-D [B, S, N*D]"
    halves = [_half(v) for v in q_rot.inputs[2:4]]
    if None in halves or halves[0] != halves[1]:
        return "cos/sin are not per-token caches Reshape'd to [-1, R/2] (the rotary pass's)"
    width = 2 * halves[0]
    dim = g.attr_int(q_rot, "rotary_embedding_dim", 0)
    if width > d or (dim or d) != width:
        return f"rotary width {width} (cos/sin [T, {halves[0]}]) does not fit head dim {d}" + (
            f" with rotary_embedding_dim {dim}" if dim else "")
    return None


def _match(qkv: ir.Node) -> _Block | str:
    """The block ending at QuantizeKVCache ``qkv`` (module docstring), or why there is none."""
    key, value = qkv.inputs[0], qkv.inputs[1]
    k_out, k_chain = _walk(key)
    k_rot = k_out.producer()
    if not _is(k_rot, "RotaryEmbedding", MS_DOMAIN):
        what = "a graph input" if k_rot is None else f"{k_rot.domain or 'ai.onnx'} {k_rot.op_type}"
        return f"the key input reaches {what}, not a com.microsoft RotaryEmbedding, through layout-only nodes"
    k_in, k_in_chain = _walk(k_rot.inputs[0])
    k_in, k_bias = _through_bias(k_in)
    split = k_in.producer()
    if not _is(split, "Split") or len(split.outputs) < 2 or split.outputs[1] is not k_in:
        what = "a graph input" if split is None else f"{split.op_type} output {list(split.outputs).index(k_in)}"
        return f"the rotated key's input reaches {what}, not output 1 of a Split, through layout-only nodes"
    v_in, v_chain = _walk(value)
    v_in, v_bias = _through_bias(v_in)
    if len(split.outputs) < 3 or v_in is not split.outputs[2]:
        return "the value input is not output 2 of the key's Split (through layout-only nodes)"
    pas = [u.node for u in qkv.outputs[0].uses() if _is(u.node, "PagedAttentionInt8", DOMAIN)]
    if len(pas) != 1 or list(pas[0].inputs[1:5]) != list(qkv.outputs):
        return f"{len(pas)} PagedAttentionInt8 node(s) read the caches as written (one expected)"
    pa = pas[0]
    q_out, q_chain = _walk(pa.inputs[0])
    q_rot = q_out.producer()
    if not _is(q_rot, "RotaryEmbedding", MS_DOMAIN):
        return "the attention's query does not reach a com.microsoft RotaryEmbedding through layout-only nodes"
    q_in, q_in_chain = _walk(q_rot.inputs[0])
    q_in, q_bias = _through_bias(q_in)
    if q_in is not split.outputs[0]:
        return "the rotated query's input is not output 0 of the key's Split (through layout-only nodes)"
    for chain, what in ((k_chain, "rotated key"), (k_in_chain, "key"), (v_chain, "value"),
                        (q_chain, "rotated query"), (q_in_chain, "query")):
        why = _order_reason(chain)
        if why:
            return f"{what} layout: {why}"
    kv, vv, qv = _heads(key), _heads(value), _heads(pa.inputs[0])
    if kv is None or vv is None or qv is None:
        return "the key, value or query is not known to be [T, H, D] (static dims or a Reshape constant)"
    if kv != vv or qv[1] != kv[1]:
        return f"key {kv}, value {vv} and query {qv} (heads, head dim) do not agree"
    (hkv, d), hq = kv, qv[0]
    if hq % hkv:
        return f"{hq} query heads are not a multiple of {hkv} kv heads"
    sizes = [hq * d, hkv * d, hkv * d]
    why = _split_reason(split, sizes) or _rotary_reason(q_rot, k_rot, hq, hkv, d)
    if why:
        return why
    biases = [q_bias, k_bias, v_bias]
    if any(biases):
        if not all(biases):
            return "a bias Add after the Split on some of Q, K, V only"
        for add, width in zip(biases, sizes):
            if _bias(add).size != width:
                return f"bias Add {add.name} adds {_bias(add).size} values to a part of {width} columns"
    inner = [*split.outputs, *(o for n in (*k_chain, *k_in_chain, *v_chain, *q_chain, *q_in_chain, k_rot, q_rot,
                                           *(b for b in biases if b is not None))
                               for o in n.outputs)]
    for v in inner:
        if v.is_graph_output() or len(list(v.uses())) != 1:
            return f"intermediate value '{v.name}' has another reader or is a graph output"
    dt = g.element_type(split.inputs[0])
    if dt not in _TYPES:
        return f"element type {dt} is not float32 or float16 (RotaryQuantizeKVCache's types)"
    return _Block(qkv, pa, split, q_rot, k_rot, hq, hkv, d, biases if any(biases) else [])


def _replace(graph: ir.Graph, b: _Block, index: int, shapes: dict[int, ir.Value]) -> None:
    """Puts the fused node where the QuantizeKVCache was (X, cos/sin and the caches exist there;
    the attention reads it later) and removes what only the old block read."""
    x = b.split.inputs[0]
    width = (b.hq + 2 * b.hkv) * b.d
    base = b.qkv.name or f"rotary_kv_{index}"
    new_nodes = []
    if b.biases:  # the three parts' biases as one Add of the joined projection: the same sums
        dtype = g.element_type(x)
        joined = np.concatenate([_bias(a).reshape(-1) for a in b.biases]).astype(dtype.numpy())
        add = ir.node("Add", [x, g.initializer(graph, f"{base}_qkv_bias", joined)], name=f"{base}_qkv_bias_add")
        add.outputs[0].name, add.outputs[0].dtype = f"{base}_qkv_biased", dtype
        new_nodes.append(add)
        x = add.outputs[0]
    if width not in shapes:
        shapes[width] = g.initializer(graph, f"rotary_kv_qkv_shape_{width}", np.array([-1, width], np.int64))
    flat = ir.node("Reshape", [x, shapes[width]], name=f"{base}_qkv_2d")
    flat.outputs[0].name, flat.outputs[0].dtype = f"{base}_qkv_2d", g.element_type(x)
    cos, sin = b.q_rot.inputs[2], b.q_rot.inputs[3]
    node = ir.node(OP, [flat.outputs[0], cos, sin, *b.qkv.inputs[2:7]],
                   attributes={"num_heads": b.hq, "kv_num_heads": b.hkv,
                               "interleaved": g.attr_int(b.q_rot, "interleaved", 0)},
                   domain=DOMAIN, num_outputs=5, name=f"{base}_rotary")
    query = node.outputs[0]
    query.name, query.dtype = f"{base}_rotary_query", g.element_type(x)
    query.shape = ir.Shape([None, b.hq, b.d])
    graph.insert_before(b.qkv, [*new_nodes, flat, node])
    old_query = b.pa.inputs[0]
    # query is [T, Hq, D], the shape _heads read PA's query as: it is read directly.
    b.pa.replace_input_with(0, query)
    names = [o.name for o in b.qkv.outputs]
    for old, new, cache in zip(b.qkv.outputs, node.outputs[1:], b.qkv.inputs[3:7]):
        # Each output is its cache input, updated in place: that input's type and shape where
        # the old output has none (a graph output without a type fails onnx.checker).
        new.type, new.shape = old.type or cache.type, old.shape or cache.shape
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    orphans = [*b.qkv.inputs[:2], old_query]
    graph.remove(b.qkv, safe=True)
    for new, name in zip(node.outputs[1:], names):
        new.name = name  # the runtime binds the caches by these names
    g.sweep(graph, orphans)


def fuse_rotary_kv(model: ir.Model, options: RewriteOptions) -> FusionResult:
    """Replaces each layer's Split + two rotaries + QuantizeKVCache (module docstring) by one
    RotaryQuantizeKVCache.

    Returns:
        FusionResult(kind="rotary_kv"): fused = blocks replaced; declines with reasons;
        details {"nodes_removed": nodes fewer in the graph}.
    """
    result = FusionResult(kind="rotary_kv")
    graph = model.graph
    before = len(graph)
    candidates = [n for n in graph if _is(n, "QuantizeKVCache", DOMAIN)]
    if candidates and PAGED_META_KEY not in model.metadata_props:
        result.declined.append(Decline(g.node_names(candidates[:4]), (
            "not a paged model: the cos/sin rows are token rows only with the paged interface's "
            "one row of packed tokens")))
        candidates = []
    blocks = []
    splits: set[int] = set()
    for qkv in candidates:
        b = _match(qkv)
        if not isinstance(b, str) and id(b.split) in splits:  # each Split's chain is replaced once
            b = "another QuantizeKVCache's block reads the same Split"
        if isinstance(b, str):
            result.declined.append(Decline(qkv.name or qkv.op_type, b))
        else:
            blocks.append(b)
            splits.add(id(b.split))
    shapes: dict[int, ir.Value] = {}
    for i, b in enumerate(blocks):
        _replace(graph, b, i, shapes)
        result.fused += 1
    if result.fused:
        model.opset_imports.setdefault(DOMAIN, OPSET_VERSION)
    result.details["nodes_removed"] = before - len(graph)
    return result
