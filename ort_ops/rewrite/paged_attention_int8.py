# SPDX-License-Identifier: MIT
"""Replaces the attention of exported decoders by ``QuantizeKVCache`` + ``PagedAttentionInt8``.

Alphabet: B batch, S new tokens, P past tokens, T packed tokens (all sequences, no padding),
Hq / Hkv query / kv heads, D head_dim, N cache blocks, Bs block size, M blocks per sequence.

Forms matched (``graphs/export_fixtures.py`` exports each; ``graphs/attention.py`` builds them):

* MatMul form (torch.onnx dynamo sdpa/eager, the legacy TorchScript exporter, optimum,
  transformers' OnnxExporter): ``MatMul(q*c, K^T*c) [*|/ c] [softcap] [+ mask] -> Softmax ->
  [Where(IsNaN)] -> MatMul(., V)``, K/V through repeat_kv (Unsqueeze, Expand, Reshape) and
  ``Concat(past, new)``; softcap = ``Mul(Tanh(Div(s, c)), c)`` (Gemma 2) becomes the op's
  ``softcap``. gpt-oss's sinks: ``Concat(scores, sink) -> [Sub(., ReduceMax)] -> Softmax ->
  Slice [..., :-1] -> MatMul(., V)``, the per-head constant becoming the op's ``head_sink``.
  An onnxscript rewrite rule (pattern + check + rewrite) matches the core; the operand plumbing
  (scalar scales, K transposes, repeat_kv, the past Concat) is decoded by helpers shared by
  ``check`` and ``rewrite``.
* The ONNX ``Attention`` op (opset 23), a single node, matched by walking the graph (its
  ``softcap`` is the op's).
* ``com.microsoft`` ``GroupQueryAttention``: KV-cache graphs (rotary moved in front of the
  cache) and prefill-only graphs (no past; emitted in the prefill form below, its present
  outputs the rotated K and the V); ``local_window_size``, ``softcap`` and a constant
  ``head_sink`` map to the op's window, softcap and head_sink.

Positions a KV-cache graph computes from the cache length (no position_ids input) are replaced
by the paged ``position_ids`` (``_positions_from_cache_length``). Graphs that onnxruntime runs on
batches of one only are probed on one left-padded row. float16 graphs run the ops in float16.
bfloat16 graphs are probed as their float32 twin (``_graph.float32_twin``: ORT's CPU provider has
no bfloat16 Mul/MatMul) and run the ops on float32: Casts of query, key and value to float32
(exact) in front, one of the output back to bfloat16.

What a match checks: softmax over the key axis, a mask that is causal (and key-padding), limited
or not to the last W positions -- decided by running the original graph on a left-padded probe
batch and the mask plumbing alone on long sequences (``_graph.mask_window``: W is measured per
mask, so per layer) -- head counts
(Hq % Hkv == 0), a supported head_dim (32, 64, 80, 96, 128, 256) and scalar scales. Anything else is
declined with a reason and stays as it was.

Rewritten interfaces:

* KV-cache models (past in, present out) become *paged*: tokens are packed as one batch row
  (``input_ids``/``position_ids`` [1, T]); inputs ``slot_mapping`` int64 [T], ``block_tables``
  int32 [S, M], ``seq_lens`` int32 [S], ``cu_seqlens_q`` int32 [S+1] and per layer i
  ``kv_cache.{i}.key`` int8 [N, Hkv, Bs, D], ``kv_cache.{i}.value`` int8 [N, Hkv, D, Bs],
  ``kv_cache.{i}.key_scale`` / ``.value_scale`` float32 [N, Hkv, Bs]; outputs ``logits`` and
  ``kv_cache_out.{i}.*`` (the runtime binds each to its input's buffer). ``attention_mask`` and
  past/present disappear. The model's ``metadata_props["ort_ops.paged"]`` describes it (JSON).
  KV conversion is all-or-nothing: if any layer declines, the model is left unchanged.
* Prefill-only models keep their interface: K/V are quantized into a cache built inside the graph
  (one run), the attention_mask's real tokens are packed (NonZero) so padding is honoured, and the
  output is scattered back to [B, Hq, S, D] (zeros on pad rows).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchFailureError

from ort_ops._domain import DOMAIN, OPSET_VERSION
from ort_ops.rewrite import _graph as g
from ort_ops.rewrite.pipeline import Decline, FusionResult, RewriteOptions

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # the CPU kernels'; the CUDA EP refuses 80, 96 by name
# The paged model's inputs, outputs and metadata: the contract with the runtime.
from ort_ops.paged_interface import (  # noqa: E402
    BLOCK_TABLES, CACHE_PARTS, CU_SEQLENS_Q, NEXT_TOKEN, PAGED_META_KEY, SEQ_LENS, SLOT_MAPPING, STEP_TABLES,
    cache_input_name, cache_output_name, cache_shapes, make_metadata)


@dataclasses.dataclass
class _Ctx:
    """What one fusion run knows about the model (filled before the rules run)."""

    model: ir.Model
    options: RewriteOptions
    paged: bool
    past_layer: dict  # past K or V graph input -> (layer index, "key" | "value")
    probes: dict  # value name -> probe array
    probes2: dict  # the same values on a second probe of other sizes (what does not change is structural)
    probe_mask: np.ndarray | None
    probe_past: int
    probe_error: str | None
    proto: Any = None  # the model as it came in (the long mask probe runs parts of it)
    bfloat16: bool = False  # a bfloat16 model (probed as its float32 twin; the ops run in float32)
    window_checked: dict = dataclasses.field(default_factory=dict)  # mask name -> (window, reason or "")
    shared: dict = dataclasses.field(default_factory=dict)
    cache_out: dict = dataclasses.field(default_factory=dict)  # layer -> 4 output values
    outputs_made: set = dataclasses.field(default_factory=set)  # ids of attention outputs we emit
    declines: dict = dataclasses.field(default_factory=dict)  # where -> reason
    forms: dict = dataclasses.field(default_factory=dict)
    layer_dims: dict = dataclasses.field(default_factory=dict)  # layer -> (Hkv, D)
    fused_attrs: list = dataclasses.field(default_factory=list)  # per fused block: what the report shows


@dataclasses.dataclass
class _Attn:
    """A decoded attention block, the same for every form."""

    q_BHSD: ir.Value
    k_new_BHSD: ir.Value
    v_new_BHSD: ir.Value
    past_k: ir.Value | None
    past_v: ir.Value | None
    hq: int
    hkv: int
    d: int
    scale: float
    mask_kind: str  # "causal+padding" | "causal"
    window: int = 0  # the op's ``window``: the last ``window`` positions are visible (0: all)
    softcap: float = 0.0  # the op's ``softcap`` (0: none)
    sink: np.ndarray | None = None  # float32 [Hq]: the op's ``head_sink`` input (None: no sink)


# --- decoding the operands -----------------------------------------------------------------------


def _strip_scalar_scale(v: ir.Value) -> tuple[ir.Value, float]:
    """x*c or x/c with a constant scalar c -> (x, factor); anything else -> (v, 1)."""
    factor = 1.0
    for _ in range(2):
        node = v.producer()
        if node is None or node.op_type not in ("Mul", "Div") or node.domain not in ("", "ai.onnx"):
            break
        a, b = node.inputs[0], node.inputs[1]
        cb, ca = g.const_scalar(b), g.const_scalar(a)
        if cb is not None:
            factor *= cb if node.op_type == "Mul" else 1.0 / cb
            v = a
        elif ca is not None and node.op_type == "Mul":
            factor *= ca
            v = b
        else:
            break
    return v, factor


def _probe_shape(ctx: _Ctx, v: ir.Value) -> tuple | None:
    arr = ctx.probes.get(v.name)
    return None if arr is None else tuple(arr.shape)


def _peel_bshd_roundtrip(ctx: _Ctx, v: ir.Value) -> ir.Value | None:
    """x [B, H, S, D] -> Transpose(0,2,1,3) -> Reshape [B, S, H*D] -> Reshape [B, S, H, D]: the
    BSHD round trip ORT-fused exports put between repeat_kv and the attention. Returns x when
    ``v`` is such a round trip's [B, S, H, D] end (proved on the probe run's shapes), else None."""
    hops, cur = 0, v
    while hops < 3:
        node = g.producer(cur, "Reshape")
        if node is None:
            break
        cur, hops = node.inputs[0], hops + 1
    t = g.producer(cur, "Transpose")
    if hops == 0 or t is None or g.attr_ints(t, "perm") != [0, 2, 1, 3]:
        return None
    x = t.inputs[0]
    sv, sx = _probe_shape(ctx, v), _probe_shape(ctx, x)
    if sv is None or sx is None or len(sx) != 4 or sv != (sx[0], sx[2], sx[1], sx[3]):
        return None
    return x


def _untranspose_key(ctx: _Ctx, kt: ir.Value) -> ir.Value:
    """K^T [B, H, D, Skv] -> K [B, H, Skv, D]: Transpose(perm 0,1,3,2), the 3-D Reshape ->
    Transpose(0,2,1) -> Reshape the dynamo exporter writes, or Transpose(0,2,3,1) of a BSHD
    round trip (transformers' exporter with ort_fusions)."""
    node = g.producer(kt, "Transpose")
    if node is not None:
        perm = g.attr_ints(node, "perm")
        if perm == [0, 1, 3, 2]:
            return node.inputs[0]
        if perm == [0, 2, 3, 1]:
            x = _peel_bshd_roundtrip(ctx, node.inputs[0])
            if x is not None:
                return x
        raise MatchFailureError(f"key transpose perm {perm} of a layout the rewrite does not know")
    node = g.producer(kt, "Reshape")
    t = g.producer(node.inputs[0], "Transpose") if node is not None else None
    inner = g.producer(t.inputs[0], "Reshape") if t is not None else None
    if inner is not None and g.attr_ints(t, "perm") == [0, 2, 1]:
        k = inner.inputs[0]
        if _rank(ctx, k) == 4:
            return k
    raise MatchFailureError("the key operand is not a transposed key (K^T) the rewrite knows")


def _unround_value(ctx: _Ctx, v: ir.Value) -> ir.Value:
    """V through a BSHD round trip and back (Transpose(0,2,1,3)) -> the BHSD V before it."""
    t = g.producer(v, "Transpose")
    if t is not None and g.attr_ints(t, "perm") == [0, 2, 1, 3]:
        x = _peel_bshd_roundtrip(ctx, t.inputs[0])
        if x is not None:
            return x
    return v


def _strip_repeat_kv(v: ir.Value) -> ir.Value:
    """repeat_kv: Reshape(Expand(Unsqueeze(x, 2), [B, Hkv, n, S, D]), [B, Hkv*n, S, D]) -> x."""
    r = g.producer(v, "Reshape")
    e = g.producer(r.inputs[0], "Expand") if r is not None else None
    u = g.producer(e.inputs[0], "Unsqueeze") if e is not None else None
    if u is None:
        return v
    axes = g.const_array(u.inputs[1]) if len(u.inputs) > 1 else None
    if axes is None and "axes" in u.attributes:
        axes = np.array(g.attr_ints(u, "axes"))
    if axes is None or [int(a) for a in np.ravel(axes)] not in ([2], [-3]):
        raise MatchFailureError("repeat_kv Unsqueeze is not on axis 2")
    return u.inputs[0]


def _skip_copies(v: ir.Value) -> ir.Value:
    """Through Identity and one-input Concat (the TorchScript exporter's copy of the past)."""
    while True:
        node = v.producer()
        if node is None or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
            return v
        if node.op_type not in ("Identity", "Concat"):
            return v
        v = node.inputs[0]


def _split_past(v: ir.Value, ctx: _Ctx) -> tuple[ir.Value | None, ir.Value]:
    """Concat(past, new, axis=2) -> (past graph input, new); anything else -> (None, v)."""
    node = g.producer(v, "Concat")
    if node is None:
        return None, v
    axis = g.attr_int(node, "axis")
    if axis not in (2, -2) or len(node.inputs) != 2:
        raise MatchFailureError(f"past/new Concat on axis {axis}, expected 2")
    past, new = _skip_copies(node.inputs[0]), node.inputs[1]
    if past not in ctx.past_layer:
        raise MatchFailureError(f"the concatenated past '{past.name}' is not a graph input")
    return past, new


def _dim(ctx: _Ctx, v: ir.Value, axis: int) -> int | None:
    """A static dim from the graph, else from the probe run (head counts and head_dim do not
    depend on the probe's batch or length, so the probe's value is the model's)."""
    d = g.dim(v, axis)
    if d is None and v.name in ctx.probes:
        shape = ctx.probes[v.name].shape
        d = shape[axis] if -len(shape) <= axis < len(shape) else None
    return d


def _rank(ctx: _Ctx, v: ir.Value) -> int | None:
    r = g.rank(v)
    if r is None and v.name in ctx.probes:
        r = ctx.probes[v.name].ndim
    return r


def _check_dims(ctx: _Ctx, q: ir.Value, k_new: ir.Value, v_new: ir.Value) -> tuple[int, int, int]:
    for name, val in (("query", q), ("key", k_new), ("value", v_new)):
        if _rank(ctx, val) != 4:
            raise MatchFailureError(f"{name} must have rank 4 [B, H, S, D], got rank {_rank(ctx, val)}")
    hq, d, hkv = _dim(ctx, q, 1), _dim(ctx, q, 3), _dim(ctx, k_new, 1)
    if None in (hq, d, hkv):
        raise MatchFailureError(f"head counts/head_dim are not static (Hq={hq}, Hkv={hkv}, D={d})")
    if _dim(ctx, v_new, 1) not in (None, hkv) or _dim(ctx, v_new, 3) not in (None, d) or \
            _dim(ctx, k_new, 3) not in (None, d):
        raise MatchFailureError("key/value head counts or head_dim differ")
    if ctx.bfloat16 and q.dtype is None:
        raise MatchFailureError("a bfloat16 model whose query has no recorded element type: the Casts "
                                "around the ops (which take float32/float16) cannot be placed")
    if d not in SUPPORTED_HEAD_DIMS:
        raise MatchFailureError(f"head_dim must be one of {{{', '.join(map(str, SUPPORTED_HEAD_DIMS))}}}, got {d}")
    if hq % hkv:
        raise MatchFailureError(f"query heads ({hq}) are not a multiple of kv heads ({hkv})")
    return hq, hkv, d


def _mask_kind(mask: ir.Value | None, ctx: _Ctx, causal_attr: bool = False) -> tuple[str, int]:
    """(kind, window) of an attention's mask: kind "causal+padding" or "causal", window the op's
    ``window`` (0: none). The window is measured on long runs of the mask plumbing
    (``g.mask_window``), per mask, so layers with and without a window each get their own;
    the short probe then checks causality and key padding with that window."""
    if mask is None:
        if causal_attr:
            return "causal", 0
        raise MatchFailureError("no attention mask: the attention is not causal")
    if ctx.probe_error:
        raise MatchFailureError(f"cannot check the mask: {ctx.probe_error}")
    arr = ctx.probes.get(mask.name)
    if arr is None:
        raise MatchFailureError(f"cannot check the mask '{mask.name}': not probed")
    if causal_attr:
        raise MatchFailureError("is_causal together with a mask is not supported")
    if mask.name not in ctx.window_checked:
        window, detail = g.mask_window(ctx.proto, mask.name, {v.name for v in ctx.past_layer}, ctx.paged)
        ctx.window_checked[mask.name] = (window or 0, "" if window is not None else detail)
    window, reason = ctx.window_checked[mask.name]
    if reason:
        raise MatchFailureError(reason)
    if arr.dtype == np.bool_:
        arr = np.where(arr, 0.0, -np.inf)  # a boolean attn_mask: True = may attend
    kind = g.classify_additive_mask(arr, ctx.probe_mask, ctx.probe_past, g.PROBE_SEQ, window)
    if kind is None:
        what = f"causal with a window of {window}" if window else "causal"
        raise MatchFailureError(f"the mask is not {what} (and key-padding) on the probe batch: a bias, "
                                "bidirectional or other mask the paged op cannot express")
    return kind, window


def _softcap(cap_in: ir.Value | None, cap_out: ir.Value | None) -> float:
    """The c of ``Mul(Tanh(Div(scores, c)), c)`` (Gemma 2's attn_logit_softcapping): both
    constants must be the same finite positive scalar, as the op's ``softcap`` computes it
    (one division, tanh, one multiply); 0.0 when there is no softcap."""
    if cap_in is None and cap_out is None:
        return 0.0
    c_in, c_out = g.const_scalar(cap_in), g.const_scalar(cap_out)
    if c_in is None or c_out is None:
        raise MatchFailureError("softcap Div/Mul around the Tanh are not constant scalars")
    if c_in != c_out or not math.isfinite(c_in) or c_in <= 0:
        raise MatchFailureError(f"softcap divides by {c_in} and multiplies by {c_out}: the op needs one "
                                "finite positive constant for both")
    return float(np.float32(c_in))


def _sink_per_head(ctx: _Ctx, sink: ir.Value, hq: int) -> np.ndarray:
    """The per-q-head sink logits [Hq] float32 behind the value concatenated to the scores
    (gpt-oss: ``sinks.reshape(1, -1, 1, 1).expand(B, -1, S, -1)``): a constant reached through
    Expand/Reshape/Unsqueeze/Cast/Identity whose values lie on the head axis (axis 1 of
    [B, Hq, S, 1]), or one value for every head; the probe run must show the expanded value
    equal to it on every row."""
    v, hops = sink, 0
    while g.const_array(v) is None and hops < 6:
        node = v.producer()
        if node is None or node.op_type not in ("Expand", "Reshape", "Unsqueeze", "Cast", "Identity"):
            break
        v, hops = node.inputs[0], hops + 1
    arr = g.const_array(v)
    if arr is None:
        raise MatchFailureError("the value concatenated to the scores (sinks) is not a constant")
    shape = (1,) * (4 - arr.ndim) + tuple(arr.shape) if arr.ndim <= 4 else None
    if arr.size != 1 and (arr.size != hq or shape is None or shape[1] != hq or shape[0] != 1 or shape[2] != 1
                          or shape[3] != 1):
        raise MatchFailureError(f"sinks constant of shape {list(arr.shape)}, expected one value per query head "
                                f"({hq}) on the head axis, or one for all")
    per_head = np.broadcast_to(np.asarray(arr, np.float32).reshape(-1), (hq,)).copy()
    if not np.all(np.isfinite(per_head)):
        raise MatchFailureError("sinks constant has non-finite values")
    probed = g.const_array(sink) if g.const_array(sink) is not None else ctx.probes.get(sink.name)
    if probed is not None and probed.ndim < 4:
        probed = probed.reshape((1,) * (4 - probed.ndim) + probed.shape)
    if probed is None or probed.ndim != 4 or probed.shape[1] != hq or probed.shape[3] != 1 or \
            not np.array_equal(probed.astype(np.float32), np.broadcast_to(per_head.reshape(1, hq, 1, 1), probed.shape)):
        raise MatchFailureError("the probe run does not show the sinks as one constant per query head on "
                                "every row")
    return per_head


def _check_sink_softmax(cat: ir.Value, probs: ir.Value, kept: ir.Value, max_node: ir.Node | None) -> None:
    """Concat(scores, sink) on the key axis [-> Sub(., ReduceMax(., key axis, keepdims))] ->
    Softmax(key axis) -> Slice [..., :-1]: the sink joins the denominator and is dropped before
    P.V (subtracting the row max does not change a softmax)."""
    last = lambda axis, rank: axis == -1 or (rank is not None and axis == rank - 1)
    c = cat.producer()
    if len(c.inputs) != 2 or not last(g.attr_int(c, "axis", 0), g.rank(cat)):
        raise MatchFailureError("the sinks Concat is not of two values on the key axis")
    if max_node is not None:
        axes = g.const_array(max_node.inputs[1]) if len(max_node.inputs) > 1 else None
        if axes is None and "axes" in max_node.attributes:
            axes = np.array(g.attr_ints(max_node, "axes"))
        if axes is None or axes.size != 1 or not last(int(axes.reshape(())), g.rank(cat)) or \
                g.attr_int(max_node, "keepdims", 1) != 1:
            raise MatchFailureError("the max subtracted before the sinks softmax is not over the key axis")
    sl = kept.producer()
    ins = list(sl.inputs) + [None] * (5 - len(sl.inputs))
    starts, ends, axes, steps = (g.const_array(i) if i is not None else None for i in ins[1:5])
    ok = starts is not None and ends is not None and axes is not None and starts.size == ends.size == axes.size == 1
    ok = ok and int(starts.reshape(())) == 0 and int(ends.reshape(())) == -1 and last(int(axes.reshape(())), g.rank(probs))
    ok = ok and (steps is None or (steps.size == 1 and int(steps.reshape(())) == 1))
    if not ok:
        raise MatchFailureError("the sinks softmax is not sliced to [..., :-1] on the key axis")


def _decode_matmul_form(ctx: _Ctx, query, key_t, value, mask, qk_scale, qk_scaling, nan_fill,
                        probs, cap_in=None, cap_out=None, sink=None) -> _Attn:
    sm = probs.producer()
    axis = g.attr_int(sm, "axis", -1)
    r = g.rank(probs)
    if not (axis == -1 or (r is not None and axis == r - 1)):
        raise MatchFailureError(f"Softmax over axis {axis}, not the key axis (-1)")
    if nan_fill is not None and g.const_scalar(nan_fill) != 0.0:
        raise MatchFailureError("Where(IsNaN(P), c, P) with c != 0")
    q, sq = _strip_scalar_scale(query)
    kt, sk = _strip_scalar_scale(key_t)
    sqk = 1.0
    if qk_scaling in ("Mul", "Div"):
        c = g.const_scalar(qk_scale)
        if c is None:
            raise MatchFailureError("the score scale is not a constant scalar")
        sqk = c if qk_scaling == "Mul" else 1.0 / c
    k_full = _untranspose_key(ctx, kt)
    past_k, k_new = _split_past(_strip_repeat_kv(k_full), ctx)
    past_v, v_new = _split_past(_strip_repeat_kv(_unround_value(ctx, value)), ctx)
    if ctx.paged:
        if past_k is None or past_v is None:
            raise MatchFailureError("KV-cache model, but this attention does not read a past key and value")
        if ctx.past_layer[past_k][0] != ctx.past_layer[past_v][0]:
            raise MatchFailureError("key and value come from different layers' past")
    elif past_k is not None or past_v is not None:
        raise MatchFailureError("past concatenated in a model without a cache interface")
    hq, hkv, d = _check_dims(ctx, q, k_new, v_new)
    softcap = _softcap(cap_in, cap_out)
    head_sink = _sink_per_head(ctx, sink, hq) if sink is not None else None
    kind, window = _mask_kind(mask, ctx)
    return _Attn(q, k_new, v_new, past_k, past_v, hq, hkv, d, sq * sk * sqk, kind, window, softcap, head_sink)


# --- emitting the replacement -------------------------------------------------------------------


def _ints(op, values: list[int]):
    return op.Constant(value=ir.tensor(np.array(values, np.int64)))


def _prefill_plumbing(op, ctx: _Ctx, q_BHSD: ir.Value, use_padding: bool) -> dict:
    """Index tensors shared by every layer of a prefill graph (built once, on the first match)."""
    key = ("prefill", use_padding)
    if key in ctx.shared:
        return ctx.shared[key]
    bs = ctx.options.block_size
    shape = op.Shape(q_BHSD)
    b = op.Slice(shape, _ints(op, [0]), _ints(op, [1]))
    s = op.Slice(shape, _ints(op, [2]), _ints(op, [3]))
    am_input = ctx.shared.get("attention_mask") if use_padding else None
    if am_input is not None:
        am = op.Cast(am_input, to=ir.DataType.INT64)
    else:
        am = op.ConstantOfShape(op.Concat(b, s, axis=0), value=ir.tensor(np.array([1], np.int64)))
    # Real tokens, packed: row-major positions of attention_mask == 1.
    idx = op.Reshape(op.NonZero(op.Reshape(am, _ints(op, [-1]))), _ints(op, [-1]))
    seq_lens64 = op.ReduceSum(am, _ints(op, [1]), keepdims=0)
    seq_lens = op.Cast(seq_lens64, to=ir.DataType.INT32)
    cu = op.Concat(op.Constant(value=ir.tensor(np.array([0], np.int32))),
                   op.Cast(op.CumSum(seq_lens64, _ints(op, [0])), to=ir.DataType.INT32), axis=0)
    # Row b owns blocks [b*nblk, (b+1)*nblk); its r-th real token goes to slot b*nblk*Bs + r.
    nblk = op.Div(op.Add(s, _ints(op, [bs - 1])), _ints(op, [bs]))
    rows = op.Range(op.Constant(value=ir.tensor(np.array(0, np.int64))), op.Squeeze(b, _ints(op, [0])),
                    op.Constant(value=ir.tensor(np.array(1, np.int64))))
    row_base = op.Unsqueeze(op.Mul(rows, op.Mul(nblk, _ints(op, [bs]))), _ints(op, [1]))
    rank_in_row = op.Sub(op.CumSum(am, _ints(op, [1])), _ints(op, [1]))
    slots = op.Gather(op.Reshape(op.Add(row_base, rank_in_row), _ints(op, [-1])), idx, axis=0)
    blocks = op.Range(op.Constant(value=ir.tensor(np.array(0, np.int64))), op.Squeeze(nblk, _ints(op, [0])),
                      op.Constant(value=ir.tensor(np.array(1, np.int64))))
    tables = op.Cast(op.Add(op.Unsqueeze(op.Mul(rows, nblk), _ints(op, [1])),
                            op.Unsqueeze(blocks, _ints(op, [0]))), to=ir.DataType.INT32)
    num_blocks = op.Mul(b, nblk)
    out = {"idx": idx, "idx2": op.Unsqueeze(idx, _ints(op, [1])), "seq_lens": seq_lens, "cu": cu,
               "slots": slots, "tables": tables, "num_blocks": num_blocks}
    ctx.shared[key] = out
    return out


def _emit(op, ctx: _Ctx, a: _Attn):
    """QuantizeKVCache + PagedAttentionInt8 for one decoded block; returns the [B, Hq, S, D] output."""
    opts = ctx.options
    to_THD = lambda x, h: op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), _ints(op, [-1, h, a.d]))
    q_THD, k_THD, v_THD = to_THD(a.q_BHSD, a.hq), to_THD(a.k_new_BHSD, a.hkv), to_THD(a.v_new_BHSD, a.hkv)
    # The ops take float32/float16: a bfloat16 block runs them on float32 (exact upcasts) and
    # gives its output back in bfloat16. (A query built here for the GQA form has no type yet: in
    # a bfloat16 model it is bfloat16.)
    bf16 = a.q_BHSD.dtype == ir.DataType.BFLOAT16 or a.q_BHSD.dtype is None and ctx.bfloat16
    if bf16:
        q_THD, k_THD, v_THD = (op.Cast(x, to=ir.DataType.FLOAT) for x in (q_THD, k_THD, v_THD))
    attrs = {"qk_quant": opts.qk_quant, "pv_quant": opts.pv_quant}
    if not math.isclose(a.scale, 1.0 / math.sqrt(a.d), rel_tol=1e-6):
        attrs["scale"] = float(a.scale)
    if a.window:
        attrs["window"] = int(a.window)
    if a.softcap:
        attrs["softcap"] = float(a.softcap)
    # optional input 8 head_sink float32 [Hq]
    extra = [op.Constant(value=ir.tensor(a.sink.astype(np.float32)))] if a.sink is not None else []
    ctx.fused_attrs.append({"layer": ctx.past_layer[a.past_k][0] if ctx.paged else None, "window": int(a.window),
                            "softcap": float(a.softcap),
                            "head_sink": None if a.sink is None else [float(x) for x in a.sink]})
    if ctx.paged:
        layer = ctx.past_layer[a.past_k][0]
        caches = [ctx.shared["cache_in"][(layer, p)] for p in CACHE_PARTS]
        outs = op.QuantizeKVCache(k_THD, v_THD, ctx.shared[SLOT_MAPPING], *caches, _domain=DOMAIN, _outputs=4)
        ctx.cache_out[layer] = outs
        ctx.layer_dims[layer] = (a.hkv, a.d)
        o_THD = op.PagedAttentionInt8(q_THD, *outs, ctx.shared[BLOCK_TABLES], ctx.shared[SEQ_LENS],
                                      ctx.shared[CU_SEQLENS_Q], *extra, _domain=DOMAIN, **attrs)
        o = op.Transpose(op.Reshape(o_THD, _ints(op, [1, -1, a.hq, a.d])), perm=[0, 2, 1, 3])
    else:
        p = _prefill_plumbing(op, ctx, a.q_BHSD, a.mask_kind == "causal+padding")
        bs = opts.block_size
        nb = p["num_blocks"]
        zeros = lambda shape, dt: op.ConstantOfShape(shape, value=ir.tensor(np.zeros(1, dt)))
        kc = zeros(op.Concat(nb, _ints(op, [a.hkv, bs, a.d]), axis=0), np.int8)
        vc = zeros(op.Concat(nb, _ints(op, [a.hkv, a.d, bs]), axis=0), np.int8)
        ks = zeros(op.Concat(nb, _ints(op, [a.hkv, bs]), axis=0), np.float32)
        vs = zeros(op.Concat(nb, _ints(op, [a.hkv, bs]), axis=0), np.float32)
        gather = lambda x: op.Gather(x, p["idx"], axis=0)
        outs = op.QuantizeKVCache(gather(k_THD), gather(v_THD), p["slots"], kc, vc, ks, vs,
                                  _domain=DOMAIN, _outputs=4)
        o_packed = op.PagedAttentionInt8(gather(q_THD), *outs, p["tables"], p["seq_lens"], p["cu"], *extra,
                                         _domain=DOMAIN, **attrs)
        o_all = op.ScatterND(op.Mul(q_THD, op.CastLike(op.Constant(value=ir.tensor(np.array(0.0, np.float32))),
                                                        q_THD)),
                             p["idx2"], o_packed)
        q_BSHD_shape = op.Shape(op.Transpose(a.q_BHSD, perm=[0, 2, 1, 3]))
        o = op.Transpose(op.Reshape(o_all, q_BSHD_shape), perm=[0, 2, 1, 3])
    if bf16:
        o = op.Cast(o, to=ir.DataType.BFLOAT16)
    ctx.outputs_made.add(o)
    return o


