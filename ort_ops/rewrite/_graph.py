# SPDX-License-Identifier: MIT
"""onnx_ir helpers the fusions share: constants, producers, probing values by running the model.

The probe answers questions a pattern cannot: "is this mask causal (and key-padding)?" is decided
by running the original model (stock onnxruntime, no custom ops) on a small batch with left
padding and reading the mask tensors it actually computes, whatever plumbing built them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value as a numpy array when it is a constant (initializer or Constant node), else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        attr = node.attributes.get("value")
        if attr is not None:
            return attr.as_tensor().numpy()
        for name in ("value_float", "value_int"):
            if name in node.attributes:
                return np.array(node.attributes[name].value)
        for name in ("value_floats", "value_ints"):
            if name in node.attributes:
                return np.array(node.attributes[name].value)
    return None


def const_scalar(value: ir.Value | None) -> float | None:
    """A constant with exactly one element, as a Python float; else None."""
    arr = const_array(value)
    if arr is None or arr.size != 1:
        return None
    return float(arr.reshape(()))


def producer(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    """The node producing ``value`` if it is ``op_type`` in ``domain``."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type != op_type or node.domain not in ({domain, "ai.onnx"} if domain == "" else {domain}):
        return None
    return node


def attr_int(node: ir.Node, name: str, default: int | None = None) -> int | None:
    a = node.attributes.get(name)
    return default if a is None else int(a.value)


def attr_ints(node: ir.Node, name: str) -> list[int] | None:
    a = node.attributes.get(name)
    return None if a is None else [int(x) for x in a.value]


def dim(value: ir.Value, axis: int) -> int | None:
    """A static dimension of ``value``'s shape, or None when unknown or symbolic."""
    if value.shape is None or axis >= value.shape.rank() or -axis > value.shape.rank():
        return None
    return _static(value.shape[axis])


def _static(d) -> int | None:
    """A dimension as an int: ints, and symbolic names that are digits (some exporters write "64")."""
    if isinstance(d, int):
        return d
    text = str(d)
    return int(text) if text.isdigit() else None


def rank(value: ir.Value) -> int | None:
    return None if value.shape is None else value.shape.rank()


def node_names(nodes: Iterable[ir.Node]) -> str:
    return ", ".join(n.name or n.op_type for n in nodes)


# --- probing -------------------------------------------------------------------------------------

PROBE_BATCH = 2
# Long enough that a short sliding window (< PROBE_PAST + PROBE_SEQ keys) shows in the mask;
# a window longer than the probe cannot be seen this way (README: limitations).
PROBE_SEQ = 6
PROBE_PAST = 6
# The second probe (other sizes: what is equal on both is structural, not a size) and the batch
# both fall back to when a graph runs only one sequence at a time on onnxruntime (the ONNX
# RotaryEmbedding with a [1, S, D/2] cos/sin cache and no position_ids, as torch.onnx writes
# it when positions come from the cache length: ORT wants the cache's batch to be the input's).
PROBE2_BATCH, PROBE2_SEQ, PROBE2_PAST = 3, 7, 9
PROBE_FALLBACK_BATCH = 1


def probe_feeds(model: ir.Model, past_inputs: Sequence[ir.Value], b: int = PROBE_BATCH, s: int = PROBE_SEQ,
                past: int = PROBE_PAST) -> tuple[dict, np.ndarray] | None:
    """Small feeds for a decoder graph: batch ``b`` with row 0 left-padded by one token, ``s`` new
    tokens, ``past`` past tokens when the model has a cache. Returns (feeds, attention_mask
    [B, P+S]) or None when an input is not one a decoder has (then nothing can be probed)."""
    past = past if past_inputs else 0
    mask = np.ones((b, past + s), np.int64)
    mask[0, 0] = 0
    feeds = {}
    for inp in model.graph.inputs:
        name = inp.name
        dtype = inp.dtype.numpy() if inp.dtype is not None else np.float32
        if name == "input_ids" or name.endswith("input_ids"):
            feeds[name] = (np.arange(b * s, dtype=np.int64).reshape(b, s) % 7 + 3).astype(dtype)
        elif "attention_mask" in name:
            feeds[name] = mask.astype(dtype)
        elif "position_ids" in name:
            pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
            feeds[name] = pos.astype(dtype)
        elif inp in past_inputs:
            shape = [_static(d) for d in inp.shape] if inp.shape is not None else []
            if len(shape) != 4 or shape[1] is None or shape[3] is None:
                return None
            rng = np.random.default_rng(0)
            feeds[name] = rng.standard_normal((b, shape[1], past, shape[3])).astype(dtype)
        else:
            return None
    return feeds, mask


