# SPDX-License-Identifier: MIT
"""RMSNorm chains as one ``SimplifiedLayerNormalization`` node (ORT's RMSNorm kernel).

Exporters write RMSNorm (Llama, Mistral, Qwen, gpt-oss, DeepSeek) as a chain of elementwise
nodes; torch.onnx writes ``rsqrt`` as Sqrt then Reciprocal, which ORT's own RMSNorm fusion does
not take, so a rewritten model runs 8-9 kernels a norm, two norms a layer (and one per head of
Q and K in Qwen3). On the GPU each is a launch (a node of a CUDA graph) over a few kilobytes.
This pass replaces each chain it can read exactly by one node of ORT's
``SimplifiedLayerNormalization`` (ONNX domain, an ORT contrib op with CPU and CUDA kernels):

    x32 = Cast(x, float)                        (absent when x is float32)
    r   = Reciprocal(Sqrt(Add(ReduceMean(Pow(x32, 2), axes=[-1], keepdims=1), eps)))
          or Div(x32, Sqrt(...)) in place of Mul(x32, r)
    y   = Mul(x32, r)
    out = Mul(weight, Cast(y, x's type))         (Cast absent when x is float32)

    out = SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=eps, stash_type=1)

Then each norm whose input is a residual ``Add`` of two activations becomes one node of ORT's
``com.microsoft.SkipSimplifiedLayerNormalization`` (CPU and CUDA kernels; the norm of a
transformer's residual stream, the node onnxruntime-genai's models use):

    h = Add(a, b); y = SimplifiedLayerNormalization(h, weight)
    ->  y, _, _, h = SkipSimplifiedLayerNormalization(a, b, weight, epsilon=eps)

(output 3, the sum, only when something else reads ``h``: the next residual Add). One kernel
instead of two a norm. The kernel sums in float32 and normalizes that sum, where the Add rounded
``h`` to fp16 first; output 3 is the rounded sum, so the residual stream is unchanged.

The replacement computes the same function: the mean of squares and the reciprocal root in
float32 (stash_type 1) and the scale by ``weight``; it rounds once where the chain rounded
``y`` to x's type before the weight multiply (fp16: within one fp16 ulp of the chain's result).
A chain is taken only when every step is exactly the above: constant exponent 2, a constant
scalar epsilon, the mean over the last axis with keepdims, a constant weight over the last
axis, and no intermediate value read by anything else.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ort_ops.rewrite import _graph as g
from ort_ops.rewrite.pipeline import FusionResult, RewriteOptions

_FLOAT = ir.DataType.FLOAT
_NARROW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The input of a two-input node that is not ``value`` (None unless exactly one is)."""
    ins = list(node.inputs)
    if len(ins) != 2:
        return None
    if ins[0] is value and ins[1] is not value:
        return ins[1]
    if ins[1] is value and ins[0] is not value:
        return ins[0]
    return None


def _last_axis_mean(node: ir.Node, x: ir.Value) -> bool:
    """ReduceMean over x's last axis, keepdims on (axes as attribute or as constant input)."""
    if g.attr_int(node, "keepdims", 1) != 1:
        return False
    axes = g.const_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    axes = [int(a) for a in axes.reshape(-1)] if axes is not None else g.attr_ints(node, "axes")
    if axes is None or len(axes) != 1:
        return False
    r = g.rank(x)
    return axes[0] == -1 or (r is not None and axes[0] == r - 1)


def _match(rm: ir.Node):
    """The chain around ReduceMean ``rm``: (x, weight value, epsilon, nodes to remove, output)
    or None."""
    sq_in = rm.inputs[0]
    pw = sq_in.producer() if sq_in is not None else None
    if pw is None or pw.domain != "" or len(list(sq_in.uses())) != 1:
        return None
    if pw.op_type == "Pow" and g.const_scalar(pw.inputs[1]) == 2.0:
        x32 = pw.inputs[0]
    elif pw.op_type == "Mul" and len(pw.inputs) == 2 and pw.inputs[0] is pw.inputs[1]:
        x32 = pw.inputs[0]
    else:
        return None
    if x32 is None or g.element_type(x32) != _FLOAT or not _last_axis_mean(rm, x32):
        return None
    add = g.only_reader(rm.outputs[0], "Add")
    eps = g.const_scalar(_other_input(add, rm.outputs[0])) if add is not None else None
    if eps is None or not 0.0 <= eps < 1.0:
        return None
    sqrt = g.only_reader(add.outputs[0], "Sqrt")
    if sqrt is None:
        return None
    chain = [pw, rm, add, sqrt]
    rec = g.only_reader(sqrt.outputs[0], "Reciprocal")
    if rec is not None:
        m1 = g.only_reader(rec.outputs[0], "Mul")
        if m1 is None or _other_input(m1, rec.outputs[0]) is not x32:
            return None
        chain += [rec, m1]
    else:
        m1 = g.only_reader(sqrt.outputs[0], "Div")
        if m1 is None or m1.inputs[0] is not x32 or m1.inputs[1] is not sqrt.outputs[0]:
            return None
        chain.append(m1)
    y = m1.outputs[0]
    cast_in = x32.producer()
    if cast_in is not None and cast_in.op_type == "Cast" and cast_in.domain == "" and \
            g.element_type(cast_in.inputs[0]) in _NARROW:
        x = cast_in.inputs[0]  # x32 = Cast(x): the chain's Cast back to x's type must follow
        cast_out = g.only_reader(y, "Cast")
        if cast_out is None or g.attr_int(cast_out, "to") != g.element_type(x).value:
            return None
        chain.append(cast_out)
        y = cast_out.outputs[0]
    else:
        x = x32
    m2 = g.only_reader(y, "Mul")
    w = _other_input(m2, y) if m2 is not None else None
    wv = g.const_array(w)
    if wv is None or g.element_type(w) != g.element_type(x) or wv.ndim < 1 or np.prod(wv.shape[:-1]) != 1:
        return None
    last = g.dim(x, -1)
    if last is not None and wv.shape[-1] != last:
        return None
    chain.append(m2)
    out = m2.outputs[0]
    if out.is_graph_output():
        return None
    return x, w, eps, chain, out


