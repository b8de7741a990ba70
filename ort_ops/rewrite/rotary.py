# SPDX-License-Identifier: MIT
"""Rotary position embedding (RoPE) chains as one ``com.microsoft`` ``RotaryEmbedding`` node.

Alphabet: B batch, S tokens, N heads, D head dim, h = D / 2, T packed tokens of a paged step.

Exporters write RoPE per Q and per K of every layer as elementwise nodes on the [B, N, S, D]
tensor ``x = Transpose(y, perm=[0, 2, 1, 3])`` (y [B, S, N, D], the projection reshaped), with
``cos``/``sin`` [1, 1, S, W] computed once per step from the positions:

    rotate_half (Llama, Mistral, Qwen, Gemma; torch.onnx dynamo, TorchScript, transformers):
        x1, x2 = Slice(x, 0:h), Slice(x, h:)      (either may be a Split into two halves)
        out = Add(Mul(x, cos), Mul(Concat(Neg(x2), x1), sin))          W = D
    halves (gpt-oss):
        x1, x2 = Split(x) (or the two Slices)
        out = Concat(Sub(Mul(x1, cos), Mul(x2, sin)), Add(Mul(x2, cos), Mul(x1, sin)))   W = h

Mul and Add operands in either order. That is 7 or 8 kernels each, 14-16 a layer. ORT's
``RotaryEmbedding`` (CPU: float, float16; CUDA: float, float16, bfloat16) computes, for token s of
its input at position p(s) and c = cos_cache[p(s)], t = sin_cache[p(s)] (rows of h values):

    out[i] = x[i] * c[i] - x[i + h] * t[i]          i < h
    out[i] = x[i] * c[i - h] + x[i - h] * t[i - h]  i >= h          (interleaved = 0)

which is the chain above exactly when the chain's cos and sin have equal halves
(cos[..., :h] == cos[..., h:], same for sin; the halves form has only h values). The exporters
build them as ``f(Concat(freqs, freqs))`` with f elementwise (Cos/Sin, Cast, a scalar scale), so
the halves are equal by construction; a chain is taken only when that construction is seen.

The replacement keeps the exporter's per-token cos/sin (its exact numerics, no maximum position):

    cos_cache = Reshape(Slice(cos_tok, 0:h on the last axis), [-1, h])   [S, h]  (no Slice for halves)
    out = Transpose(Reshape(RotaryEmbedding(Reshape(y, [0, 0, -1]), [0], cos_cache, sin_cache),
                            [0, 0, -1, D]), perm=[0, 2, 1, 3])

``cos_tok`` is the cos value below its Unsqueezes (shared by every layer), the caches are made
once per distinct value, and position_ids is the constant [0]: of shape [1] it is an offset, token
s reads cache row 0 + s. The op takes the 3-D [B, S, N*D] layout (before the exporter's Transpose;
both ORT's CPU and CUDA kernels take it), and a reader of ``out`` that is the inverse
Transpose (the paged attention's) reads the [B, S, N, D] result directly: the two Transposes of
each Q and K go too. A Shape reader (TorchScript's) reads the result's shape permuted; any other
reader keeps a Transpose.

Row s of the cache is token s only when cos/sin have one row of positions ([1, 1, S, W]: batch 1),
which holds in paged models (``input_ids``/``position_ids`` [1, T], all sequences packed in one
row) and is checked there: the part of the graph that computes cos and sin runs on position_ids of
two lengths T and must give [1, 1, T, W]. Models without the paged metadata are left alone (their
batch rows have positions of their own, which one offset cannot express). A chain is declined
when it differs in any step, when an intermediate value has another reader or is a graph output,
or when x is not the Transpose above.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from ort_ops.paged_interface import PAGED_META_KEY
from ort_ops.rewrite import _graph as g
from ort_ops.rewrite.pipeline import Decline, FusionResult, RewriteOptions

MS_DOMAIN = "com.microsoft"
# The element types ORT's RotaryEmbedding has a kernel for (bfloat16: the CUDA provider's only;
# onnxruntime's CPU provider runs no bfloat16 model anyway: it has no bfloat16 MatMul).
_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_BNSH = (0, 2, 1, 3)  # [B, S, N, D] <-> [B, N, S, D]; its own inverse
# Token counts the cos/sin plumbing is probed at (two: a size equal on both is structural).
PROBE_TOKENS = (3, 5)
# Elementwise ops that keep equal halves equal: unary ones, and binary ones with a scalar constant.
_UNARY = ("Cos", "Sin", "Cast", "Identity", "Neg")
_SCALAR_BINARY = ("Mul", "Div", "Add", "Sub")
_INT_MAX = 2 ** 62  # a Slice end past this is "to the end of the axis"


@dataclasses.dataclass
class _Rope:
    form: str             # "rotate_half" | "halves"
    x: ir.Value           # [B, N, S, D]
    y: ir.Value           # [B, S, N, D], x = Transpose(y, _BNSH)
    half: int             # h
    cos: ir.Value         # the value multiplying x (rotate_half) or x1 (halves): [1, 1, S, W]
    sin: ir.Value
    chain: list[ir.Node]  # the nodes the op replaces
    out: ir.Value
    dtype: ir.DataType | None = None


# --- small integer graphs (the Slice bounds TorchScript computes from Shape) ----------------------


def _ints(v: ir.Value | None, depth: int = 0) -> np.ndarray | None:
    """An int64 value as an object array of ints and None (unknown), when it is a constant or a
    small integer computation over constants and the static dims of Shape nodes; else None."""
    if v is None or depth > 12:
        return None
    c = g.const_array(v)
    if c is not None:
        return np.asarray(c).astype(np.int64).astype(object) if np.issubdtype(np.asarray(c).dtype, np.integer) else None
    n = v.producer()
    if n is None or n.domain not in ("", "ai.onnx"):
        return None
    op = n.op_type
    if op == "Shape":
        src = n.inputs[0]
        if src is None or src.shape is None:
            return None
        dims = [g.dim(src, i) for i in range(src.shape.rank())]
        start, end = g.attr_int(n, "start", 0), g.attr_int(n, "end", None)
        return np.array(dims[start:end] if end is not None else dims[start:], dtype=object)
    if op == "Cast":
        to = ir.DataType(g.attr_int(n, "to"))
        if to not in (ir.DataType.INT64, ir.DataType.INT32):
            return None
        return _ints(n.inputs[0], depth + 1)
    if op == "Identity":
        return _ints(n.inputs[0], depth + 1)
    ins = [_ints(i, depth + 1) for i in n.inputs]
    if any(i is None for i in ins):
        return None
    if op in ("Unsqueeze", "Squeeze"):
        return ins[0].reshape(-1) if op == "Unsqueeze" else ins[0].reshape(())
    if op == "Gather" and g.attr_int(n, "axis", 0) == 0 and ins[0].ndim == 1:
        idx = ins[1]
        if any(i is None for i in idx.reshape(-1)):
            return None
        return np.take(ins[0], idx.astype(np.int64))
    if op == "Concat" and all(i.ndim == 1 for i in ins):
        return np.concatenate(ins)
    if op in ("Add", "Sub", "Mul", "Div") and len(ins) == 2:
        a, b = np.broadcast_arrays(ins[0], ins[1])
        out = np.empty(a.shape, dtype=object)
        for idx in np.ndindex(a.shape):
            p, q = a[idx], b[idx]
            if p is None or q is None or (op == "Div" and q == 0):
                out[idx] = None
            elif op == "Div":  # integer Div truncates toward zero
                out[idx] = int(abs(p) // abs(q)) * (1 if (p >= 0) == (q >= 0) else -1)
            else:
                out[idx] = {"Add": p + q, "Sub": p - q, "Mul": p * q}[op]
        return out
    return None


def _known(arr: np.ndarray | None) -> list[int] | None:
    if arr is None or any(a is None for a in arr.reshape(-1)):
        return None
    return [int(a) for a in arr.reshape(-1)]


# --- the chain ------------------------------------------------------------------------------------


def _readers(value: ir.Value) -> list[ir.Node]:
    return list(dict.fromkeys(u.node for u in value.uses()))


def _producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    p = value.producer() if value is not None else None
    return p if p is not None and p.op_type in op_types and p.domain in ("", "ai.onnx") else None


def _mul_by(node: ir.Node | None, value: ir.Value) -> ir.Value | None:
    """The other operand of Mul ``node`` when one operand is ``value``."""
    if node is None or node.op_type != "Mul" or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is value and b is not value:
        return b
    if b is value and a is not value:
        return a
    return None


def _last_axis(axis: int, rank: int) -> bool:
    return axis == -1 or axis == rank - 1


def _concat_last(n: ir.Node) -> bool:
    """Concat ``n`` joins along the last axis (rank 4 when its output's rank is not annotated:
    the chains' tensors are [B, N, S, D])."""
    return _last_axis(g.attr_int(n, "axis", 0), g.rank(n.outputs[0]) or 4)


def _part(v: ir.Value, rank: int) -> tuple[ir.Value, int, int, ir.Node] | None:
    """(source, start, end, node) when ``v`` is a Slice (step 1) or a Split output along the last
    axis of a rank-``rank`` source; end may be _INT_MAX (to the end of the axis)."""
    n = v.producer()
    if n is None or n.domain not in ("", "ai.onnx"):
        return None
    if n.op_type == "Slice" and len(n.inputs) >= 4:
        starts, ends, axes = (_known(_ints(i)) for i in n.inputs[1:4])
        steps = _known(_ints(n.inputs[4])) if len(n.inputs) > 4 and n.inputs[4] is not None else [1]
        if not (starts and ends and axes and steps) or not len(starts) == len(ends) == len(axes) == len(steps) == 1:
            return None
        if not _last_axis(axes[0], rank) or steps[0] != 1 or starts[0] < 0:
            return None
        return n.inputs[0], starts[0], min(ends[0], _INT_MAX), n
    if n.op_type == "Split" and len(n.outputs) == 2:
        if not _last_axis(g.attr_int(n, "axis", 0), rank):
            return None
        sizes = _known(_ints(n.inputs[1])) if len(n.inputs) > 1 and n.inputs[1] is not None else g.attr_ints(n, "split")
        k = list(n.outputs).index(v)
        if sizes is None:  # two equal parts of a static last dim
            d = g.dim(n.inputs[0], -1)
            if d is None or d % 2:
                return None
            sizes = [d // 2, d // 2]
        if len(sizes) != 2:
            return None
        return n.inputs[0], sum(sizes[:k]), sum(sizes[:k + 1]), n
    return None


def _halves(first: ir.Value, second: ir.Value) -> tuple[ir.Value, int, list[ir.Node]] | None:
    """(x, h, slicing nodes) when ``first`` = x[..., :h] and ``second`` = x[..., h:] of a rank-4 x."""
    a, b = _part(first, 4), _part(second, 4)
    if a is None or b is None or a[0] is not b[0]:
        return None
    x, h = a[0], a[2]
    if a[1] != 0 or b[1] != h or h <= 0 or b[2] < 2 * h:
        return None
    return x, h, list(dict.fromkeys([a[3], b[3]]))


def _match_rotate_half(cat: ir.Node) -> tuple[_Rope | None, str]:
    neg = _producer(cat.inputs[0], "Neg")
    if neg is None or len(cat.inputs) != 2:
        return None, "not Concat(Neg(x2), x1)"
    found = _halves(cat.inputs[1], neg.inputs[0])
    if found is None:
        return None, "the rotated halves are not x[..., :h] and x[..., h:] of one tensor (Slice/Split on the last axis)"
    x, h, parts = found
    rot = cat.outputs[0]
    mul_s = g.only_reader(rot, "Mul")
    sin = _mul_by(mul_s, rot)
    add = g.only_reader(mul_s.outputs[0], "Add") if mul_s is not None else None
    if sin is None or add is None or len(add.inputs) != 2:
        return None, "Concat(Neg(x2), x1) is not read once by Mul(., sin) read once by Add"
    other = add.inputs[1] if add.inputs[0] is mul_s.outputs[0] else add.inputs[0]
    mul_c = _producer(other, "Mul")
    cos = _mul_by(mul_c, x)
    if cos is None or other is mul_s.outputs[0]:
        return None, "the Add's other operand is not Mul(x, cos) of the same x"
    if len(list(other.uses())) != 1 or other.is_graph_output():
        return None, "Mul(x, cos) has other readers"
    for v in (cat.inputs[1], neg.inputs[0], neg.outputs[0]):
        if len(list(v.uses())) != 1 or v.is_graph_output():
            return None, f"intermediate value '{v.name}' has other readers"
    chain = [*parts, neg, cat, mul_s, mul_c, add]
    return _Rope("rotate_half", x, x, h, cos, sin, chain, add.outputs[0]), ""


def _match_halves(cat: ir.Node) -> tuple[_Rope | None, str]:
    sub, add = _producer(cat.inputs[0], "Sub"), _producer(cat.inputs[1], "Add")
    if sub is None or add is None or len(cat.inputs) != 2:
        return None, "not Concat(Sub(...), Add(...))"
    m1, m2 = _producer(sub.inputs[0], "Mul"), _producer(sub.inputs[1], "Mul")
    if m1 is None or m2 is None:
        return None, "the Sub's operands are not two Muls"
    # Sub(x1 * cos, x2 * sin): find x1, x2 among the first Mul's operands by the halves they are.
    for x1, cos in ((m1.inputs[0], m1.inputs[1]), (m1.inputs[1], m1.inputs[0])):
        for x2, sin in ((m2.inputs[0], m2.inputs[1]), (m2.inputs[1], m2.inputs[0])):
            found = _halves(x1, x2)
            if found is not None:
                break
        if found is not None:
            break
    else:
        return None, "the Sub's Muls do not read x[..., :h] and x[..., h:] of one tensor"
    x, h, parts = found
    a, b = (_producer(i, "Mul") for i in add.inputs)
    if a is None or b is None:
        return None, "the Add's operands are not two Muls"
    if _mul_by(a, x2) is not cos or _mul_by(b, x1) is not sin:
        a, b = b, a
    if _mul_by(a, x2) is not cos or _mul_by(b, x1) is not sin:
        return None, "the Add is not x2 * cos + x1 * sin with the Sub's cos and sin"
    muls = [m1, m2, a, b]
    if any(len(list(m.outputs[0].uses())) != 1 or m.outputs[0].is_graph_output() for m in muls):
        return None, "a product has other readers"
    for v in (sub.outputs[0], add.outputs[0]):
        if len(list(v.uses())) != 1 or v.is_graph_output():
            return None, f"intermediate value '{v.name}' has other readers"
    for v in (x1, x2):
        if {u.node for u in v.uses()} - set(muls) or v.is_graph_output():
            return None, f"intermediate value '{v.name}' has other readers"
    chain = [*parts, *muls, sub, add, cat]
    return _Rope("halves", x, x, h, cos, sin, chain, cat.outputs[0]), ""


def _equal_halves(v: ir.Value, h: int) -> tuple[ir.Value | None, str]:
    """The per-token value under ``v``'s Unsqueezes when ``v`` = f(Concat(t, t)) on the last axis
    (f elementwise: _UNARY ops and _SCALAR_BINARY ops with a scalar constant), else (None, why)."""
    tok = None
    seen = 0
    while seen < 16:
        seen += 1
        n = v.producer()
        if n is None or n.domain not in ("", "ai.onnx"):
            break
        if n.op_type == "Unsqueeze":
            axes = _known(_ints(n.inputs[1])) if len(n.inputs) > 1 else g.attr_ints(n, "axes")
            r = g.rank(n.outputs[0])
            if axes is None or any(a == -1 or (r is not None and a == r - 1) for a in axes):
                return None, f"'{v.name}' is an Unsqueeze that may add the last axis"
            v = n.inputs[0]
            continue
        if tok is None:
            tok = v  # the shared value the caches are sliced from
        if n.op_type in _UNARY:
            if n.op_type == "Cast" and ir.DataType(g.attr_int(n, "to")) not in _TYPES:
                break
            v = n.inputs[0]
            continue
        if n.op_type in _SCALAR_BINARY and len(n.inputs) == 2:
            consts = [g.const_array(i) for i in n.inputs]
            scalar = [c is not None and c.size == 1 for c in consts]
            if scalar[0] != scalar[1] and (consts[0] is None) != (consts[1] is None):
                v = n.inputs[0] if scalar[1] else n.inputs[1]
                continue
            break
        if n.op_type == "Concat" and len(n.inputs) == 2 and n.inputs[0] is n.inputs[1] and _concat_last(n):
            d = g.dim(n.inputs[0], -1)
            if d is not None and d != h:
                return None, f"'{n.name}' concatenates halves of {d} values, not {h}"
            return tok, ""
        break
    return None, (f"cos/sin '{v.name}' is not built as f(Concat(t, t)) on the last axis with f elementwise "
                  "(its halves may differ)")


def _per_token(v: ir.Value) -> ir.Value:
    """``v`` below the Unsqueezes that put its batch/head axes in front (same elements, same order)."""
    while (n := _producer(v, "Unsqueeze")) is not None:
        v = n.inputs[0]
    return v


def _head_dim(x: ir.Value, y: ir.Value) -> int | None:
    """D from the static last dim of x or y, or from the constant target of the Reshape making y."""
    for v in (x, y):
        d = g.dim(v, -1)
        if d is not None:
            return d
    r = _producer(y, "Reshape")
    target = _known(_ints(r.inputs[1])) if r is not None else None
    return target[-1] if target and target[-1] > 0 else None


def _check(rope: _Rope) -> str:
    """Why ``rope`` cannot become RotaryEmbedding ("" when it can); fills rope.y."""
    t = _producer(rope.x, "Transpose")
    if t is None or tuple(g.attr_ints(t, "perm") or ()) != _BNSH:
        return "the rotated tensor is not Transpose(perm=[0, 2, 1, 3]) of a [B, S, N, D] tensor"
    rope.y = t.inputs[0]
    d = _head_dim(rope.x, rope.y)
    if d is None:
        return "the head dim is not static"
    if d != 2 * rope.half:
        return f"the chain rotates {2 * rope.half} of {d} head dims (partial rotary)"
    dt = rope.dtype = g.element_type(rope.x)
    if dt not in _TYPES:
        return f"element type {dt} (RotaryEmbedding has float, float16 and bfloat16 kernels)"
    for v in (rope.cos, rope.sin):
        if g.element_type(v) != dt:
            return f"'{v.name}' is {g.element_type(v)}, the rotated tensor {dt}"
    if rope.out.is_graph_output():
        return "the rotated tensor is a graph output"
    if rope.form == "rotate_half":
        for v in (rope.cos, rope.sin):
            tok, why = _equal_halves(v, rope.half)
            if tok is None:
                return why
    elif rope.cos is rope.sin:
        return "cos and sin are the same value"
    return ""


# --- the probe of the cos/sin plumbing ------------------------------------------------------------


def _subgraph(model: ir.Model, values: list[ir.Value]):
    """A ModelProto computing ``values`` from the graph inputs and constants they depend on, or
    a string saying why there is none."""
    import onnx

    graph = model.graph
    nodes, inits, inputs, seen = {}, {}, {}, set()
    stack = list(values)
    while stack:
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_input():
            inputs[v.name] = v
            continue
        if v.const_value is not None:
            inits[v.name] = v
            continue
        n = v.producer()
        if n is None or n.graph is not graph:
            return f"'{v.name}' has no producer in the main graph"
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in n.attributes.values()):
            return f"'{v.name}' is computed by control flow ({n.op_type})"
        if id(n) not in nodes:
            nodes[id(n)] = n
            stack.extend(n.inputs)
    order = {id(n): i for i, n in enumerate(graph)}
    protos = [ir.serde.serialize_node(n) for n in sorted(nodes.values(), key=lambda n: order[id(n)])]
    tensors = []
    for v in inits.values():
        arr = v.const_value.numpy()
        tensors.append(ir.serde.serialize_tensor(ir.tensor(arr, dtype=v.const_value.dtype, name=v.name)))
    graph_proto = onnx.helper.make_graph(protos, "rotary_probe", [ir.serde.serialize_value(v) for v in inputs.values()],
                                         [ir.serde.serialize_value(v) if v.dtype is not None else onnx.ValueInfoProto(name=v.name)
                                          for v in values], tensors)
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    return onnx.helper.make_model(graph_proto, opset_imports=opsets, ir_version=model.ir_version)


def _probe_shapes(model: ir.Model, values: list[ir.Value], meta: dict) -> tuple[dict, str]:
    """{value name: [shape at each PROBE_TOKENS length]} of ``values`` run on position_ids
    [1, T] (and input_ids [1, T]), or ({}, why)."""
    import onnxruntime as ort

    proto = _subgraph(model, values)
    if isinstance(proto, str):
        return {}, proto
    sub = ir.serde.deserialize_model(proto)
    if g.has_bfloat16(sub):  # the CPU provider has no bfloat16 Mul: the float32 twin has the same shapes
        sub = g.float32_twin(sub)
    names = {meta.get("position_ids"), meta.get("input_ids")}
    extra = [v.name for v in sub.graph.inputs if v.name not in names]
    if extra:
        return {}, f"cos/sin depend on input(s) {extra}, not only the positions"
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        sess = ort.InferenceSession(ir.serde.serialize_model(sub).SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        shapes: dict = {v.name: [] for v in values}
        for t in PROBE_TOKENS:
            feeds = {}
            for v in sub.graph.inputs:
                dt = v.dtype.numpy() if v.dtype is not None else np.int64
                feeds[v.name] = (np.arange(t) + 7 if v.name == meta.get("position_ids") else np.zeros(t)).astype(dt)[None]
            for name, arr in zip(shapes, sess.run(list(shapes), feeds)):
                shapes[name].append(tuple(arr.shape))
    except Exception as e:  # noqa: BLE001 - cannot check: decline
        return {}, f"running the cos/sin plumbing on position_ids failed ({str(e).splitlines()[0][:200]})"
    return shapes, ""


# --- the rewrite ----------------------------------------------------------------------------------


def _candidates(graph: ir.Graph) -> list[tuple[ir.Node, str]]:
    """Concats on the last axis that end a RoPE chain of either form (to match or to decline)."""
    out = []
    for n in graph:
        if n.op_type != "Concat" or n.domain not in ("", "ai.onnx") or len(n.inputs) != 2 or not _concat_last(n):
            continue
        if _producer(n.inputs[0], "Neg") is not None:
            out.append((n, "rotate_half"))
        elif _producer(n.inputs[0], "Sub") is not None and _producer(n.inputs[1], "Add") is not None:
            out.append((n, "halves"))
    return out


def fuse_rotary(model: ir.Model, options: RewriteOptions) -> FusionResult:
    """Replaces every RoPE chain of a paged model's main graph it can read exactly (module docstring).

    Returns:
        FusionResult(kind="rotary"): fused count, declines with reasons, details {"forms": {form:
        count}, "caches": distinct cos/sin pairs, "transposes_removed": Transposes the op made
        redundant}.
    """
    result = FusionResult(kind="rotary")
    graph = model.graph
    forms: dict[str, int] = {}
    result.details.update(forms=forms, caches=0, transposes_removed=0)
    candidates = _candidates(graph)
    if not candidates:
        return result
    meta_json = model.metadata_props.get(PAGED_META_KEY)
    if meta_json is None:
        result.declined.append(Decline(
            g.node_names(c for c, _ in candidates[:4]) + (", ..." if len(candidates) > 4 else ""),
            f"{len(candidates)} RoPE chain(s) left as exported: not a paged model (no '{PAGED_META_KEY}' "
            "metadata), so cos/sin may have a batch of rows with positions of their own, which "
            "RotaryEmbedding's one position offset cannot express"))
        return result
    import json

    meta = json.loads(meta_json)
    ropes: list[_Rope] = []
    for cat, form in candidates:
        rope, why = (_match_rotate_half if form == "rotate_half" else _match_halves)(cat)
        why = why or _check(rope)
        if why:
            result.declined.append(Decline(cat.name or cat.op_type, why))
        else:
            ropes.append(rope)
    if not ropes:
        return result
    # Batch 1 and the token axis: the cos/sin each chain multiplies by must be [1, 1, T, W].
    values = list(dict.fromkeys(v for r in ropes for v in (r.cos, r.sin)))
    shapes, why = _probe_shapes(model, values, meta)
    kept = []
    for r in ropes:
        w = 2 * r.half if r.form == "rotate_half" else r.half
        bad = why or next((f"cos/sin '{v.name}' has shapes {shapes[v.name]} on position_ids of {list(PROBE_TOKENS)} "
                           f"tokens, not [1, 1, T, {w}] (one row per token)" for v in (r.cos, r.sin)
                           if shapes[v.name] != [(1, 1, t, w) for t in PROBE_TOKENS]), "")
        if bad:
            result.declined.append(Decline(r.chain[-1].name or r.out.name, bad))
        else:
            kept.append(r)
    if not kept:
        return result

    model.opset_imports.setdefault(MS_DOMAIN, 1)
    position = g.initializer(graph, "rotary_position_offset", np.zeros(1, np.int64))
    to_bsh = g.initializer(graph, "rotary_bsh_shape", np.array([0, 0, -1], np.int64))
    to_bsnd: dict[int, ir.Value] = {}
    bnsh_index = None
    caches: dict[int, ir.Value] = {}  # id(per-token cos or sin) -> its [T, h] cache
    order = {id(n): i for i, n in enumerate(graph)}
    orphans: list[ir.Value] = []
    # Each op goes where its chain's last node was (everything the chain reads exists there); in
    # that order, a shared cache is made before its first reader.
    for r in sorted(kept, key=lambda r: max(order[id(n)] for n in r.chain)):
        anchor = max(r.chain, key=lambda n: order[id(n)])
        new_nodes = []
        cache_values = []
        for v in (r.cos, r.sin):
            tok = _per_token(v)
            if id(tok) not in caches:
                src = tok
                if r.form == "rotate_half":  # the first half: the second is the same values
                    sl = ir.node("Slice", [tok, g.initializer(graph, f"{tok.name}_half_start", np.array([0], np.int64)),
                                           g.initializer(graph, f"{tok.name}_half_end", np.array([r.half], np.int64)),
                                           g.initializer(graph, f"{tok.name}_half_axis", np.array([-1], np.int64))],
                                 name=f"{tok.name}_rotary_half")
                    sl.outputs[0].name, sl.outputs[0].dtype = f"{tok.name}_rotary_half", r.dtype
                    new_nodes.append(sl)
                    src = sl.outputs[0]
                rs = ir.node("Reshape", [src, g.initializer(graph, f"{tok.name}_cache_shape", np.array([-1, r.half], np.int64))],
                             name=f"{tok.name}_rotary_cache")
                rs.outputs[0].name, rs.outputs[0].dtype = f"{tok.name}_rotary_cache", r.dtype
                new_nodes.append(rs)
                caches[id(tok)] = rs.outputs[0]
                result.details["caches"] += 1
            cache_values.append(caches[id(tok)])
        if r.half * 2 not in to_bsnd:
            to_bsnd[r.half * 2] = g.initializer(graph, f"rotary_bsnd_shape_{r.half * 2}",
                                         np.array([0, 0, -1, r.half * 2], np.int64))
        base = r.out.name
        flat = ir.node("Reshape", [r.y, to_bsh], name=f"{base}_rotary_in")
        rot = ir.node("RotaryEmbedding", [flat.outputs[0], position, *cache_values],
                      attributes={"interleaved": 0}, domain=MS_DOMAIN, name=f"{base}_rotary")
        back = ir.node("Reshape", [rot.outputs[0], to_bsnd[r.half * 2]], name=f"{base}_rotary_out")
        for node, suffix in ((flat, "rotary_in"), (rot, "rotary"), (back, "rotary_bsnd")):
            node.outputs[0].name, node.outputs[0].dtype = f"{base}_{suffix}", r.dtype
        if r.y.shape is not None:
            back.outputs[0].shape = r.y.shape
        new_nodes += [flat, rot, back]
        # Readers of the rotated [B, N, S, D] tensor: the inverse Transpose reads back's [B, S, N, D]
        # directly; a Shape reads back's shape, permuted (shape arithmetic, no kernel on the GPU);
        # any other reader gets the Transpose the chain's output had.
        others = []
        for reader in _readers(r.out):
            plain = reader.domain in ("", "ai.onnx") and not reader.outputs[0].is_graph_output()
            if plain and reader.op_type == "Transpose" and tuple(g.attr_ints(reader, "perm") or ()) == _BNSH:
                reader.outputs[0].replace_all_uses_with(back.outputs[0])
                graph.remove(reader, safe=True)
                result.details["transposes_removed"] += 1
            elif plain and reader.op_type == "Shape" and not reader.attributes:
                uses = list(reader.outputs[0].uses())
                reader.replace_input_with(0, back.outputs[0])
                if bnsh_index is None:
                    bnsh_index = g.initializer(graph, "rotary_bnsh_axes", np.array(_BNSH, np.int64))
                perm = ir.node("Gather", [reader.outputs[0], bnsh_index], attributes={"axis": 0},
                               name=f"{reader.name or base}_bnsh")
                perm.outputs[0].name, perm.outputs[0].dtype = f"{reader.outputs[0].name}_bnsh", ir.DataType.INT64
                for u in uses:
                    u.node.replace_input_with(u.idx, perm.outputs[0])
                graph.insert_after(reader, perm)
            else:
                others.append(reader)
        if others:
            t = ir.node("Transpose", [back.outputs[0]], attributes={"perm": list(_BNSH)}, name=f"{base}_rotary_bnsh")
            t.outputs[0].dtype, t.outputs[0].shape = r.dtype, r.out.shape
            new_nodes.append(t)
            r.out.replace_all_uses_with(t.outputs[0])
            r.out.name = f"{base}_unfused"
            t.outputs[0].name = base
        graph.insert_before(anchor, new_nodes)
        orphans += [i for n in r.chain for i in n.inputs]
        graph.remove(r.chain, safe=True)  # read only inside the chain (checked by the match)
        forms[r.form] = forms.get(r.form, 0) + 1
        result.fused += 1
    # The Transposes the ops no longer read (and what only they read) go too.
    g.sweep(graph, orphans)
    return result