# --- the MatMul form as an onnxscript rule ------------------------------------------------------


def _scores_pattern(op, query, key_t, qk_scale, cap_in, cap_out, mask):
    """scores [B, Hq, S, Skv] = q [B, Hq, S, D] @ K^T [B, Hq, D, Skv], then the optional scale,
    softcap and additive mask, in the op's order (scale -> softcap -> mask)."""
    scores = op.MatMul(query, key_t)
    # Optional scale on the scores (eager attention; sdpa scales q and K^T instead).
    scores = pattern.OrValue([op.Mul(scores, qk_scale), op.Div(scores, qk_scale), scores],
                             tag_var="qk_scaling", tag_values=["Mul", "Div", "None"])
    # Optional softcap: c * tanh(scores / c) (Gemma 2's attn_logit_softcapping).
    scores = pattern.OrValue([op.Mul(op.Tanh(op.Div(scores, cap_in)), cap_out), scores],
                             tag_var="has_softcap", tag_values=[True, False])
    # Optional additive mask (causal + padding, with or without a window, checked by probing).
    return pattern.OrValue([op.Add(scores, mask), scores], tag_var="has_mask", tag_values=[True, False])


class _AttentionRule(pattern.RewriteRuleClassBase):
    """check/rewrite shared by the MatMul-form rules: both decode the match with
    ``_decode_matmul_form`` (the rule's ``_decode`` maps its bindings to that)."""

    def __init__(self, name: str, ctx: _Ctx):
        super().__init__(name=name)
        self._ctx = ctx

    def check(self, context, probs, **binds):
        where = probs.producer().name or "Softmax"
        try:
            self._decode(probs=probs, **binds)
        except MatchFailureError as e:
            self._ctx.declines.setdefault(where, e.reason if hasattr(e, "reason") else str(e))
            return pattern.MatchResult().fail(str(getattr(e, "reason", e)))
        self._ctx.declines.pop(where, None)
        return pattern.MatchResult()

    def rewrite(self, op, probs, **binds):
        a = self._decode(probs=probs, **binds)
        self._ctx.forms["matmul"] = self._ctx.forms.get("matmul", 0) + 1
        return _emit(op, self._ctx, a)


