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
    """The value as a numpy array when it is a constant, else None.

    Constants are initializers that are not also graph inputs (an initializer listed as an input
    is a default the caller may override, so no rewrite may bake it in) and outputs of ONNX
    ``Constant`` nodes (``value`` or one of ``value_float(s)`` / ``value_int(s)``). bfloat16
    tensors come back as float32 (exact: every bfloat16 value is a float32 value), the dtype numpy
    arithmetic and the quantizer work in. An initializer in an external file is read from it.
    """
    if value is None or value.is_graph_input():
        return None
    if value.const_value is not None:
        tensor = value.const_value
    else:
        node = value.producer()
        if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attributes) != 1:
            return None
        name, attr = next(iter(node.attributes.items()))
        if attr.is_ref():
            return None
        if name == "value":
            tensor = attr.as_tensor()
        elif name in ("value_float", "value_floats"):
            return np.array(attr.value, np.float32)
        elif name in ("value_int", "value_ints"):
            return np.array(attr.value, np.int64)
        else:  # strings and sparse tensors are never weights or shapes
            return None
    if tensor.dtype == ir.DataType.BFLOAT16:
        return tensor.numpy().astype(np.float32)
    return tensor.numpy()


# Layout ops fold_const evaluates over constants.
FOLDED_OPS = ("Identity", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Gather", "Split", "Slice", "Cast")


def fold_const(v: ir.Value | None, depth: int = 0) -> np.ndarray | None:
    """Evaluates ``v`` when it is a constant (``const_array``) or a chain of at most 8 layout ops
    over constants, the per-expert slices exporters take of stacked weights: Transpose,
    Reshape, Squeeze, Unsqueeze, Gather, Split, Slice, Identity and Cast to float32. None
    otherwise (another op, a non-constant input, an op whose inputs numpy rejects)."""
    c = const_array(v)
    if c is not None or v is None or depth > 8:
        return c
    n = v.producer()
    if n is None or n.domain not in ("", "ai.onnx") or n.op_type not in FOLDED_OPS:
        return None
    ins = [fold_const(i, depth + 1) if i is not None else None for i in n.inputs]
    if any(i is None for i, orig in zip(ins, n.inputs) if orig is not None):
        return None
    a = n.attributes
    op = n.op_type
    try:
        if op == "Identity":
            return ins[0]
        if op == "Transpose":
            perm = a["perm"].as_ints() if "perm" in a else None
            return np.transpose(ins[0], perm)
        if op == "Reshape":
            shape = [d if d != 0 else ins[0].shape[i] for i, d in enumerate(ins[1].tolist())]
            return ins[0].reshape(shape)
        if op == "Squeeze":
            axes = tuple(int(x) for x in ins[1]) if len(ins) > 1 and ins[1] is not None else None
            return np.squeeze(ins[0], axis=axes)
        if op == "Unsqueeze":
            out = ins[0]
            for ax in sorted(int(x) % (out.ndim + len(ins[1])) for x in ins[1]):
                out = np.expand_dims(out, ax)
            return out
        if op == "Gather":
            return np.take(ins[0], ins[1], axis=a["axis"].as_int() if "axis" in a else 0)
        if op == "Split":
            axis = a["axis"].as_int() if "axis" in a else 0
            idx = list(n.outputs).index(v)
            if len(ins) > 1 and ins[1] is not None:
                bounds = np.cumsum(ins[1])[:-1]
            else:
                bounds = len(n.outputs)
            return np.split(ins[0], bounds, axis=axis)[idx]
        if op == "Slice":
            data, starts, ends = ins[0], ins[1], ins[2]
            axes = ins[3] if len(ins) > 3 and ins[3] is not None else np.arange(len(starts))
            steps = ins[4] if len(ins) > 4 and ins[4] is not None else np.ones(len(starts), np.int64)
            sl = [slice(None)] * data.ndim
            for s, e, ax, st in zip(starts, ends, axes, steps):
                sl[int(ax)] = slice(int(s), int(e), int(st))
            return data[tuple(sl)]
        if op == "Cast" and a["to"].as_int() == ir.DataType.FLOAT:
            return ins[0].astype(np.float32)
    except (KeyError, ValueError, IndexError, TypeError):
        return None
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


def only_reader(value: ir.Value, op_type: str) -> ir.Node | None:
    """The one node reading ``value`` when it is an ONNX ``op_type`` and ``value`` is not a graph
    output (a chain's intermediate a fusion may remove), else None."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node = uses[0].node
    return node if node.op_type == op_type and node.domain in ("", "ai.onnx") else None


# Ops whose output has their first input's element type.
_SAME_TYPE_LAYOUT = ("Transpose", "Reshape", "Unsqueeze", "Squeeze", "Identity")


def element_type(value: ir.Value | None, depth: int = 0) -> ir.DataType | None:
    """``value``'s element type: its own, its constant's, a Cast's target, or that of the input of
    a layout op that made it (exports without value_info); None when none says."""
    if value is None or depth > 8:
        return None
    if value.dtype is not None:
        return value.dtype
    if value.const_value is not None:
        return value.const_value.dtype
    n = value.producer()
    if n is None or n.domain not in ("", "ai.onnx"):
        return None
    if n.op_type == "Cast":
        return ir.DataType(attr_int(n, "to"))
    if n.op_type in _SAME_TYPE_LAYOUT:
        return element_type(n.inputs[0], depth + 1)
    return None


def initializer(graph: ir.Graph, name: str, arr: np.ndarray) -> ir.Value:
    """A new initializer holding ``arr``, typed and shaped, named ``name`` or, when an initializer
    or graph input has that name, ``name_1``, ``name_2``, ..."""
    taken = set(graph.initializers) | {v.name for v in graph.inputs}
    unique, i = name, 0
    while unique in taken:
        i += 1
        unique = f"{name}_{i}"
    v = ir.Value(name=unique, const_value=ir.tensor(arr, name=unique))
    v.shape = ir.Shape(arr.shape)
    v.type = ir.TensorType(ir.DataType.from_numpy(arr.dtype))
    graph.register_initializer(v)
    return v


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


def last_axis_split(split: ir.Node) -> tuple[list[int] | None, str]:
    """(sizes, "") for a Split along its input's last axis: its sizes input (a constant) or its
    ``split`` attribute, None when it gives neither (equal parts); (None, the reason) when the axis
    is another or the sizes input is not a constant."""
    x = split.inputs[0]
    r = rank(x)
    axis = attr_int(split, "axis", 0)
    if not (axis == -1 or (r is not None and axis == r - 1)):
        return None, f"Split axis {axis} is not the last axis (input rank {r})"
    if len(split.inputs) > 1 and split.inputs[1] is not None:
        arr = const_array(split.inputs[1])
        if arr is None:
            return None, "Split sizes are not a constant"
        return [int(s) for s in arr.reshape(-1)], ""
    return attr_ints(split, "split"), ""


def sweep(graph: ir.Graph, values: list[ir.Value]) -> None:
    """Removes the nodes (and initializers) left without readers among ``values`` and what only
    they read, transitively (a fusion's replaced chain: its layout nodes, shape arithmetic,
    constants). Graph inputs and outputs stay."""
    stack = list(values)
    while stack:
        v = stack.pop()
        if v is None or v.is_graph_output() or v.is_graph_input() or list(v.uses()):
            continue
        if v.name in graph.initializers and graph.initializers[v.name] is v:
            del graph.initializers[v.name]
            continue
        n = v.producer()
        if n is None or n.graph is not graph or any(list(o.uses()) or o.is_graph_output() for o in n.outputs):
            continue
        ins = list(n.inputs)
        graph.remove(n, safe=True)
        stack.extend(ins)


# --- probing -------------------------------------------------------------------------------------

PROBE_BATCH = 2
# The short probe checks causality and key padding (with the window that mask_window measured);
# the window itself is measured on longer runs of the mask plumbing (mask_window).
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


class Prober:
    """One stock-onnxruntime CPU session of ``model`` (unchanged) with ``values`` as extra outputs;
    ``run(feeds)`` returns their arrays by name, as often as asked.

    A bfloat16 model runs as its float32 twin (``float32_twin``: onnxruntime's CPU provider has no
    bfloat16 Mul/MatMul); the twin's values keep their names, so the arrays answer for the
    model's values, in float32. A model already holding this package's ops (e.g. MoE fused
    before attention) gets the library registered. ``self.model`` is the model that runs."""

    def __init__(self, model: ir.Model, values: Sequence[ir.Value]):
        import onnxruntime as ort

        from ort_ops._domain import DOMAIN

        if has_bfloat16(model):
            model = float32_twin(model)
            values = same_values(model, values)
        self.model = model
        self.names = [v.name for v in values]
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 4  # a failing probe is reported as a decline reason, not logged
        if any(n.domain == DOMAIN for n in model.graph):
            from ort_ops._lib import session_options

            session_options(so)
        self.session = probe_session(model, values, so)

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        return dict(zip(self.names, self.session.run(self.names, feeds)))


def run_probe(model: ir.Model, values: Sequence[ir.Value], feeds: dict) -> dict[str, np.ndarray]:
    """Runs ``model`` (unchanged; ``values`` become extra outputs for the run) once on stock onnxruntime."""
    return Prober(model, values).run(feeds)


def synthetic_feeds(graph: ir.Graph, tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Feeds for any graph's inputs (not only a decoder's, unlike ``probe_feeds``): batch 1,
    ``tokens`` new positions, an empty KV cache.

    Token ids / masks / positions [B, S] get [1, tokens]; a past key/value input gets batch 1 and
    past length 0; any other symbolic dim of a float input is the token axis (first) or 1. Token
    ids are drawn below the vocabulary of the constant embedding table they index (2 without
    one), masks are all ones, positions count from 0, float inputs are standard normal.
    """
    feeds = {}
    for v in graph.inputs:
        if v.is_initializer():
            continue
        dims = list(v.shape.dims) if v.shape is not None else []
        dt = v.dtype.numpy()
        name = (v.name or "").lower()
        is_int = np.issubdtype(dt, np.integer)
        is_past = "past" in name or ("cache" in name and not is_int)
        shape, given = [], False
        for i, d in enumerate(dims):
            if _static(d) is not None:
                shape.append(_static(d))
            elif is_past:
                shape.append(1 if i == 0 else 0)
            elif is_int and len(dims) == 2:
                shape.append(1 if i == 0 else tokens)
            else:
                shape.append(1 if given else tokens)
                given = True
        if is_int:
            if "mask" in name:
                feeds[v.name] = np.ones(shape, dt)
            elif "position" in name:
                feeds[v.name] = np.broadcast_to(np.arange(shape[-1], dtype=dt), shape).copy()
            else:
                vocab = 2
                for use in v.uses():
                    n = use.node
                    if n.op_type == "Gather" and const_array(n.inputs[0]) is not None:
                        vocab = n.inputs[0].shape[0]
                feeds[v.name] = rng.integers(0, vocab, shape).astype(dt)
        elif dt == np.bool_:
            feeds[v.name] = np.ones(shape, dt)
        else:
            feeds[v.name] = rng.standard_normal(shape).astype(dt)
    return feeds


def expected_visible(mask: np.ndarray, past: int, seq: int, padding: bool, window: int = 0) -> np.ndarray:
    """allowed[b, i, j]: query i (position past + i) may see key j: causal, within the last
    ``window`` positions when ``window`` > 0 (j > past + i - window), and (``padding``) not a pad."""
    total = past + seq
    i = np.arange(seq)[:, None] + past
    j = np.arange(total)[None, :]
    allowed = j <= i
    if window > 0:
        allowed = allowed & (j > i - window)
    causal = np.broadcast_to(allowed, (mask.shape[0], seq, total))
    if padding:
        return causal & (mask[:, None, :] > 0)
    return causal.copy()


def classify_additive_mask(m: np.ndarray, mask: np.ndarray, past: int, seq: int, window: int = 0) -> str | None:
    """Compares an additive mask (probe output, broadcastable to [B, H, S, P+S]) with causal and
    causal+key-padding (each limited to the last ``window`` positions when ``window`` > 0) on
    the rows of real (non-pad) queries. Returns "causal+padding", "causal" or None (something
    else: another window, bidirectional, a bias)."""
    b = mask.shape[0]
    total = past + seq
    try:
        full = np.broadcast_to(m, (b, m.shape[1] if m.ndim == 4 else 1, seq, total)).astype(np.float64)
    except ValueError:
        return None
    real_q = mask[:, past:] > 0  # [B, S]
    for padding, label in ((True, "causal+padding"), (False, "causal")):
        vis = expected_visible(mask, past, seq, padding, window)  # [B, S, T]
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
# When a KV-cache model's mask shows no window there, it runs once more behind this many keys,
# its past inputs fed with head_dim 0 (no memory; a mask reads the past's length, not its
# values): a window or a chunk (Llama 4's 8192) up to this long is seen too. A model whose mask
# plumbing cannot run that way keeps the LONG_PROBE_KEYS answer.
LONG_PROBE_KEYS_FAR = 1 << 17


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


def _run_mask(proto, mask_name: str, past_names: set, keys: int, seq: int, empty_past: bool = False) -> np.ndarray:
    """The mask ``mask_name`` for one unpadded sequence of ``keys`` tokens whose last ``seq`` are
    new (the rest is past), [..., seq, keys], as the graph computes it (bool, or additive float);
    ``empty_past`` feeds the past inputs with head_dim 0. Raises ValueError naming what stops the run."""
    import onnxruntime as ort

    sub = _subgraph_proto(proto, mask_name)
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
                raise ValueError(f"past input '{name}' has no static head dims")
            if empty_past:
                tt.shape.dim[3].Clear()
                tt.shape.dim[3].dim_param = "empty_head_dim"
            feeds[name] = np.zeros((1, dims[1], keys - seq, 0 if empty_past else dims[3]), dtype)
        else:
            raise ValueError(f"the mask depends on input '{name}'")
    so = ort.SessionOptions()
    so.log_severity_level = 4
    sess = ort.InferenceSession(sub.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, feeds)[0])