MS_DOMAIN = "com.microsoft"


def _residual_add(norm: ir.Node) -> ir.Node | None:
    """The Add feeding ``norm`` (a SimplifiedLayerNormalization over the last axis with float32
    statistics) when it can become a SkipSimplifiedLayerNormalization: two non-constant inputs of
    rank 3 (the kernel's [batch, sequence, hidden]) and equal known shapes where known, its sum not
    a graph output; else None."""
    if g.attr_int(norm, "axis", -1) != -1 or g.attr_int(norm, "stash_type", 1) != 1 or len(norm.inputs) != 2:
        return None
    if norm.outputs[0].is_graph_output():
        return None
    add = norm.inputs[0].producer() if norm.inputs[0] is not None else None
    if add is None or add.op_type != "Add" or add.domain != "" or len(add.inputs) != 2:
        return None
    a, b = add.inputs
    if a is None or b is None or add.outputs[0].is_graph_output():
        return None
    if g.const_array(a) is not None or g.const_array(b) is not None:
        return None
    if g.rank(a) != 3 or g.rank(b) != 3:
        return None
    for axis in range(3):
        da, db = g.dim(a, axis), g.dim(b, axis)
        if da is not None and db is not None and da != db:
            return None
        if da is None and db is None and a.shape is not None and b.shape is not None and a.shape[axis] != b.shape[axis]:
            return None
    if g.element_type(a) is None or g.element_type(a) != g.element_type(b) or g.element_type(a) != g.element_type(norm.inputs[1]):
        return None
    return add


def _fuse_skip(graph: ir.Graph, norm: ir.Node, add: ir.Node) -> None:
    """Replaces ``add`` and ``norm`` by one SkipSimplifiedLayerNormalization (module docstring),
    placed where the Add was, so that every reader of the sum comes after it."""
    h, y = add.outputs[0], norm.outputs[0]
    others = [u for u in h.uses() if u.node is not norm]
    node = ir.node("SkipSimplifiedLayerNormalization", [add.inputs[0], add.inputs[1], norm.inputs[1]],
                   attributes={"epsilon": norm.attributes["epsilon"].value if "epsilon" in norm.attributes else 1e-5},
                   domain=MS_DOMAIN, num_outputs=4 if others else 1, name=f"{norm.name or y.name}_skip")
    graph.insert_before(add, node)
    out = node.outputs[0]
    out.dtype, out.shape = y.dtype, y.shape
    y_name, h_name = y.name, h.name
    y.replace_all_uses_with(out)
    if others:
        for unused in node.outputs[1:3]:
            unused.name = ""  # optional outputs (mean, inverse std) not produced
        total = node.outputs[3]
        total.dtype, total.shape = h.dtype, h.shape
        h.replace_all_uses_with(total)
    graph.remove([norm, add], safe=True)
    out.name = y_name
    if others:
        node.outputs[3].name = h_name


def fuse_rmsnorm(model: ir.Model, options: RewriteOptions) -> FusionResult:
    """Replaces every RMSNorm chain of the main graph it can read exactly, then every norm of a
    residual Add by SkipSimplifiedLayerNormalization (module docstring).

    Returns:
        FusionResult(kind="rmsnorm"): fused count (chains), details {"dtypes": {x dtype: count},
        "skip": norms fused with their residual Add}.
    """
    result = FusionResult(kind="rmsnorm")
    graph = model.graph
    dtypes: dict[str, int] = {}
    for rm in [n for n in graph if n.op_type == "ReduceMean" and n.domain == ""]:
        if rm.graph is not graph:  # taken by an earlier chain
            continue
        found = _match(rm)
        if found is None:
            continue
        x, w, eps, chain, out = found
        weight = w
        if np.asarray(g.const_array(w)).ndim != 1:  # the kernel's scale is 1-D over the last axis
            weight = ir.Value(name=f"{out.name}_scale", const_value=ir.tensor(g.const_array(w).reshape(-1)))
            graph.register_initializer(weight)
        node = ir.node("SimplifiedLayerNormalization", [x, weight],
                       attributes={"axis": -1, "epsilon": float(eps), "stash_type": 1},
                       name=f"{chain[-1].name or out.name}_rmsnorm")
        node.outputs[0].dtype = g.element_type(x)  # the kernel's output has x's type, as the chain's has
        if out.shape is not None:
            node.outputs[0].shape = out.shape
        graph.insert_before(chain[-1], node)
        out.replace_all_uses_with(node.outputs[0])
        name = out.name
        cast_in = chain[0].inputs[0].producer() if x is not chain[0].inputs[0] else None
        for n in reversed(chain):
            graph.remove(n, safe=True)
        node.outputs[0].name = name
        if cast_in is not None and not list(cast_in.outputs[0].uses()) and not cast_in.outputs[0].is_graph_output():
            graph.remove(cast_in, safe=True)
        result.fused += 1
        dtypes[str(g.element_type(x))] = dtypes.get(str(g.element_type(x)), 0) + 1
    result.details["dtypes"] = dtypes
    skip = 0
    for norm in [n for n in graph if n.op_type == "SimplifiedLayerNormalization" and n.domain in ("", "ai.onnx")]:
        add = _residual_add(norm)
        if add is not None:
            _fuse_skip(graph, norm, add)
            skip += 1
    if skip:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    result.details["skip"] = skip
    return result