class MatMulSoftmaxAttention(_AttentionRule):
    """``MatMul(q, K^T) [*c] [softcap] [+mask] -> Softmax -> [Where(IsNaN)] -> MatMul(., V)``."""

    def __init__(self, ctx: _Ctx):
        super().__init__("PagedAttentionInt8_MatMulSoftmax", ctx)

    def pattern(self, op, query, key_t, value, mask, qk_scale, nan_fill, cap_in, cap_out):
        scores = _scores_pattern(op, query, key_t, qk_scale, cap_in, cap_out, mask)
        probs = op.Softmax(scores, _outputs=["probs"])
        # sdpa's guard against fully masked rows (NaN -> 0).
        probs = pattern.OrValue([op.Where(op.IsNaN(probs), nan_fill, probs), probs],
                                tag_var="nan_guard", tag_values=[True, False])
        # out [B, Hq, S, D] = P [B, Hq, S, Skv] @ V [B, Hq, Skv, D]
        return op.MatMul(probs, value)

    def _decode(self, query, key_t, value, probs, mask=None, qk_scale=None, qk_scaling="None", nan_fill=None,
                cap_in=None, cap_out=None, **_):
        return _decode_matmul_form(self._ctx, query, key_t, value, mask, qk_scale, qk_scaling, nan_fill, probs,
                                   cap_in, cap_out)