def all_node_outputs(model: ir.Model) -> list[ir.Value]:
    """Every non-constant node output of the main graph (probed for shapes the graph leaves symbolic)."""
    return [o for n in model.graph if n.op_type != "Constant" for o in n.outputs if o is not None and o.name]


# Models with more initializer bytes than this, or with any initializer in an external file, are
# probed from a temporary file: a serialized protobuf cannot exceed 2 GiB, and onnxruntime refuses
# a model given as bytes whose tensors name external files (it has no folder to resolve them in).
PROBE_INLINE_LIMIT = 1 << 30


def probe_session(model: ir.Model, extra_outputs: Sequence[ir.Value], so):
    """A CPU-EP onnxruntime session of ``model`` with ``extra_outputs`` added as graph outputs
    (taken out again before returning: the caller's model is unchanged)."""
    import tempfile

    import onnxruntime as ort

    graph = model.graph
    added = [v for v in dict.fromkeys(extra_outputs) if not v.is_graph_output()]
    graph.outputs.extend(added)
    try:
        consts = [v.const_value for v in graph.initializers.values() if v.const_value is not None]
        external = any(isinstance(t, ir.ExternalTensor) for t in consts)
        if external or sum(t.nbytes for t in consts) > PROBE_INLINE_LIMIT:
            with tempfile.TemporaryDirectory(prefix="ort_ops_probe_") as tmp:
                path = f"{tmp}/probe.onnx"
                ir.save(model, path, external_data="probe.onnx.data")
                return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        data = ir.serde.serialize_model(model).SerializeToString()
        return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    finally:
        for v in added:
            graph.outputs.remove(v)