def _hidden(m: np.ndarray) -> np.ndarray | None:
    """Which keys a mask hides (True), or None when it adds other values than 0 and <= -1e4."""
    if m.dtype == np.bool_:
        return ~m
    if not np.issubdtype(m.dtype, np.floating):
        return m != 0
    if np.any((m > -1e4) & (m != 0)):
        return None
    return m <= -1e4


def mask_window(proto, mask_name: str, past_names: set, paged: bool) -> tuple[int | None, str]:
    """The sliding window of a causal mask, measured by running the part of the model that
    computes it: 0 when the last query behind LONG_PROBE_KEYS - 1 past tokens (then also behind
    LONG_PROBE_KEYS_FAR - 1 where the plumbing runs that way; LONG_PROBE_PREFILL
    prompt tokens in prefill-only graphs) sees every key; W when it sees exactly the last W keys
    and, run again on W + 9 keys (the last 5 of them new, or all new in prefill-only graphs),
    every query at position p sees exactly the keys k with p - W < k <= p (the contract's
    ``window``); None with the reason (a sentence) otherwise or when the plumbing cannot be run
    this way."""
    keys = LONG_PROBE_KEYS if paged else LONG_PROBE_PREFILL
    bias = "the mask is not causal: it adds values other than 0 and <= -1e4 (a bias)"
    try:
        hidden = _hidden(_run_mask(proto, mask_name, past_names, keys, 1 if paged else keys))
    except Exception as e:  # noqa: BLE001 - reported by the caller as "cannot check"
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return None, f"cannot measure the mask's window: running the mask on {keys} keys failed ({first})"
    if hidden is None:
        return None, bias
    last = hidden[..., -1, :].reshape(-1, hidden.shape[-1])
    if not np.any(last) and paged:
        try:
            far = _hidden(_run_mask(proto, mask_name, past_names, LONG_PROBE_KEYS_FAR, 1, empty_past=True))
        except Exception:  # noqa: BLE001 - plumbing that cannot run this long: the first answer stands
            far = np.zeros((1, 1), bool)
        if far is None:
            return None, bias
        if np.any(far[..., -1, :]):
            keys, hidden = LONG_PROBE_KEYS_FAR, far
            last = hidden[..., -1, :].reshape(-1, hidden.shape[-1])
    if not np.any(last):
        return 0, ""
    rows = np.unique(last, axis=0)
    first_seen = int(np.argmax(~rows[0])) if rows.shape[0] == 1 and np.any(~rows[0]) else -1
    if first_seen < 0 or np.any(rows[0, first_seen:]) or not np.all(rows[0, :first_seen]):
        return None, (f"the mask is not causal, with or without a window: the last of {keys} keys' query "
                      "sees keys that are not one run ending at its own position (not a sliding window)")
    window = keys - first_seen
    total = window + 9
    seq = min(5, total) if paged else total
    try:
        hidden = _hidden(_run_mask(proto, mask_name, past_names, total, seq, empty_past=keys == LONG_PROBE_KEYS_FAR))
    except Exception as e:  # noqa: BLE001
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return None, f"cannot measure the mask's window: running the mask on {total} keys failed ({first})"
    if hidden is None:
        return None, bias
    want = ~expected_visible(np.ones((1, total)), total - seq, seq, False, window)[0]
    try:
        got = np.broadcast_to(hidden, hidden.shape[:-2] + want.shape).reshape(-1, *want.shape)
    except ValueError:
        return None, (f"cannot measure the mask's window: on {total} keys it has shape {list(hidden.shape)}, "
                      f"expected [..., {seq}, {total}]")
    if not np.all(got == want[None]):
        return None, (f"the mask is not causal, with or without a window: the last of {keys} keys' query sees "
                      f"the last {window} keys, but on {total} keys the queries do not (not a sliding window)")
    return window, ""