class MatMulSinkSoftmaxAttention(_AttentionRule):
    """gpt-oss's attention sinks: ``MatMul(q, K^T) [*c] [softcap] [+mask] -> Concat(., sink) ->
    [Sub(., ReduceMax(.))] -> Softmax -> Slice [..., :-1] -> MatMul(., V)``; the per-head sink
    constant becomes the op's ``head_sink`` input."""

    def __init__(self, ctx: _Ctx):
        super().__init__("PagedAttentionInt8_MatMulSinkSoftmax", ctx)

    def pattern(self, op, query, key_t, value, mask, qk_scale, cap_in, cap_out, sink, max_axes, starts, ends,
                axes, steps):
        scores = _scores_pattern(op, query, key_t, qk_scale, cap_in, cap_out, mask)
        # [B, Hq, S, Skv + 1]: the sink logit joins each row
        cat = op.Concat(scores, sink, _outputs=["cat"])
        # Optional max subtraction (gpt-oss's, against overflow), the max reduced over the key axis
        row_max = pattern.OrValue([op.ReduceMax(cat, max_axes, _outputs=["row_max"]),
                                   op.ReduceMax(cat, _outputs=["row_max"])], tag_var="max_axes_input",
                                  tag_values=[True, False])
        logits = pattern.OrValue([op.Sub(cat, row_max), cat], tag_var="max_sub", tag_values=[True, False])
        probs = op.Softmax(logits, _outputs=["probs"])
        # drop the sink's column: P [B, Hq, S, Skv]
        kept = pattern.OrValue([op.Slice(probs, starts, ends, axes, steps, _outputs=["kept"]),
                                op.Slice(probs, starts, ends, axes, _outputs=["kept"])], tag_var="slice_steps",
                               tag_values=[True, False])
        return op.MatMul(kept, value)

    def _decode(self, query, key_t, value, probs, cat, kept, sink, mask=None, qk_scale=None, qk_scaling="None",
                cap_in=None, cap_out=None, max_sub=False, row_max=None, **_):
        sm = probs.producer()
        axis = g.attr_int(sm, "axis", -1)
        if not (axis == -1 or (g.rank(probs) is not None and axis == g.rank(probs) - 1)):
            raise MatchFailureError(f"Softmax over axis {axis}, not the key axis (-1)")
        _check_sink_softmax(cat, probs, kept, row_max.producer() if max_sub and row_max is not None else None)
        return _decode_matmul_form(self._ctx, query, key_t, value, mask, qk_scale, qk_scaling, None, probs,
                                   cap_in, cap_out, sink)


# --- the ONNX Attention op (opset 23) -----------------------------------------------------------


def _fuse_onnx_attention(ctx: _Ctx) -> int:
    graph = ctx.model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
            continue
        where = node.name or "Attention"
        try:
            a, _ = _decode_onnx_attention(ctx, node)
        except MatchFailureError as e:
            ctx.declines[where] = str(getattr(e, "reason", e))
            continue
        tape = ir.tape.Tape()
        op = _TapeOp(tape)
        o_BHSD = _emit(op, ctx, a)
        y = node.outputs[0]
        if a.q_BHSD is node.inputs[0]:
            new_y = o_BHSD
        else:  # 3-D query [B, S, Hq*D]: back to that layout
            new_y = op.Reshape(op.Transpose(o_BHSD, perm=[0, 2, 1, 3]), _ints(op, [0, 0, -1]))
        new_nodes = tape.nodes
        graph.insert_before(node, new_nodes)
        y.replace_all_uses_with(new_y)
        if y in graph.outputs:
            graph.outputs[graph.outputs.index(y)] = new_y
        _remove_if_dead(graph, node)
        ctx.forms["onnx_attention"] = ctx.forms.get("onnx_attention", 0) + 1
        count += 1
    return count


def _decode_onnx_attention(ctx: _Ctx, node: ir.Node) -> tuple[_Attn, Any]:
    ins = list(node.inputs) + [None] * (7 - len(node.inputs))
    q, k, v, mask, past_k, past_v = ins[:6]
    if ins[6] is not None:
        raise MatchFailureError("nonpad_kv_seqlen input is not supported")
    if len(node.outputs) > 3 and node.outputs[3].uses():
        raise MatchFailureError("the qk_matmul_output output is used")
    if "qk_matmul_output_mode" in node.attributes and int(node.attributes["qk_matmul_output_mode"].value) != 0:
        raise MatchFailureError(f"attribute qk_matmul_output_mode={node.attributes['qk_matmul_output_mode'].value} "
                                "is not supported")
    # softcap: applied to the scaled scores before the mask, as the op's (onnxruntime does so;
    # tests/rewrite/test_attention_variants_rewrite.py checks it on onnxruntime)
    softcap = float(node.attributes["softcap"].value) if "softcap" in node.attributes else 0.0
    if softcap < 0 or not math.isfinite(softcap):
        raise MatchFailureError(f"softcap={softcap} (expected 0 or a finite positive value)")
    causal = bool(g.attr_int(node, "is_causal", 0))
    if g.rank(q) == 3:
        hq, hkv = g.attr_int(node, "q_num_heads"), g.attr_int(node, "kv_num_heads")
        raise MatchFailureError(f"3-D Attention inputs (q_num_heads={hq}, kv_num_heads={hkv}) are not supported yet")
    if past_k is not None or past_v is not None:
        if ctx.paged and past_k in ctx.past_layer and past_v in ctx.past_layer:
            if g.rank(k) != 4 or g.rank(v) != 4:
                raise MatchFailureError("Attention with past inputs needs 4-D key/value")
        else:
            raise MatchFailureError("Attention's past_key/past_value are not the model's past inputs")
    else:
        # torch.onnx writes repeat_kv(Concat(past, new)) as K and V of an Attention without past inputs
        past_k, k = _split_past(_strip_repeat_kv(k), ctx)
        past_v, v = _split_past(_strip_repeat_kv(v), ctx)
        if ctx.paged and (past_k is None or past_v is None):
            raise MatchFailureError("KV-cache model, but this Attention does not read a past key and value")
        if not ctx.paged and past_k is not None:
            raise MatchFailureError("past concatenated in a model without a cache interface")
    hq, hkv, d = _check_dims(ctx, q, k, v)
    scale = node.attributes["scale"].value if "scale" in node.attributes else 1.0 / math.sqrt(d)
    kind, window = _mask_kind(mask, ctx, causal_attr=causal)
    a = _Attn(q, k, v, past_k, past_v, hq, hkv, d, float(scale), kind, window, softcap)
    if ctx.paged:
        # present_key/value are the graph outputs the paged caches replace
        for o in node.outputs[1:3]:
            if o is not None and o.uses():
                raise MatchFailureError(f"present output '{o.name}' is used inside the graph")
    return a, None