def run_probe(model: ir.Model, values: Sequence[ir.Value], feeds: dict) -> dict[str, np.ndarray]:
    """Runs ``model`` (unchanged; ``values`` become extra outputs for the run) on stock onnxruntime."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4  # a failing probe is reported as a decline reason, not logged
    from ort_ops._domain import DOMAIN

    if any(n.domain == DOMAIN for n in model.graph):  # e.g. MoE already fused
        from ort_ops._lib import session_options

        session_options(so)
    sess = probe_session(model, values, so)
    names = [v.name for v in values]
    outs = sess.run(names, feeds)
    return dict(zip(names, outs))


def expected_visible(mask: np.ndarray, past: int, seq: int, padding: bool) -> np.ndarray:
    """allowed[b, i, j]: query i (position past + i) may see key j: causal, and (``padding``) not a pad."""
    total = past + seq
    i = np.arange(seq)[:, None] + past
    j = np.arange(total)[None, :]
    causal = np.broadcast_to(j <= i, (mask.shape[0], seq, total))
    if padding:
        return causal & (mask[:, None, :] > 0)
    return causal.copy()


def classify_additive_mask(m: np.ndarray, mask: np.ndarray, past: int, seq: int) -> str | None:
    """Compares an additive mask (probe output, broadcastable to [B, H, S, P+S]) with causal and
    causal+key-padding on the rows of real (non-pad) queries. Returns "causal+padding",
    "causal" or None (something else: a window, bidirectional, a bias)."""
    b = mask.shape[0]
    total = past + seq
    try:
        full = np.broadcast_to(m, (b, m.shape[1] if m.ndim == 4 else 1, seq, total)).astype(np.float64)
    except ValueError:
        return None
    real_q = mask[:, past:] > 0  # [B, S]
    for padding, label in ((True, "causal+padding"), (False, "causal")):
        vis = expected_visible(mask, past, seq, padding)  # [B, S, T]
        ok = True
        for bb in range(b):
            for ii in range(seq):
                if not real_q[bb, ii]:
                    continue
                row = full[bb, :, ii, :]
                if not (np.all(row[:, vis[bb, ii]] == 0) and np.all(row[:, ~vis[bb, ii]] <= -1e4)):
                    ok = False
                    break
            if not ok:
                break
        if ok:
            return label
    return None


# Windows shorter than this many keys are caught by the long probe of a KV-cache model's mask
# (one query behind LONG_PROBE_KEYS - 1 past tokens); prefill-only graphs are probed with
# LONG_PROBE_PREFILL query tokens (their mask is [S, S]).
LONG_PROBE_KEYS = 8192
LONG_PROBE_PREFILL = 1024


def _subgraph_proto(proto, output: str):
    """A ModelProto computing only ``output`` from the graph inputs it needs."""
    import onnx

    producer = {o: n for n in proto.graph.node for o in n.output}
    inits = {t.name: t for t in proto.graph.initializer}
    inputs = {i.name: i for i in proto.graph.input}
    need_nodes, need_inits, need_inputs, seen = set(), set(), set(), set()
    stack = [output]
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in inits:
            need_inits.add(name)
        elif name in inputs:
            need_inputs.add(name)
        elif name in producer:
            node = producer[name]
            if id(node) not in need_nodes:
                need_nodes.add(id(node))
                stack.extend(node.input)
                for attr in node.attribute:  # subgraphs read outer names too
                    if attr.type == onnx.AttributeProto.GRAPH:
                        stack.extend(i for n in attr.g.node for i in n.input)
    graph = onnx.helper.make_graph(
        [n for n in proto.graph.node if id(n) in need_nodes], "mask_probe",
        [inputs[n] for n in inputs if n in need_inputs], [onnx.ValueInfoProto(name=output)],
        [inits[n] for n in inits if n in need_inits])
    sub = onnx.helper.make_model(graph, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    return sub


def mask_sees_every_key(proto, mask_name: str, past_names: set, paged: bool) -> tuple[bool | None, str]:
    """Runs the part of the model that computes the mask on one long sequence with no padding and
    checks that the last query sees every key (a causal mask does; a sliding window does not).

    Returns (True | False | None, detail); None when the mask plumbing cannot be run this way."""
    import onnxruntime as ort

    try:
        sub = _subgraph_proto(proto, mask_name)
        keys = LONG_PROBE_KEYS if paged else LONG_PROBE_PREFILL
        seq = 1 if paged else keys
        feeds = {}
        for inp in sub.graph.input:
            name = inp.name
            tt = inp.type.tensor_type
            dtype = onnx_dtype_to_np(tt.elem_type)
            if name.endswith("input_ids"):
                feeds[name] = np.full((1, seq), 3, dtype)
            elif "attention_mask" in name:
                feeds[name] = np.ones((1, keys), dtype)
            elif "position_ids" in name:
                feeds[name] = np.arange(keys - seq, keys, dtype=dtype)[None, :]
            elif name in past_names:
                dims = [_static(d.dim_value if d.HasField("dim_value") else d.dim_param) for d in tt.shape.dim]
                if len(dims) != 4 or dims[1] is None or dims[3] is None:
                    return None, f"past input '{name}' has no static head dims"
                feeds[name] = np.zeros((1, dims[1], keys - seq, dims[3]), dtype)
            else:
                return None, f"the mask depends on input '{name}'"
        so = ort.SessionOptions()
        so.log_severity_level = 4
        sess = ort.InferenceSession(sub.SerializeToString(), so, providers=["CPUExecutionProvider"])
        m = sess.run(None, feeds)[0]
    except Exception as e:  # noqa: BLE001 - reported by the caller as "cannot check"
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        keys = LONG_PROBE_KEYS if paged else LONG_PROBE_PREFILL
        return None, f"running the mask on {keys} keys failed ({first})"
    last = np.asarray(m)[..., -1, :]
    if last.dtype == np.bool_:
        hidden = ~last
    else:
        hidden = last < -1e4 if np.issubdtype(last.dtype, np.floating) else last != 0
    if np.any(hidden):
        first_seen = int(np.argmax(~np.any(hidden.reshape(-1, hidden.shape[-1]), axis=0)))
        return False, f"the last of {last.shape[-1]} keys' query sees only keys >= {first_seen} (a sliding window)"
    return True, ""


def onnx_dtype_to_np(elem_type: int):
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(elem_type)