def onnx_dtype_to_np(elem_type: int):
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(elem_type)


# --- bfloat16 models -----------------------------------------------------------------------------
# onnxruntime's CPU provider has no bfloat16 Mul/MatMul, so a bfloat16 model cannot be probed as it
# is. Its float32 twin can: the same graph with every bfloat16 tensor, value and cast target
# retyped to float32. The twin computes what the bfloat16 graph computes without rounding its
# intermediates to 8 significant bits, so whatever a probe reads from it that does not depend on
# that rounding (mask structure, shapes, which constants are which weights) is the bfloat16 model's.

# Integer attributes that name an element type (Cast's target, the dtype of EyeLike/Random*).
_DTYPE_ATTRS = ("to", "dtype")


def named_values(graph: ir.Graph) -> list[ir.Value]:
    """The graph's inputs, initializers and node outputs (its outputs are among them)."""
    return [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs if o is not None)]


def has_bfloat16(model: ir.Model) -> bool:
    """True when any input, output, initializer or node output of the main graph is bfloat16."""
    return any(v.dtype == ir.DataType.BFLOAT16 for v in named_values(model.graph))


def same_values(model: ir.Model, values: Iterable[ir.Value]) -> list[ir.Value]:
    """The values of ``model`` named as ``values`` (of another copy of it, e.g. its float32 twin)."""
    by_name = {v.name: v for v in named_values(model.graph)}
    return [by_name[v.name] for v in values]


