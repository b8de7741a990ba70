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


def _dtype(value: ir.Value | None) -> ir.DataType | None:
    """The value's element type, from its type, the Cast that made it or its constant."""
    if value is None:
        return None
    if value.dtype is not None:
        return value.dtype
    p = value.producer()
    if p is not None and p.op_type == "Cast" and p.domain == "":
        return ir.DataType(g.attr_int(p, "to"))
    return value.const_value.dtype if value.const_value is not None else None


def _only_use(value: ir.Value, op_type: str) -> ir.Node | None:
    """The single node that reads ``value``, when it is an ``op_type`` and ``value`` is not a
    graph output."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node = uses[0].node
    return node if node.op_type == op_type and node.domain == "" else None


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
    if x32 is None or _dtype(x32) != _FLOAT or not _last_axis_mean(rm, x32):
        return None
    add = _only_use(rm.outputs[0], "Add")
    eps = g.const_scalar(_other_input(add, rm.outputs[0])) if add is not None else None
    if eps is None or not 0.0 <= eps < 1.0:
        return None
    sqrt = _only_use(add.outputs[0], "Sqrt")
    if sqrt is None:
        return None
    chain = [pw, rm, add, sqrt]
    rec = _only_use(sqrt.outputs[0], "Reciprocal")
    if rec is not None:
        m1 = _only_use(rec.outputs[0], "Mul")
        if m1 is None or _other_input(m1, rec.outputs[0]) is not x32:
            return None
        chain += [rec, m1]
    else:
        m1 = _only_use(sqrt.outputs[0], "Div")
        if m1 is None or m1.inputs[0] is not x32 or m1.inputs[1] is not sqrt.outputs[0]:
            return None
        chain.append(m1)
    y = m1.outputs[0]
    cast_in = x32.producer()
    if cast_in is not None and cast_in.op_type == "Cast" and cast_in.domain == "" and \
            _dtype(cast_in.inputs[0]) in _NARROW:
        x = cast_in.inputs[0]  # x32 = Cast(x): the chain's Cast back to x's type must follow
        cast_out = _only_use(y, "Cast")
        if cast_out is None or g.attr_int(cast_out, "to") != _dtype(x).value:
            return None
        chain.append(cast_out)
        y = cast_out.outputs[0]
    else:
        x = x32
    m2 = _only_use(y, "Mul")
    w = _other_input(m2, y) if m2 is not None else None
    wv = g.const_array(w)
    if wv is None or _dtype(w) != _dtype(x) or wv.ndim < 1 or np.prod(wv.shape[:-1]) != 1:
        return None
    last = g.dim(x, -1)
    if last is not None and wv.shape[-1] != last:
        return None
    chain.append(m2)
    out = m2.outputs[0]
    if out.is_graph_output():
        return None
    return x, w, eps, chain, out


def fuse_rmsnorm(model: ir.Model, options: RewriteOptions) -> FusionResult:
    """Replaces every RMSNorm chain of the main graph it can read exactly (module docstring).

    Returns:
        FusionResult(kind="rmsnorm"): fused count, details {"dtypes": {x dtype: count}}.
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
        node.outputs[0].dtype = _dtype(x)  # the kernel's output has x's type, as the chain's has
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
        dtypes[str(_dtype(x))] = dtypes.get(str(_dtype(x)), 0) + 1
    result.details["dtypes"] = dtypes
    return result