def _fuse_gqa(ctx: _Ctx) -> int:
    """com.microsoft GroupQueryAttention (onnxruntime-genai's builder, ORT's optimizer): packed or
    separate Q/K/V [B, S, H*D], past/present [B, Hkv, P, D], optional rotary from cos/sin caches.
    Paged models only; the rotary moves in front of the cache, driven by ``position_ids``."""
    graph = ctx.model.graph
    count = 0
    for node in list(graph):
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        where = node.name or "GroupQueryAttention"
        try:
            spec = _decode_gqa(ctx, node)
        except MatchFailureError as e:
            ctx.declines[where] = str(getattr(e, "reason", e))
            continue
        if not ctx.paged:
            _emit_gqa_prefill(ctx, node, spec)
            ctx.forms["com.microsoft.GroupQueryAttention"] = ctx.forms.get("com.microsoft.GroupQueryAttention", 0) + 1
            count += 1
            continue
        tape = ir.tape.Tape()
        op = _TapeOp(tape)
        q, k, v, hq, hkv, d, scale, rotary, extras = spec
        qkv_dims = [hq * d, hkv * d, hkv * d]
        if k is None:  # packed QKV [B, S, (Hq + 2 Hkv) * D]
            q, k, v = op.Split(q, _ints(op, qkv_dims), axis=-1, _outputs=3)
        q_THD = op.Reshape(q, _ints(op, [-1, hq, d]))
        k_THD = op.Reshape(k, _ints(op, [-1, hkv, d]))
        v_THD = op.Reshape(v, _ints(op, [-1, hkv, d]))
        if rotary is not None:
            cos_cache, sin_cache = rotary
            pos = op.Reshape(_position_input(ctx), _ints(op, [-1]))
            cos = op.Unsqueeze(op.Gather(cos_cache, pos, axis=0), _ints(op, [1]))  # [T, 1, D/2]
            sin = op.Unsqueeze(op.Gather(sin_cache, pos, axis=0), _ints(op, [1]))

            q_THD, k_THD = _rotate_half(op, q_THD, cos, sin, d), _rotate_half(op, k_THD, cos, sin, d)
        layer = ctx.past_layer[node.inputs[3]][0]
        caches = [ctx.shared["cache_in"][(layer, p)] for p in CACHE_PARTS]
        outs = op.QuantizeKVCache(k_THD, v_THD, ctx.shared[SLOT_MAPPING], *caches, _domain=DOMAIN, _outputs=4)
        ctx.cache_out[layer] = outs
        ctx.layer_dims[layer] = (hkv, d)
        window, softcap, sink = extras
        ctx.fused_attrs.append({"layer": layer, "window": window, "softcap": softcap,
                                "head_sink": None if sink is None else [float(x) for x in sink]})
        attrs = {"qk_quant": ctx.options.qk_quant, "pv_quant": ctx.options.pv_quant}
        if not math.isclose(scale, 1.0 / math.sqrt(d), rel_tol=1e-6):
            attrs["scale"] = float(scale)
        if window:
            attrs["window"] = window
        if softcap:
            attrs["softcap"] = softcap
        extra = [op.Constant(value=ir.tensor(sink))] if sink is not None else []
        o = op.PagedAttentionInt8(q_THD, *outs, ctx.shared[BLOCK_TABLES], ctx.shared[SEQ_LENS],
                                  ctx.shared[CU_SEQLENS_Q], *extra, _domain=DOMAIN, **attrs)
        y = op.Reshape(o, _ints(op, [1, -1, hq * d]))
        graph.insert_before(node, tape.nodes)
        old = node.outputs[0]
        old.replace_all_uses_with(y)
        if old in graph.outputs:
            graph.outputs[graph.outputs.index(old)] = y
        ctx.outputs_made.add(y)
        _remove_if_dead(graph, node)
        ctx.forms["com.microsoft.GroupQueryAttention"] = ctx.forms.get("com.microsoft.GroupQueryAttention", 0) + 1
        count += 1
    return count