def _subgraphs(graph: ir.Graph) -> list[ir.Graph]:
    """``graph`` and every graph nested in its nodes' attributes (If/Loop/Scan bodies), depth first."""
    out = [graph]
    for node in graph:
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                out += _subgraphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    out += _subgraphs(sub)
    return out


def float32_twin(model: ir.Model) -> ir.Model:
    """A copy of ``model`` computing in float32 what it computes in bfloat16: every bfloat16
    initializer converted (exactly: each bfloat16 value is a float32 value), every bfloat16 value's
    type (inputs, outputs, node outputs, subgraphs included), every ``Cast``/``dtype`` target and
    every bfloat16 tensor attribute (``Constant``, ``ConstantOfShape``) made float32. Names are
    kept, so a value of the twin answers for the value of the same name in ``model``. ``model`` is
    unchanged; the twin holds float32 copies of the converted initializers (twice their bytes)."""
    bf16, f32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    twin = model.clone()
    for graph in _subgraphs(twin.graph):
        for v in graph.initializers.values():
            if v.dtype == bf16 and v.const_value is not None:
                v.const_value = ir.tensor(v.const_value.numpy().astype(np.float32), name=v.name)
        values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
        values += [o for n in graph for o in n.outputs if o is not None]
        for v in values:
            if v.dtype == bf16:  # a new type: the clone shares the type objects with ``model``
                v.type = ir.TensorType(f32)
        for node in graph:
            for name, attr in list(node.attributes.items()):
                if name in _DTYPE_ATTRS and attr.type == ir.AttributeType.INT and attr.value == bf16:
                    node.attributes[name] = ir.AttrInt64(name, int(f32))
                elif attr.type == ir.AttributeType.TENSOR and attr.value.dtype == bf16:
                    arr = attr.value.numpy().astype(np.float32)
                    node.attributes[name] = ir.AttrTensor(name, ir.tensor(arr, name=attr.value.name))
    return twin


