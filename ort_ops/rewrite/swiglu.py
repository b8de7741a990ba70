# SPDX-License-Identifier: MIT
"""The MLP's gated SiLU, ``Split -> SiLU(gate) -> Mul(., up)``, as one ``ort_ops.SwiGLU`` node.

After ``matmul_concat`` a decoder MLP computes its gate and up projections as one MatMul and a
``Split`` into two equal halves along the last axis; the activation is then three or four more
kernels: the Split, the SiLU of the first half (``com.microsoft.QuickGelu`` with alpha 1, or
``Sigmoid(g)`` and ``Mul(g, sigmoid)`` as torch exporters write ``silu``) and the ``Mul`` by the
second half. This pass replaces them by

    h = SwiGLU(gate_up)            ort_ops domain; DESIGN.md "SwiGLU"

A candidate is taken only when the Split has exactly two outputs of equal, known width along the
last axis (sizes given as equal constants, or an even static last dim split in two), the first
output is read only by the SiLU, the SiLU's result and the second output only by the one Mul,
no value but the Mul's output is a graph output, and the element type is float32 or float16.
Anything else is declined with its reason and left as it was.

On by default (``RewriteOptions.swiglu``; ``--no-swiglu`` leaves the chain): on the GPU it takes
2-3 kernels a layer out of a decode step (benchmarks/NOTES_generate_cuda.md).
"""

from __future__ import annotations

import onnx_ir as ir

from ort_ops._domain import DOMAIN, OPSET_VERSION
from ort_ops.rewrite import _graph as g
from ort_ops.rewrite.pipeline import Decline, FusionResult, RewriteOptions

MS_DOMAIN = "com.microsoft"
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


def _readers(value: ir.Value) -> list[ir.Node]:
    return [u.node for u in value.uses()]


def _is(node: ir.Node, op_type: str, domain: str = "") -> bool:
    return node.op_type == op_type and node.domain in ({domain, "ai.onnx"} if domain == "" else {domain})


def _halves_reason(split: ir.Node) -> str | None:
    """Why ``split`` is not a split of its input into two equal halves along the last axis (None
    when it is)."""
    if len(split.outputs) != 2:
        return f"Split has {len(split.outputs)} outputs, not 2"
    x = split.inputs[0]
    sizes, why = g.last_axis_split(split)
    if why:
        return why
    if sizes is not None:
        return None if len(sizes) == 2 and sizes[0] == sizes[1] else f"Split sizes {sizes} are not two equal halves"
    width = g.dim(x, -1)
    if width is None:
        return "Split without sizes of an input whose last dim is not static"
    return None if width % 2 == 0 else f"Split without sizes of an odd last dim {width}"


def _silu(gate: ir.Value) -> tuple[list[ir.Node], ir.Value, str] | str:
    """(the SiLU's nodes, its output, its form) when ``gate``'s only readers compute silu(gate),
    else the reason it is not."""
    readers = _readers(gate)
    if len(readers) == 1 and _is(readers[0], "QuickGelu", MS_DOMAIN):
        q = readers[0]
        alpha = q.attributes.get("alpha")
        if alpha is None or float(alpha.value) != 1.0:  # QuickGelu's default alpha is 1.702
            return "QuickGelu's alpha is not 1 (not SiLU)"
        return [q], q.outputs[0], "quickgelu"
    if len(readers) == 2:
        sig = next((n for n in readers if _is(n, "Sigmoid")), None)
        mul = next((n for n in readers if _is(n, "Mul")), None)
        if sig is not None and mul is not None:
            s = sig.outputs[0]
            if (not s.is_graph_output() and _readers(s) == [mul]
                    and {id(v) for v in mul.inputs} == {id(gate), id(s)}):
                return [sig, mul], mul.outputs[0], "sigmoid_mul"
    return "the first half is not read only by a SiLU (QuickGelu alpha 1, or Sigmoid then Mul)"


def fuse_swiglu(model: ir.Model, options: RewriteOptions) -> FusionResult:
    """Replaces each Split + SiLU + Mul block (module docstring) by one SwiGLU.

    Returns:
        FusionResult(kind="swiglu"): fused = blocks replaced; details {"forms": {"quickgelu" |
        "sigmoid_mul": count}}.
    """
    result = FusionResult(kind="swiglu")
    graph = model.graph
    forms: dict[str, int] = {}
    for split in [n for n in graph if _is(n, "Split")]:
        if len(split.outputs) != 2:
            continue  # Q / K / V and other splits: not candidates, nothing to report
        gate, up = split.outputs
        silu = _silu(gate)
        if isinstance(silu, str):
            continue  # not an activation block (most Splits of a model)
        where = g.node_names([split, *silu[0]])
        reason = _halves_reason(split)
        silu_nodes, s, form = silu
        mul = None
        if reason is None:
            up_readers = _readers(up)
            s_readers = _readers(s)
            if (len(up_readers) == 1 and s_readers == up_readers and _is(up_readers[0], "Mul")
                    and {id(v) for v in up_readers[0].inputs} == {id(s), id(up)}):
                mul = up_readers[0]
            else:
                reason = "the SiLU and the second half are not read only by one Mul of the two"
        if reason is None and any(v.is_graph_output() for v in (gate, up, s)):
            reason = "an intermediate value is a graph output"
        if reason is None and g.element_type(split.inputs[0]) not in _FLOATS:
            reason = f"element type {g.element_type(split.inputs[0])} is not float32 or float16"
        if reason is not None:
            result.declined.append(Decline(where, reason))
            continue
        y = mul.outputs[0]
        node = ir.node("SwiGLU", [split.inputs[0]], domain=DOMAIN, name=f"{split.name or y.name}_swiglu")
        out = node.outputs[0]
        out.dtype = y.dtype if y.dtype is not None else g.element_type(split.inputs[0])
        if y.shape is not None:
            out.shape = y.shape
        graph.insert_before(split, [node])
        y.replace_all_uses_with(out, replace_graph_outputs=True)
        name = y.name
        sizes = split.inputs[1] if len(split.inputs) > 1 else None
        for n in (mul, *reversed(silu_nodes), split):
            graph.remove(n, safe=True)
        out.name = name
        if sizes is not None and not list(sizes.uses()) and sizes.name in graph.initializers:
            del graph.initializers[sizes.name]  # matmul_concat's split sizes, now unread
        result.fused += 1
        forms[form] = forms.get(form, 0) + 1
    if result.fused:
        model.opset_imports.setdefault(DOMAIN, OPSET_VERSION)
    result.details["forms"] = forms
    return result