def _rotate_half(op, x, cos, sin, d: int):
    """GroupQueryAttention's non-interleaved rotary on x [..., D] with cos/sin broadcastable to
    [..., D/2]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = op.Split(x, _ints(op, [d // 2, d // 2]), axis=-1, _outputs=2)
    return op.Concat(op.Sub(op.Mul(x1, cos), op.Mul(x2, sin)), op.Add(op.Mul(x2, cos), op.Mul(x1, sin)), axis=-1)


def _emit_gqa_prefill(ctx: _Ctx, node: ir.Node, spec) -> None:
    """A prefill-only GroupQueryAttention (no past: the graph starts the cache) becomes the
    prefill form of ``_emit``: Q/K/V [B, S, H*D] -> [B, S, H, D], rotary at the node's own
    position_ids (indices into its cos/sin caches, which the graph may compute per token),
    -> [B, H, S, D]; padding comes from the attention_bias the probe classified. The node's
    present outputs become the rotated K and the V, [B, Hkv, S, D], as GQA writes them."""
    graph = ctx.model.graph
    q, k, v, hq, hkv, d, scale, rotary, kind, (window, softcap, sink) = spec
    tape = ir.tape.Tape()
    op = _TapeOp(tape)
    if k is None:  # packed QKV [B, S, (Hq + 2 Hkv) * D]
        q, k, v = op.Split(q, _ints(op, [hq * d, hkv * d, hkv * d]), axis=-1, _outputs=3)
    q_BSHD = op.Reshape(q, _ints(op, [0, 0, hq, d]))
    k_BSHD = op.Reshape(k, _ints(op, [0, 0, hkv, d]))
    v_BSHD = op.Reshape(v, _ints(op, [0, 0, hkv, d]))
    if rotary is not None:
        cos_cache, sin_cache, pos = rotary
        cos = op.Unsqueeze(op.Gather(cos_cache, pos, axis=0), _ints(op, [2]))  # [B, S, 1, D/2]
        sin = op.Unsqueeze(op.Gather(sin_cache, pos, axis=0), _ints(op, [2]))
        q_BSHD, k_BSHD = _rotate_half(op, q_BSHD, cos, sin, d), _rotate_half(op, k_BSHD, cos, sin, d)
    to_BHSD = lambda x: op.Transpose(x, perm=[0, 2, 1, 3])
    k_BHSD, v_BHSD = to_BHSD(k_BSHD), to_BHSD(v_BSHD)
    a = _Attn(to_BHSD(q_BSHD), k_BHSD, v_BHSD, None, None, hq, hkv, d, scale, kind, window, softcap, sink)
    o_BHSD = _emit(op, ctx, a)
    y = op.Reshape(to_BHSD(o_BHSD), _ints(op, [0, 0, hq * d]))
    graph.insert_before(node, tape.nodes)
    for old, new in zip(node.outputs, (y, k_BHSD, v_BHSD)):
        if old is None:
            continue
        if old in graph.outputs:
            name = old.name
            graph.outputs[graph.outputs.index(old)] = new
            old.name, new.name = f"{name}_replaced", name
        old.replace_all_uses_with(new)
    graph.remove(node, safe=True)


def _position_input(ctx: _Ctx) -> ir.Value:
    """The model's position_ids input, or a new one (GQA models derive positions from the past
    length, which a paged model does not have)."""
    graph = ctx.model.graph
    pos = next((v for v in graph.inputs if v.name and "position_ids" in v.name), None)
    if pos is None:
        pos = ir.Value(name="position_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1, "total_tokens"]))
        graph.inputs.append(pos)
    return pos


def _decode_gqa(ctx: _Ctx, node: ir.Node):
    ins = list(node.inputs) + [None] * (12 - len(node.inputs))
    q, k, v, past_k, past_v = ins[:5]
    prefill = not ctx.paged
    if prefill and (past_k is not None or past_v is not None):
        raise MatchFailureError("GroupQueryAttention reads a past in a model without past inputs")
    if not prefill and (past_k not in ctx.past_layer or past_v not in ctx.past_layer):
        raise MatchFailureError("GroupQueryAttention without the model's past_key/past_value inputs "
                                "in a KV-cache model")
    if ins[10] is not None and not prefill:
        raise MatchFailureError("GroupQueryAttention with attention_bias is not supported")
    if prefill:
        # GQA is causal and hides keys past seqlens_k[b] (right padding); the prefill form reads
        # padding from attention_mask, so seqlens_k must be the whole length on every probe row
        # (transformers' exporter writes it so and puts the padding in attention_bias)
        lens = ctx.probes.get(ins[5].name) if ins[5] is not None else None
        if lens is None or not np.all(np.asarray(lens) == g.PROBE_SEQ - 1):
            raise MatchFailureError("prefill GroupQueryAttention whose seqlens_k is not the whole length on "
                                    "every row (padding through seqlens_k is not supported)")
    a = node.attributes
    get = lambda name, default: a[name].value if name in a else default
    # onnxruntime's GroupQueryAttention: local_window_size W lets the query at p see keys
    # p - W < k <= p (the op's window; tests/rewrite/test_attention_variants_rewrite.py runs the
    # node on onnxruntime against that), softcap and head_sink [Hq] as the op's
    lws = int(get("local_window_size", -1))
    if lws == 0 or lws < -1:
        raise MatchFailureError(f"local_window_size={lws} (expected -1 or a positive window)")
    window = max(lws, 0)
    softcap = float(get("softcap", 0.0))
    if softcap < 0 or not math.isfinite(softcap):
        raise MatchFailureError(f"softcap={softcap} (expected 0 or a finite positive value)")
    if int(get("smooth_softmax", 0)) != 0 or int(get("qk_output", 0)) != 0:
        raise MatchFailureError("smooth_softmax / qk_output are not supported")
    sink = None
    if ins[11] is not None:
        arr = g.const_array(ins[11])
        if arr is None or arr.size != int(get("num_heads", 0)) or not np.all(np.isfinite(arr)):
            raise MatchFailureError("head_sink is not a finite constant with one value per query head")
        sink = np.asarray(arr, np.float32).reshape(-1)
    hq, hkv = int(get("num_heads", 0)), int(get("kv_num_heads", 0))
    if prefill:  # D from the query's width: [B, S, Hq*D], or packed [B, S, (Hq + 2 Hkv)*D]
        width = _dim(ctx, q, 2)
        heads = hq if k is not None else hq + 2 * hkv
        d = width // heads if width and heads and width % heads == 0 else None
    else:
        d = g.dim(past_k, 3)
        if d is None:
            d = _dim(ctx, past_k, 3)
    if not hq or not hkv or d is None:
        raise MatchFailureError(f"head counts/head_dim unknown (num_heads={hq}, kv_num_heads={hkv}, D={d})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise MatchFailureError(f"head_dim must be one of {{{', '.join(map(str, SUPPORTED_HEAD_DIMS))}}}, got {d}")
    if hq % hkv:
        raise MatchFailureError(f"query heads ({hq}) are not a multiple of kv heads ({hkv})")
    scale = float(get("scale", 0.0)) or 1.0 / math.sqrt(d)
    rotary = None
    if int(get("do_rotary", 0)):
        if int(get("rotary_interleaved", 0)):
            raise MatchFailureError("interleaved rotary is not supported")
        cos, sin = ins[7], ins[8]
        if prefill:
            # the prefill reads its caches at the node's own position_ids (the graph may compute
            # both per run, e.g. one cache row per token); without position_ids GQA would read
            # rows 0 .. S-1 (no past)
            cshape = _probe_shape(ctx, cos) if cos is not None else None
            if ins[9] is None:
                raise MatchFailureError("prefill GroupQueryAttention with rotary but no position_ids")
        else:
            cshape = g.const_array(cos).shape if g.const_array(cos) is not None else None
        if cos is None or sin is None or cshape is None or len(cshape) != 2 or cshape[1] * 2 != d:
            raise MatchFailureError("rotary needs cos/sin caches of [positions, head_dim/2] ("
                                    + ("probed" if prefill else "constant") + "; partial rotary is not supported)")
        rotary = (cos, sin, ins[9]) if prefill else (cos, sin)
    for o in node.outputs[1:3]:
        if o is not None and o.uses():
            raise MatchFailureError(f"present output '{o.name}' is used inside the graph")
    if prefill:
        kind, bias_window = _mask_kind(ins[10], ctx) if ins[10] is not None else ("causal", 0)
        # a key is seen when both the bias and local_window_size show it: the shorter window
        window = min(w for w in (window, bias_window) if w) if window or bias_window else 0
        return q, k, v, hq, hkv, d, scale, rotary, kind, (window, softcap, sink)
    return q, k, v, hq, hkv, d, scale, rotary, (window, softcap, sink)


def _remove_if_dead(graph: ir.Graph, node: ir.Node) -> None:
    """Drops a replaced node once none of its outputs is read (present outputs were detached)."""
    if all(not o.uses() and o not in graph.outputs for o in node.outputs if o is not None):
        graph.remove(node, safe=True)


class _TapeOp:
    """The ``op.X(..., _domain=, _outputs=)`` builder interface of onnxscript's rewriter, on an
    onnx_ir Tape, so ``_emit`` serves both the rule and the single-node passes."""

    def __init__(self, tape):
        self._tape = tape

    def __getattr__(self, op_type):
        def build(*inputs, _domain: str = "", _outputs: int = 1, **attrs):
            attrs = {k: v for k, v in attrs.items() if v is not None}
            if _outputs == 1:
                return self._tape.op(op_type, list(inputs), attributes=attrs, domain=_domain)
            return self._tape.op_multi_out(op_type, list(inputs), attributes=attrs, domain=_domain,
                                           num_outputs=_outputs)

        return build


# --- the pass ---------------------------------------------------------------------------------


def _find_past(model: ir.Model) -> dict:
    """Past K/V graph inputs -> (layer, "key"|"value"), in input order (layer i = i-th pair).

    Names as exporters write them: ``past_key_values.{i}.key`` (optimum, TorchScript),
    ``past_key_values.layers.{i}.keys`` (transformers), ``past_key_{i}`` (hand-built)."""
    keys, vals = [], []
    for v in model.graph.inputs:
        name = (v.name or "").lower()
        if "past" not in name:
            continue
        tail = name.replace("past_key_values", "").replace("past", "")
        if tail.rstrip("s0123456789._").endswith("value") or "value" in tail:
            vals.append(v)
        elif "key" in tail:
            keys.append(v)
    out = {}
    for i, v in enumerate(keys):
        out[v] = (i, "key")
    for i, v in enumerate(vals):
        out[v] = (i, "value")
    return out


def _looks_like_attention(softmax: ir.Node) -> bool:
    """A Softmax whose scores come (through scales, masks, casts) from a MatMul of two
    activations, as q @ k^T does; a router's x @ W_const does not count."""
    stack = [(softmax.inputs[0], 0)]
    while stack:
        v, depth = stack.pop()
        node = v.producer() if v is not None else None
        if node is None or depth > 6:
            continue
        if node.op_type in ("MatMul", "FusedMatMul"):
            if all(i is not None and g.const_array(i) is None for i in node.inputs[:2]):
                return True
            continue
        if node.op_type in ("Add", "Mul", "Div", "Where", "Cast", "Sub", "Tanh", "Concat", "ReduceMax"):
            stack.extend((i, depth + 1) for i in node.inputs if i is not None and g.const_array(i) is None)
    return False


def _probe_targets(model: ir.Model) -> list[ir.Value]:
    """Values whose probe the checks read: masks added before a Softmax, Attention masks, and
    the conditions of Where nodes (the fully-masked-row fix some exporters add)."""
    vals = []
    for node in model.graph:
        if node.op_type == "Softmax":
            add = g.producer(node.inputs[0], "Add")
            if add is not None:
                vals.extend(add.inputs)
        elif node.op_type == "Attention" and len(node.inputs) > 3 and node.inputs[3] is not None:
            vals.append(node.inputs[3])
        elif node.op_type == "GroupQueryAttention" and len(node.inputs) > 10 and node.inputs[10] is not None:
            vals.append(node.inputs[10])
        elif node.op_type == "Where" and node.inputs[0] is not None:
            vals.append(node.inputs[0])
    seen, out = set(), []
    for v in vals:
        if v is not None and v.name and v.name not in seen and g.const_array(v) is None:
            seen.add(v.name)
            out.append(v)
    return out


def _drop_row_fix(ctx: _Ctx) -> None:
    """Where(c, 0, attn) after an attention we replaced zeroes query rows that see no key; in the
    paged model no query is a pad, and the probe shows c is False on every real query, so
    ``attn`` passes through (and c's mask plumbing dies with it)."""
    for node in list(ctx.model.graph):
        if node.op_type != "Where":
            continue
        c, x, y = node.inputs
        if g.const_scalar(x) != 0.0 and not (g.const_array(x) is not None and not np.any(g.const_array(x))):
            continue
        # y is our output, possibly through layout ops that do not mix tokens
        src, hops = y, 0
        while src is not None and src not in ctx.outputs_made and hops < 4:
            p = src.producer()
            if p is None or p.op_type not in ("Transpose", "Reshape"):
                src = None
                break
            src, hops = p.inputs[0], hops + 1
        if src is None or src not in ctx.outputs_made:
            continue
        probe = ctx.probes.get(c.name)
        if probe is None:
            continue
        real_q = ctx.probe_mask[:, ctx.probe_past:] > 0  # [B, S]
        try:
            pb = np.broadcast_to(probe, probe.shape)
            # the condition is indexed [B, ?, S, ?] or [B, S, ?, ?]: accept it when it is False
            # everywhere on real rows, i.e. False wherever it is not all-pad.
            if np.any(pb) and not _false_on_real_rows(pb, real_q):
                continue
        except ValueError:
            continue
        node.outputs[0].replace_all_uses_with(y)
        if node.outputs[0] in ctx.model.graph.outputs:
            i = ctx.model.graph.outputs.index(node.outputs[0])
            ctx.model.graph.outputs[i] = y


def _false_on_real_rows(cond: np.ndarray, real_q: np.ndarray) -> bool:
    b, s = real_q.shape
    for axes in ((0, 2), (0, 1)):  # [B, 1, S, 1] or [B, S, 1, 1] layouts
        if cond.ndim == 4 and cond.shape[axes[0]] in (1, b) and cond.shape[axes[1]] in (1, s):
            c = np.moveaxis(cond, axes, (0, 1)).reshape(cond.shape[axes[0]], cond.shape[axes[1]], -1).any(-1)
            c = np.broadcast_to(c, (b, s))
            return not np.any(c & real_q)
    return False