def float32_io(model: ir.Model) -> ir.Model:
    """A copy of ``model`` whose bfloat16 inputs and outputs are float32 at the interface: a Cast
    to bfloat16 after each such input and a Cast to float32 before each such output, the
    computation inside unchanged. onnxruntime's Python API neither feeds nor returns bfloat16
    numpy arrays, so a bfloat16 model runs through the runtime (and ``ort-ops verify``) this way;
    float32 -> bfloat16 -> float32 round-trips the values the model exchanges exactly."""
    bf16, f32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT
    wrapped = model.clone()
    graph = wrapped.graph
    front = []
    for i, v in enumerate(list(graph.inputs)):
        if v.dtype != bf16 or v.is_initializer():
            continue
        outer = ir.Value(name=v.name, type=ir.TensorType(f32), shape=v.shape)
        v.name = f"{v.name}/bfloat16"
        cast = ir.node("Cast", [outer], {"to": int(bf16)}, name=f"{outer.name}/to_bfloat16")
        ir.convenience.replace_all_uses_with(v, cast.outputs[0])
        cast.outputs[0].name, cast.outputs[0].type, cast.outputs[0].shape = v.name, ir.TensorType(bf16), v.shape
        graph.inputs[i] = outer
        front.append(cast)
    if front:
        graph.insert_before(next(iter(graph)), front)
    for i, v in enumerate(list(graph.outputs)):
        if v.dtype != bf16:
            continue
        name = v.name
        v.name = f"{name}/bfloat16"
        cast = ir.node("Cast", [v], {"to": int(f32)}, name=f"{name}/to_float")
        out = cast.outputs[0]
        out.name, out.type, out.shape = name, ir.TensorType(f32), v.shape
        graph.append(cast)
        graph.outputs[i] = out
    return wrapped
