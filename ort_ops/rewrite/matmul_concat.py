# SPDX-License-Identifier: MIT
"""MatMuls that read one activation with constant weights, as one MatMul and a Split.

Exporters write a decoder layer's Q, K and V projections (and the MLP's gate and up projections)
as separate MatMuls of the same normed activation: ``q = MatMul(x, Wq)``, ``k = MatMul(x, Wk)``,
``v = MatMul(x, Wv)``. On the GPU each is its own GEMM launch, and the narrow ones (K and V of a
GQA model are a quarter of Q's width) cannot reach the memory bandwidth alone. This pass
replaces every such group by

    y = MatMul(x, Concat(Wq, Wk, Wv, axis=1))      (the weights joined offline, one initializer)
    q, k, v = Split(y, [Nq, Nk, Nv], axis=-1)

which computes the same columns: column j of ``x @ [Wq Wk Wv]`` is the dot product of x's row with
column j of its own weight, the same products and sums as before (a GEMM may order a dot
product's partial sums differently for a different width, so the results agree to rounding, not
bit for bit).

A group is taken only when every member is an ONNX MatMul whose first input is the shared value
and whose second is a constant 2-D initializer of the same dtype and row count, read by nothing
else, and whose output is not a graph output. The joined weight replaces the originals (the
model does not grow).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ort_ops.rewrite import _graph as g
from ort_ops.rewrite.pipeline import Decline, FusionResult, RewriteOptions


def _weight(node: ir.Node) -> ir.Value | None:
    """The constant 2-D weight (an initializer) of a MatMul that the pass may join, or None."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    if w is None or w.const_value is None or w.is_graph_input() or len(list(w.uses())) != 1:
        return None
    if node.outputs[0].is_graph_output():
        return None
    shape = w.const_value.shape
    return w if shape is not None and len(shape) == 2 else None


def _groups(graph: ir.Graph) -> list[tuple[ir.Value, list[ir.Node]]]:
    """(shared activation, its joinable MatMuls in graph order) for every activation read as the
    first input of two or more joinable MatMuls with weights of one dtype and row count."""
    by_input: dict[int, tuple[ir.Value, list[ir.Node]]] = {}
    for node in graph:
        if _weight(node) is None or node.inputs[0] is None:
            continue
        x = node.inputs[0]
        by_input.setdefault(id(x), (x, []))[1].append(node)
    out = []
    for x, nodes in by_input.values():
        if len(nodes) < 2:
            continue
        def key(n: ir.Node):
            return n.inputs[1].const_value.dtype, n.inputs[1].const_value.shape[0]

        first = key(nodes[0])
        same = [n for n in nodes if key(n) == first]
        if len(same) >= 2:
            out.append((x, same))
    return out


def _split_node(graph: ir.Graph, y: ir.Value, widths: list[int], opset: int, name: str) -> ir.Node:
    """Split(y, widths, axis=-1): the sizes an initializer input from opset 13 on, an attribute
    before."""
    if opset >= 13:
        sizes = g.initializer(graph, f"{name}_sizes", np.asarray(widths, np.int64))
        return ir.node("Split", [y, sizes], attributes={"axis": -1}, num_outputs=len(widths), name=name)
    return ir.node("Split", [y], attributes={"axis": -1, "split": widths}, num_outputs=len(widths), name=name)


def fuse_matmul_concat(model: ir.Model, options: RewriteOptions) -> FusionResult:
    """Joins the MatMuls of each shared activation (module docstring).

    Returns:
        FusionResult(kind="matmul_concat"): fused = groups joined; details {"matmuls": MatMuls
        replaced, "widths": {"N1+N2+...": count}}.
    """
    result = FusionResult(kind="matmul_concat")
    graph = model.graph
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 13))
    replaced, widths_seen = 0, {}
    for x, nodes in _groups(graph):
        weights = [n.inputs[1] for n in nodes]
        arrays = [w.const_value.numpy() for w in weights]
        if len({a.dtype for a in arrays}) != 1:
            result.declined.append(Decline(g.node_names(nodes), "weights of different numpy dtypes"))
            continue
        widths = [int(a.shape[1]) for a in arrays]
        base = nodes[0].name or weights[0].name or "matmul"
        tensor = ir.tensor(np.concatenate(arrays, axis=1), dtype=weights[0].const_value.dtype)
        joined = ir.Value(name=f"{base}_joined_weight", const_value=tensor, type=ir.TensorType(tensor.dtype),
                          shape=ir.Shape(tensor.shape))
        graph.register_initializer(joined)
        mm = ir.node("MatMul", [x, joined], name=f"{base}_joined")
        mm.outputs[0].dtype = weights[0].const_value.dtype
        split = _split_node(graph, mm.outputs[0], widths, opset, f"{base}_split")
        graph.insert_before(nodes[0], [mm, split])
        for node, part in zip(nodes, split.outputs):
            out = node.outputs[0]
            if out.dtype is not None:
                part.dtype = out.dtype
            if out.shape is not None:
                part.shape = out.shape
            out.replace_all_uses_with(part)
            name = out.name
            graph.remove(node, safe=True)
            part.name = name
        for w in weights:
            if not list(w.uses()) and w.name in graph.initializers:
                del graph.initializers[w.name]
        result.fused += 1
        replaced += len(nodes)
        key = "+".join(map(str, widths))
        widths_seen[key] = widths_seen.get(key, 0) + 1
    result.details["matmuls"] = replaced
    result.details["widths"] = widths_seen
    return result