def fuse_paged_attention_int8(model: ir.Model, options: RewriteOptions) -> FusionResult:
    """Replaces every attention block it can prove equivalent; see the module docstring.

    Args:
        model: an onnx_ir.Model, changed in place.
        options: block size, P.V and Q.K quantization.

    Returns:
        FusionResult(kind="attention"): fused count, declines with reasons, details
        {"interface": "paged" | "prefill" | "unchanged", "forms": {form: count}}.
    """
    result = FusionResult(kind="attention")
    work = model.clone()  # the probe copy; tensors shared (external ones keep their folder)
    _shape_inference(work)
    past = _find_past(work)
    paged = bool(past)
    probe_error = None
    probes: dict = {}
    probe_mask = None
    targets = _probe_targets(work)
    # Shapes the graph leaves symbolic (head counts behind dynamic Reshapes) come from the probe.
    names = {t.name for t in targets}
    targets += [v for v in g.all_node_outputs(work) if v.name not in names]
    # A bfloat16 model is probed as its float32 twin (onnxruntime's CPU provider has no bfloat16
    # Mul/MatMul); the twin's values keep their names, so the probes answer for the model's values.
    bf16 = g.has_bfloat16(work)
    probed = g.float32_twin(work) if bf16 else work
    past_probed = g.same_values(probed, past)
    targets = g.same_values(probed, targets)
    batch = g.PROBE_BATCH
    # One session for every probe run below: each session loads the whole model (made on the
    # first run; a failure to make it fails that run, and the next run tries again).
    prober: list[g.Prober] = []

    def run_probe(feeds: dict) -> dict:
        if not prober:
            prober.append(g.Prober(probed, targets))
        return prober[0].run(feeds)

    fe = g.probe_feeds(probed, past_probed)
    if fe is None:
        probe_error = "the graph has inputs other than input_ids/attention_mask/position_ids/past"
    elif targets:
        feeds, probe_mask = fe
        try:
            probes = run_probe(feeds)
        except Exception as e:  # noqa: BLE001 - any failure means: cannot check, decline
            probe_error = f"running the original graph on a probe batch failed ({str(e).splitlines()[0][:200]})"
            if bf16:
                probe_error = f"running the bfloat16 model's float32 twin on a probe batch failed ({probe_error})"
            # Some exports run one sequence at a time only (see g.PROBE_FALLBACK_BATCH): probe
            # them with one left-padded row, which still shows causality and key padding.
            batch = g.PROBE_FALLBACK_BATCH
            feeds, probe_mask = g.probe_feeds(probed, past_probed, b=batch)
            try:
                probes = run_probe(feeds)
                probe_error = None
            except Exception:  # noqa: BLE001 - report the batched failure, the first one seen
                probes = {}
    probes2: dict = {}
    if probes and paged:
        fe2 = g.probe_feeds(probed, past_probed, b=g.PROBE2_BATCH if batch > 1 else batch,
                            s=g.PROBE2_SEQ, past=g.PROBE2_PAST)
        try:
            probes2 = run_probe(fe2[0]) if fe2 else {}
        except Exception:  # noqa: BLE001 - only used to fold shape reads; without it they stay
            probes2 = {}
    ctx = _Ctx(work, options, paged, past, probes, probes2, probe_mask, g.PROBE_PAST if paged else 0,
               probe_error, proto=_without_large_initializers(probed), bfloat16=bf16)
    probed = past_probed = None  # the twin's float32 weights, released
    prober.clear()  # and the probe session
    for v in work.graph.inputs:
        if "attention_mask" in (v.name or ""):
            ctx.shared["attention_mask"] = v

    present_names = {}
    if paged:
        _prepare_paged_io(ctx, present_names)

    rules = pattern.RewriteRuleSet([MatMulSoftmaxAttention.rule(ctx), MatMulSinkSoftmaxAttention.rule(ctx)],
                                   commute=True)
    fused = rules.apply_to_model(work)
    fused += _fuse_onnx_attention(ctx)
    fused += _fuse_gqa(ctx)

    # Attention left in the graph: report each with its reason.
    for node in work.graph:
        if node.op_type == "Softmax" and not _looks_like_attention(node):
            continue  # e.g. a MoE router: softmax of x @ W_const, not of q @ k^T
        if node.op_type in ("Softmax", "Attention", "GroupQueryAttention", "MultiHeadAttention"):
            where = node.name or node.op_type
            reason = ctx.declines.get(where) or (
                f"{node.op_type} not in an attention pattern the rewrite knows"
                if node.op_type == "Softmax" else f"{node.domain or 'ai.onnx'}.{node.op_type} is not supported yet")
            result.declined.append(Decline(where, reason))

    if paged:
        problem = _finish_paged(ctx, fused, present_names)
        if problem:
            result.declined.append(Decline("model", problem))
            result.details = {"interface": "unchanged", "forms": {}}
            return result
    if fused == 0:
        result.details = {"interface": "unchanged", "forms": {}}
        return result
    ir.passes.common.RemoveUnusedNodesPass()(work)
    work.opset_imports[DOMAIN] = OPSET_VERSION
    model.graph = work.graph  # opset imports live on the graph in onnx_ir
    model.metadata_props.update(work.metadata_props)
    result.fused = fused
    result.details = {"interface": "paged" if paged else "prefill", "forms": dict(ctx.forms),
                      "blocks": sorted(ctx.fused_attrs, key=lambda b: -1 if b["layer"] is None else b["layer"])}
    if ctx.shared.get("positions_rerouted"):
        # what the graph computed from the cache length now reads position_ids
        result.details["positions"] = "position_ids (the graph computed them from the cache length)"
    return result


def _without_large_initializers(model: ir.Model, limit: int = 1 << 20):
    """The model as a ModelProto minus initializers over ``limit`` bytes: what the long mask probe
    needs (mask plumbing reads shapes and small constants, never a weight matrix; if it did, the
    probe fails and the mask is declined as unverifiable) without keeping a second copy of the
    weights. Small initializers kept in an external file are read into the proto: a session given
    bytes cannot resolve external files."""
    import onnx

    proto = ir.serde.serialize_model(model)
    keep = []
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            value = model.graph.initializers.get(t.name)
            tensor = value.const_value if value is not None else None
            if tensor is None or tensor.nbytes > limit:
                continue
            t = ir.serde.serialize_tensor(ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=t.name))
        elif len(t.raw_data) > limit:
            continue
        keep.append(t)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    return proto


def _shape_inference(model: ir.Model) -> None:
    import logging

    log = logging.getLogger("onnx_ir.passes.common.shape_inference")
    level = log.level
    log.setLevel(logging.CRITICAL)  # a failed inference is logged with a traceback; shapes are a help
    try:
        ir.passes.common.ShapeInferencePass()(model)
    except Exception:  # noqa: BLE001, S110 - missing shapes come from the probe run instead
        pass
    finally:
        log.setLevel(level)


def _prepare_paged_io(ctx: _Ctx, present_names: dict) -> None:
    """Adds the paged inputs, and takes present outputs out of the graph outputs (so the pattern's
    intermediate values have no outside uses); ``_finish_paged`` restores or replaces them."""
    graph = ctx.model.graph
    n_layers = 1 + max(layer for layer, _ in ctx.past_layer.values())
    for name, (dt, shape) in STEP_TABLES.items():
        v = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(dt)), shape=ir.Shape(list(shape)))
        graph.inputs.append(v)
        ctx.shared[name] = v
    hkv_d = {}
    for v, (layer, _) in ctx.past_layer.items():
        if v.shape is not None and v.shape.rank() == 4:
            hkv_d[layer] = (v.shape[1], v.shape[3])
    ctx.shared["cache_in"] = {}
    bs = ctx.options.block_size
    for layer in range(n_layers):
        hkv, d = hkv_d.get(layer, ("num_kv_heads", "head_dim"))
        for part, (shape, dt) in zip(CACHE_PARTS, cache_shapes("num_blocks", hkv, bs, d)):
            v = ir.Value(name=cache_input_name(layer, part), type=ir.TensorType(ir.DataType.from_numpy(dt)),
                         shape=ir.Shape(list(shape)))
            graph.inputs.append(v)
            ctx.shared["cache_in"][(layer, part)] = v
    # present outputs: Concat(past, new) of each layer, or Attention's present outputs
    for out in list(graph.outputs):
        node = out.producer()
        is_present = False
        if node is not None and node.op_type == "Concat" and any(
                _skip_copies(i) in ctx.past_layer for i in node.inputs) or node is not None and node.op_type in ("Attention", "GroupQueryAttention") and \
                out in list(node.outputs[1:3]):
            is_present = True
        if is_present:
            present_names[out.name] = out
            graph.outputs.remove(out)


def _shape_axes(node: ir.Node, rank: int) -> list[int] | None:
    """The axes of its input a Shape node's result is actually read at: its start/end range, or
    with a full Shape, the constant indices of the Gathers reading it (None: something else reads it)."""
    start = g.attr_int(node, "start", 0)
    end = g.attr_int(node, "end", rank)
    start = start + rank if start < 0 else start
    end = end + rank if end < 0 else min(end, rank)
    axes = list(range(start, end))
    if axes != list(range(rank)):
        return axes
    read: set[int] = set()
    for use in node.outputs[0].uses():
        user = use.node
        idx = g.const_array(user.inputs[1]) if user.op_type == "Gather" and len(user.inputs) > 1 else None
        if idx is None or g.attr_int(user, "axis", 0) != 0:
            return None
        read.update(int(i) % rank for i in np.ravel(idx))
    return sorted(read)


def _reroute_past_shapes(ctx: _Ctx) -> None:
    """Exporters read the batch size (axis 0) or the head counts (axes 1, 3) from the shape of a
    past input or of Concat(past, new). In the paged model the batch is input_ids' axis 0 and
    the others are those of ``new``; a read of axis 2 (the past length) has no paged meaning and
    stays (then the model is declined)."""
    graph = ctx.model.graph
    ids = next((v for v in graph.inputs if v.name and v.name.endswith("input_ids")), None)
    sources = []
    for past in ctx.past_layer:
        for use in past.uses():
            user = use.node
            if user.op_type == "Shape":
                sources.append((user, None))
            elif user.op_type == "Concat" and len(user.inputs) == 2 and use.idx == 0:
                sources.extend((u.node, user.inputs[1]) for u in user.outputs[0].uses()
                               if u.node.op_type == "Shape")
            elif user.op_type in ("Concat", "Identity") and len(user.inputs) == 1:
                for u in user.outputs[0].uses():
                    if u.node.op_type == "Concat" and len(u.node.inputs) == 2 and u.idx == 0:
                        sources.extend((uu.node, u.node.inputs[1]) for uu in u.node.outputs[0].uses()
                                       if uu.node.op_type == "Shape")
    for node, new in sources:
        axes = _shape_axes(node, 4)
        if not axes or 2 in axes:
            continue
        if new is not None:
            node.replace_input_with(0, new)
        elif axes == [0] and ids is not None and g.attr_int(node, "start", 0) == 0:
            node.replace_input_with(0, ids)


def _downstream_of_past(ctx: _Ctx) -> set[ir.Value]:
    """The past inputs and every value computed from one of them, in one forward pass (graph
    order is topological): what may still read the cache length after fusion."""
    tainted = set(ctx.past_layer)
    for node in ctx.model.graph:
        if any(i in tainted for i in node.inputs if i is not None):
            tainted.update(o for o in node.outputs if o is not None)
    return tainted


def _fold_structural_ints(ctx: _Ctx) -> None:
    """Integer values computed from a past input's shape that are the same on both probes (head
    counts, head_dim: what the TorchScript exporter reads from the repeated V's shape) become
    constants, so the past inputs can go."""
    if not ctx.probes2:
        return
    graph = ctx.model.graph
    tainted = _downstream_of_past(ctx)
    for node in list(graph):
        for out in node.outputs:
            if out not in tainted or not out.uses() or out.name not in ctx.probes or out.name not in ctx.probes2:
                continue
            a, b = ctx.probes[out.name], ctx.probes2[out.name]
            if a.dtype not in (np.int64, np.int32) or a.size > 8 or a.shape != b.shape or not np.array_equal(a, b):
                continue
            const = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(a))})
            graph.insert_before(node, const)
            out.replace_all_uses_with(const.outputs[0])


def _position_layout(arr: np.ndarray, past: int, seq: int) -> str | None:
    """How ``arr`` holds the positions past .. past+seq-1 of every row: "flat" [S], "rows"
    [B or 1, S], or None (not positions)."""
    if arr.dtype not in (np.int64, np.int32) or arr.ndim not in (1, 2) or arr.shape[-1] != seq:
        return None
    if not np.array_equal(arr.reshape(-1, seq), np.broadcast_to(np.arange(past, past + seq), (arr.size // seq, seq))):
        return None
    return "flat" if arr.ndim == 1 else "rows"


def _positions_from_cache_length(ctx: _Ctx) -> None:
    """Positions a graph computes from the cache length (transformers' cache_position =
    arange(P, P + S) with P read from a past input's shape, then RoPE) become the paged model's
    ``position_ids``: each packed token's own position. A value counts as such positions when,
    downstream of a past input, both probe runs (different P and S) computed exactly
    arange(P, P + S). The graph gives a left-padded row the positions of its pads too; the
    paged model gives real positions from 0, which shifts every position of that sequence by
    the same amount: rotary attention depends only on differences, so the result is unchanged."""
    if not ctx.probes2:
        return
    graph = ctx.model.graph
    tainted = _downstream_of_past(ctx)
    done = set()
    for node in list(graph):
        for out in node.outputs:
            if out not in tainted or not out.uses() or id(out) in done:
                continue
            a, b = ctx.probes.get(out.name), ctx.probes2.get(out.name)
            if a is None or b is None:
                continue
            layout = _position_layout(a, g.PROBE_PAST, g.PROBE_SEQ)
            if layout is None or _position_layout(b, g.PROBE2_PAST, g.PROBE2_SEQ) != layout:
                continue
            tape = ir.tape.Tape()
            op = _TapeOp(tape)
            pos = _position_input(ctx)  # int64 [1, T]
            new = op.Reshape(pos, _ints(op, [-1])) if layout == "flat" else pos
            if a.dtype != np.int64:
                new = op.Cast(new, to=ir.DataType.INT32)
            graph.insert_before(node, tape.nodes)
            out.replace_all_uses_with(new)
            done.add(id(out))
            ctx.shared["positions_rerouted"] = ctx.shared.get("positions_rerouted", 0) + 1


def _logits_of_last_tokens(ctx: _Ctx, logits: ir.Value) -> bool:
    """Feeds lm_head only the last new token of each sequence: logits = MatMul(h, W_const)
    [+ bias] becomes MatMul(Gather(h, cu_seqlens_q[1:] - 1, axis=1), W) [1, S, V]. Everything
    before lm_head is per token or attention, so the rows kept are unchanged; a prefill of T
    tokens then costs S rows of lm_head instead of T. False (logits stay [1, T, V]) when the
    producer is not such a MatMul."""
    node = logits.producer()
    if node is not None and node.op_type == "Add" and any(g.const_array(i) is not None for i in node.inputs):
        node = next((i.producer() for i in node.inputs if g.const_array(i) is None), None)
    if node is None or node.op_type != "MatMul" or g.const_array(node.inputs[1]) is None:
        return False
    h = node.inputs[0]
    if g.rank(h) not in (None, 3):
        return False
    tape = ir.tape.Tape()
    op = _TapeOp(tape)
    ends = op.Slice(ctx.shared[CU_SEQLENS_Q], _ints(op, [1]), _ints(op, [np.iinfo(np.int64).max]))
    last = op.Sub(op.Cast(ends, to=ir.DataType.INT64), _ints(op, [1]))
    h_last = op.Gather(h, last, axis=1)
    ctx.model.graph.insert_before(node, tape.nodes)
    node.replace_input_with(0, h_last)
    return True


def _greedy_token_output(ctx: _Ctx, logits: ir.Value) -> ir.Value:
    """Appends the greedy pick as a graph output: ``NEXT_TOKEN`` = ArgMax(logits, axis=-1,
    keepdims=0), int64 with the logits' shape less the vocabulary. select_last_index stays at its
    default 0: of equal maxima the first index, as np.argmax picks. The runtime binds it to the
    host and leaves the logits on the device, so a greedy step brings back S int64 values instead of
    S x V floats. Logits other than float32, float16 or double (bfloat16) are cast to float32
    first: neither ORT's CPU nor its CUDA ArgMax takes bfloat16, and the cast is exact, so the
    pick and its ties are the same."""
    graph = ctx.model.graph
    nodes, x = [], logits
    if logits.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE):
        cast = ir.node("Cast", [logits], {"to": int(ir.DataType.FLOAT)}, name=f"{NEXT_TOKEN}/to_float")
        nodes.append(cast)
        x = cast.outputs[0]
        x.dtype = ir.DataType.FLOAT
    argmax = ir.node("ArgMax", [x], {"axis": -1, "keepdims": 0}, name=f"{NEXT_TOKEN}/ArgMax")
    nodes.append(argmax)
    for n in nodes:
        graph.append(n)
    token = argmax.outputs[0]
    token.name = NEXT_TOKEN
    token.type = ir.TensorType(ir.DataType.INT64)
    if logits.shape is not None:
        token.shape = ir.Shape(list(logits.shape)[:-1])
    graph.outputs.append(token)
    return token


def _finish_paged(ctx: _Ctx, fused: int, present_names: dict) -> str | None:
    """Wires the cache outputs and drops past/present/attention_mask; returns a reason when the
    model cannot become paged (then the caller leaves it unchanged)."""
    graph = ctx.model.graph
    n_layers = len(ctx.shared["cache_in"]) // len(CACHE_PARTS)
    missing = [i for i in range(n_layers) if i not in ctx.cache_out]
    if missing:
        return (f"KV-cache model left unchanged: layer(s) {missing} could not be fused (see the reasons "
                "above), and a paged model needs every layer paged")
    _drop_row_fix(ctx)
    ir.passes.common.RemoveUnusedNodesPass()(ctx.model)
    for layer, outs in ctx.cache_out.items():
        for part, v in zip(CACHE_PARTS, outs):
            v.name = cache_output_name(layer, part)
            graph.outputs.append(v)
    _reroute_past_shapes(ctx)
    _fold_structural_ints(ctx)
    _positions_from_cache_length(ctx)
    ir.passes.common.RemoveUnusedNodesPass()(ctx.model)
    still_used = [f"{v.name} (by {g.node_names(u.node for u in v.uses())})" for v in ctx.past_layer if v.uses()]
    if still_used:
        return f"past input(s) {still_used} are still read after fusion (e.g. positions computed from the cache length)"
    for v in list(ctx.past_layer):
        graph.inputs.remove(v)
    am = ctx.shared.get("attention_mask")
    if am is not None:
        if am.uses():
            return ("attention_mask is still read after fusion (e.g. positions computed from it); "
                    "export with position_ids as an input")
        graph.inputs.remove(am)
    ids = [v for v in graph.inputs if v.name and v.name.endswith("input_ids")]
    pos = [v for v in graph.inputs if v.name and "position_ids" in v.name]
    if not ids or not pos:
        return "a paged model needs input_ids and position_ids inputs (positions feed RoPE)"
    for v in ids + pos:
        v.shape = ir.Shape([1, "total_tokens"])
    logits = [o for o in graph.outputs if o.name not in {cache_output_name(i, p) for i in range(n_layers)
                                                          for p in CACHE_PARTS}]
    last_only = bool(logits) and _logits_of_last_tokens(ctx, logits[0])
    for o in logits:
        if o.shape is not None and o.shape.rank() == 3:
            o.shape = ir.Shape([1, "num_seqs" if last_only and o is logits[0] else "total_tokens", o.shape[2]])
    token = _greedy_token_output(ctx, logits[0]) if logits else None
    ctx.model.metadata_props[PAGED_META_KEY] = make_metadata(
        num_layers=n_layers,
        num_kv_heads=int(ctx.layer_dims[0][0]),
        head_dim=int(ctx.layer_dims[0][1]),
        layer_dims=[list(map(int, ctx.layer_dims[i])) for i in range(n_layers)],
        block_size=ctx.options.block_size,
        pv_quant=ctx.options.pv_quant,
        qk_quant=ctx.options.qk_quant,
        input_ids=ids[0].name,
        position_ids=pos[0].name,
        logits=logits[0].name if logits else None,
        logits_rows="last" if last_only else "all",
        next_token=token.name if token is not None else None,
        cache_inputs=[[cache_input_name(i, p) for p in CACHE_PARTS] for i in range(n_layers)],
        cache_outputs=[[cache_output_name(i, p) for p in CACHE_PARTS] for i in range(n_layers)],
        removed_inputs=sorted(v.name for v in ctx.past_layer) + ([am.name] if am is not None else []),
        removed_outputs=sorted(present_names),
    )
    return None
