# SPDX-License-Identifier: MIT
"""PagedAttentionInt8: causal attention over the paged INT8 KV cache (DESIGN.md).

Alphabet: T query tokens, S sequences, Hq query heads, Hkv kv heads (Hq % Hkv == 0), D head dim
(32, 64, 80, 96, 128 or 256; the CUDA EP 32, 64, 128, 256), N cache blocks, B block size (power
of two, 8..256), M max blocks per sequence.

Inputs:
    query         float32/float16 [T, Hq, D]
    key_cache     int8    [N, Hkv, B, D]
    value_cache   int8    [N, Hkv, D, B]       (token innermost)
    key_scale     float32 [N, Hkv, B]
    value_scale   float32 [N, Hkv, B]
    block_tables  int32   [S, M]               block of logical position p: block_tables[s, p // B]
    seq_lens      int32   [S]                  context length after the new tokens were cached
    cu_seqlens_q  int32   [S + 1] optional     query rows of sequence s: cu[s] .. cu[s+1]-1
                                               (absent: decode, one query per sequence, T == S)
    head_sink     float32 [Hq] optional        per q head logit in the softmax denominator only
                                               (absent: no sink)
Output:
    output        [T, Hq, D], dtype of query
Attributes:
    scale (float, default 1/sqrt(D)), qk_quant ("s8" | "none"), pv_quant ("s8" | "u8" | "none"),
    partition_size (int, multiple of 32, default 256: the decode split; speed only),
    window (int, default 0 = none: a query at p sees keys p - window < k <= p),
    softcap (float, default 0 = off: s = softcap * tanh(s / softcap) after the scale).

Query j of sequence s sits at position ``seq_lens[s] - q_len_s + j`` and sees keys at positions
<= its own (and > its own - window when window > 0). q head h reads kv head ``h // (Hq / Hkv)``.
Only the block-table entries of blocks a query of the sequence can see are read: the first
``ceil(seq_lens[s] / B)``, less those wholly before the window of the sequence's first query
(the rest may hold anything, e.g. -1).

``reference`` below is the spec, written literally from DESIGN.md (normalized P over all visible
keys, then W = P * sV, per 32-position group requantization of W, int32 inner sums). Kernels
reach the same result by partitions (decode: normalize inside each partition, merge by
log-sum-exp) or online softmax over 32-aligned key tiles (prefill); since a group's codes do not
change when all its W share a factor, they equal this reference up to float rounding (their exp,
their summation order), and at a rounding tie a W code can move by 1.

``exact_attention`` is float64 attention on the unquantized K/V: the yardstick for error budgets.
``build_paged_cache`` lays contiguous K/V out in a scattered paged cache (tests, benchmarks).
"""

from __future__ import annotations

import math

import numpy as np

from ort_ops.ops._quant import quantize_rows
from ort_ops.ops._schema import FLOAT_TYPES, Arg, Attr, OpSchema
from ort_ops.ops.quantize_kv_cache import reference as quantize_kv_cache

OP = "PagedAttentionInt8"
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
GROUP = 32  # tokens per W scale group: the K extent of one INT8 P.V instruction (seed 000)
PV_LEVELS = {"s8": 127, "u8": 255}

SCHEMA = OpSchema(
    name=OP,
    inputs=(
        Arg("query", FLOAT_TYPES, doc="[T, Hq, D]"),
        Arg("key_cache", ("int8",), doc="[N, Hkv, B, D]"),
        Arg("value_cache", ("int8",), doc="[N, Hkv, D, B]"),
        Arg("key_scale", ("float32",), doc="[N, Hkv, B]"),
        Arg("value_scale", ("float32",), doc="[N, Hkv, B]"),
        Arg("block_tables", ("int32",), doc="[S, M]"),
        Arg("seq_lens", ("int32",), doc="[S]"),
        Arg("cu_seqlens_q", ("int32",), optional=True, doc="[S + 1]; absent: decode"),
        Arg("head_sink", ("float32",), optional=True, doc="[Hq]; absent: no sink"),
    ),
    outputs=(Arg("output", FLOAT_TYPES, doc="[T, Hq, D], dtype of query"),),
    attrs=(
        Attr("scale", "float", None, doc="softmax scale; default 1/sqrt(D)"),
        Attr("qk_quant", "string", "s8", doc="s8 | none"),
        Attr("pv_quant", "string", "s8", doc="s8 | u8 | none"),
        Attr("partition_size", "int", 256, doc="decode split, multiple of 32"),
        Attr("window", "int", 0, doc="sliding window (keys p - window < k <= p); 0: none"),
        Attr("softcap", "float", 0.0, doc="logit soft cap after the scale; 0: off"),
    ),
    doc=__doc__,
)


def _fail(msg: str):
    raise ValueError(f"{OP}: {msg}")


def _query_rows(t: int, seq_lens: np.ndarray, cu_seqlens_q: np.ndarray | None) -> np.ndarray:
    """[S + 1] start row of each sequence's queries, validated against T and seq_lens."""
    s = seq_lens.shape[0]
    if cu_seqlens_q is None:
        if t != s:
            _fail(f"input 'query' must have T == S == {s} rows in decode (no 'cu_seqlens_q'), got T = {t}")
        cu = np.arange(s + 1, dtype=np.int64)
    else:
        cu = np.asarray(cu_seqlens_q).astype(np.int64)
        if cu.shape != (s + 1,):
            _fail(f"input 'cu_seqlens_q' must have shape [{s + 1}], got {list(cu.shape)}")
        if cu[0] != 0 or cu[-1] != t or np.any(np.diff(cu) < 1):
            _fail(f"input 'cu_seqlens_q' must rise from 0 to T = {t} with at least one query row per sequence, "
                  f"got {cu.tolist()}")
    q_lens = np.diff(cu)
    short = np.nonzero(q_lens > seq_lens)[0]
    if short.size:
        i = int(short[0])
        _fail(f"input 'seq_lens' must be >= the query count of each sequence, got seq_lens[{i}] = "
              f"{int(seq_lens[i])} < {int(q_lens[i])} queries")
    return cu


def _check(query, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens,
           qk_quant, pv_quant, partition_size, window, softcap, head_sink) -> None:
    if query.ndim != 3:
        _fail(f"input 'query' must have rank 3, got shape {list(query.shape)}")
    _, hq, d = query.shape
    if key_cache.ndim != 4:
        _fail(f"input 'key_cache' must have rank 4, got shape {list(key_cache.shape)}")
    n, hkv, b, dk = key_cache.shape
    if dk != d:
        _fail(f"input 'key_cache' must have head_dim {d} (query's), got shape {list(key_cache.shape)}")
    if d not in SUPPORTED_HEAD_DIMS:
        _fail(f"head_dim must be one of {{{', '.join(map(str, SUPPORTED_HEAD_DIMS))}}}, got {d}")
    if b < 8 or b > 256 or b & (b - 1):
        _fail(f"block_size (dim 2 of 'key_cache') must be a power of two in 8..256, got {b}")
    if hkv == 0 or hq % hkv:
        _fail(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    for name, arr, shape in (("value_cache", value_cache, (n, hkv, d, b)),
                             ("key_scale", key_scale, (n, hkv, b)),
                             ("value_scale", value_scale, (n, hkv, b))):
        if arr.shape != shape:
            _fail(f"input '{name}' must have shape {list(shape)}, got {list(arr.shape)}")
    if block_tables.ndim != 2:
        _fail(f"input 'block_tables' must have rank 2, got shape {list(block_tables.shape)}")
    s, m = block_tables.shape
    if seq_lens.shape != (s,):
        _fail(f"input 'seq_lens' must have shape [{s}], got {list(seq_lens.shape)}")
    if np.any(seq_lens < 0) or np.any(seq_lens > m * b):
        i = int(np.nonzero((seq_lens < 0) | (seq_lens > m * b))[0][0])
        _fail(f"input 'seq_lens' must be in 0..{m * b} (max_blocks * block_size), got seq_lens[{i}] = {int(seq_lens[i])}")
    if qk_quant not in ("s8", "none"):
        _fail(f"attribute 'qk_quant' must be s8 or none, got '{qk_quant}'")
    if pv_quant not in ("s8", "u8", "none"):
        _fail(f"attribute 'pv_quant' must be s8, u8 or none, got '{pv_quant}'")
    if partition_size <= 0 or partition_size % GROUP:
        _fail(f"attribute 'partition_size' must be a positive multiple of 32, got {partition_size}")
    if window < 0:
        _fail(f"attribute 'window' must be >= 0 (0: no window), got {window}")
    if not (math.isfinite(softcap) and softcap >= 0):
        _fail(f"attribute 'softcap' must be finite and >= 0 (0: off), got {np.float32(softcap)}")
    if head_sink is not None:
        if head_sink.shape != (hq,):
            _fail(f"input 'head_sink' must have shape [{hq}] (query heads), got {list(head_sink.shape)}")
        if not np.all(np.isfinite(head_sink)):
            _fail(f"input 'head_sink' must be finite, got NaN or Inf at head {int(np.nonzero(~np.isfinite(head_sink))[0][0])}")


def first_visible(seq_len: int, q_len: int, window: int) -> int:
    """The first key position any of a sequence's q_len queries sees: that of its first query
    (position seq_len - q_len), 0 without a window."""
    return max(0, seq_len - q_len - window + 1) if window > 0 else 0


def _check_blocks(block_tables, seq_lens, num_blocks, block_size, cu, window) -> None:
    """Every block id a query can reach: entries first_visible // B .. ceil(seq_lens[s] / B) - 1 of
    the rows of sequences with at least one query (a sequence without queries is not read, and
    blocks wholly before the window are not read, as in the kernels)."""
    for i in range(seq_lens.shape[0]):
        if cu[i + 1] == cu[i]:
            continue
        first = first_visible(int(seq_lens[i]), int(cu[i + 1] - cu[i]), window) // block_size
        used = block_tables[i, : -(-int(seq_lens[i]) // block_size)]
        bad = np.nonzero((used < 0) | (used >= num_blocks))[0]
        bad = bad[bad >= first]
        if bad.size:
            _fail(f"input 'block_tables' must hold block ids in 0..{num_blocks - 1}, got block_tables[{i}, "
                  f"{int(bad[0])}] = {int(used[bad[0]])}")


def gather_sequence(key_cache, value_cache, key_scale, value_scale, block_row, seq_len, first=0):
    """One sequence's cached tokens at positions first .. seq_len - 1, in position order.

    Returns:
        kq int8 [L, Hkv, D], sk float32 [L, Hkv], vq int8 [L, Hkv, D], sv float32 [L, Hkv]
        (L = seq_len - first).
    """
    b = key_cache.shape[2]
    pos = np.arange(first, seq_len)
    blk = np.asarray(block_row)[pos // b].astype(np.int64)
    off = pos % b
    kq = key_cache[blk, :, off, :]                                  # [L, Hkv, D]
    vq = value_cache[blk, :, :, off]   # [L, Hkv, D]: advanced indices separated by slices go first
    return kq, key_scale[blk, :, off], vq, value_scale[blk, :, off]


def _attend_one_head(q, kq, sk, vq, sv, first_pos, scale, qk_quant, pv_quant, key0=0, window=0,
                     softcap=0.0, sink=None):
    """Literal DESIGN.md semantics for n queries of one q head against L keys of its kv head.

    q float32 [n, D] at positions first_pos .. first_pos + n - 1; kq, vq int8 [L, D] and
    sk, sv float32 [L] at key positions key0 .. key0 + L - 1 (keys before key0 are outside every
    query's window). sink: float32 scalar or None. Returns (float32 [n, D], code step float32 [n]:
    the largest W quantum max_g(max_{t in g} W_t) / L of each query, 0 for pv none).
    """
    n, d = q.shape
    # Pad the front to a 32-aligned position with keys nobody sees (W = 0), so the groups below
    # stay the absolute groups [32g, 32g + 32).
    front = key0 % GROUP
    if front:
        kq = np.pad(kq, ((front, 0), (0, 0)))
        vq = np.pad(vq, ((front, 0), (0, 0)))
        sk = np.pad(sk, (front, 0))
        sv = np.pad(sv, (front, 0))
        key0 -= front
    length = kq.shape[0]
    # s_t = (Qq . Kq_t) * sQ * sK_t * scale; int8 dot products are exact in float64 (|sum| < 2^53).
    if qk_quant == "s8":
        qq, sq = quantize_rows(q, axis=-1)
        idot = (qq.astype(np.float64) @ kq.astype(np.float64).T).astype(np.int64)
        s = ((idot.astype(np.float32) * sq[:, None]) * sk[None, :]) * np.float32(scale)
    else:
        s = ((q @ kq.astype(np.float32).T) * sk[None, :]) * np.float32(scale)
    s = s.astype(np.float32)
    if softcap > 0:  # Gemma 2: one division, tanh, one multiply (float32)
        cap = np.float32(softcap)
        s = (cap * np.tanh((s / cap).astype(np.float32))).astype(np.float32)
    kpos = key0 + np.arange(length)[None, :]
    qpos = (first_pos + np.arange(n))[:, None]
    visible = kpos <= qpos                                                          # causal
    if window > 0:
        visible &= kpos > qpos - window                                            # sliding window
    s = np.where(visible, s, np.float32(-np.inf))
    # P = softmax over the visible keys (and the sink, which joins the denominator only);
    # W = P * sV (V's per-token scale folded into P). m is the keys' max even with a sink, as in
    # the kernels: e = exp(s - m) keeps its relative precision (exp(s - sink) for a sink far above
    # the scores would round s - sink to the sink's ulp and move W codes at ties). A sink more than
    # ~88 above m makes exp(sink - m) inf and P = 0: the true P is then below e^-88.
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - m).astype(np.float32)
    den = e.sum(axis=1, keepdims=True, dtype=np.float32)
    if sink is not None:
        with np.errstate(over="ignore"):
            den = (den + np.exp(np.float32(sink) - m)).astype(np.float32)
    p = (e / den).astype(np.float32)
    w = (p * sv[None, :]).astype(np.float32)
    if pv_quant == "none":
        return (w @ vq.astype(np.float32)).astype(np.float32), np.zeros(n, np.float32)
    # Groups: absolute key positions [32g, 32g + 32); invisible keys have W = 0, so padding to a
    # whole group and taking the max over it is the max over the clipped visible range.
    levels = np.float32(PV_LEVELS[pv_quant])
    groups = -(-length // GROUP)
    pad = groups * GROUP - length
    wg = np.pad(w, ((0, 0), (0, pad))).reshape(n, groups, GROUP)
    vg = np.pad(vq, ((0, pad), (0, 0))).reshape(groups, GROUP, d)
    gmax = wg.max(axis=2)                                                       # [n, G]
    # The code factor L / max saturates at FLT_MAX: a group whose max W is below L / FLT_MAX
    # (~3.7e-37) would get inf, and 0 * inf would make its zero weights NaN codes.
    with np.errstate(over="ignore"):
        inv = levels / np.where(gmax > 0, gmax, np.float32(1))
    inv = np.where(gmax > 0, np.minimum(inv, np.finfo(np.float32).max), np.float32(0)).astype(np.float32)
    wq = np.minimum(np.rint((wg * inv[:, :, None]).astype(np.float32)), levels)  # codes 0 .. L
    # int32 inner sums per group (exact in float64), then O = sum_g (max_g W / L) * isum_g.
    isum = np.einsum("ngk,gkd->ngd", wq.astype(np.float64), vg.astype(np.float64)).astype(np.int64)
    gscale = (gmax / levels).astype(np.float32)
    out = (gscale[:, :, None] * isum.astype(np.float32)).astype(np.float32).sum(axis=1, dtype=np.float32)
    return out, gscale.max(axis=1)


def reference(query: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, key_scale: np.ndarray,
              value_scale: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
              cu_seqlens_q: np.ndarray | None = None, head_sink: np.ndarray | None = None, *,
              scale: float | None = None, qk_quant: str = "s8", pv_quant: str = "s8", partition_size: int = 256,
              window: int = 0, softcap: float = 0.0, return_code_step: bool = False):
    """numpy PagedAttentionInt8 (the spec; see the module docstring for shapes).

    ``partition_size`` is validated but does not enter the result: it only splits the work.

    Returns:
        [T, Hq, D] in query's dtype; with ``return_code_step`` also float32 [T, Hq], the largest
        W quantum max_g(max W in g) / L of each row (0 for pv none): a kernel whose float
        rounding moves one W code by 1 moves that row's output by at most this times |Vq| <= 128,
        which is how tests bound such rounding-tie differences.
    """
    SCHEMA.check_dtypes({"query": query, "key_cache": key_cache, "value_cache": value_cache, "key_scale": key_scale,
                         "value_scale": value_scale, "block_tables": block_tables, "seq_lens": seq_lens,
                         "cu_seqlens_q": cu_seqlens_q, "head_sink": head_sink})
    query = np.asarray(query)
    head_sink = None if head_sink is None else np.asarray(head_sink)
    seq_lens = np.asarray(seq_lens).astype(np.int64)
    block_tables = np.asarray(block_tables).astype(np.int64)
    _check(query, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens,
           qk_quant, pv_quant, partition_size, int(window), float(softcap), head_sink)
    t, hq, d = query.shape
    hkv = key_cache.shape[1]
    cu = _query_rows(t, seq_lens, cu_seqlens_q)
    _check_blocks(block_tables, seq_lens, key_cache.shape[0], key_cache.shape[2], cu, int(window))
    q32 = query.astype(np.float32)
    if not np.all(np.isfinite(q32)):
        _fail("input 'query' must be finite (NaN or Inf found)")
    if scale is not None and not math.isfinite(scale):
        _fail(f"attribute 'scale' must be finite, got {np.float32(scale)}")
    scale = np.float32(1.0 / math.sqrt(d)) if scale is None else np.float32(scale)
    out = np.zeros((t, hq, d), np.float32)
    step = np.zeros((t, hq), np.float32)
    group = hq // hkv
    for s in range(seq_lens.shape[0]):
        n = int(cu[s + 1] - cu[s])
        if n == 0:
            continue
        length = int(seq_lens[s])
        first = first_visible(length, n, int(window))
        kq, sk, vq, sv = gather_sequence(key_cache, value_cache, key_scale, value_scale, block_tables[s], length,
                                         first)
        for h in range(hq):
            kh = h // group
            out[cu[s]:cu[s + 1], h], step[cu[s]:cu[s + 1], h] = _attend_one_head(
                q32[cu[s]:cu[s + 1], h], kq[:, kh], sk[:, kh], vq[:, kh], sv[:, kh], length - n, scale,
                qk_quant, pv_quant, key0=first, window=int(window), softcap=float(softcap),
                sink=None if head_sink is None else np.float32(head_sink[h]))
    return (out.astype(query.dtype), step) if return_code_step else out.astype(query.dtype)


def exact_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, cu_seqlens_k: np.ndarray,
                    cu_seqlens_q: np.ndarray | None = None, *, scale: float | None = None, window: int = 0,
                    softcap: float = 0.0, head_sink: np.ndarray | None = None) -> np.ndarray:
    """float64 causal attention on unquantized K/V (the yardstick for error budgets).

    Args:
        query: [T, Hq, D]; key, value: [sum of context lengths, Hkv, D], sequences back to back.
        cu_seqlens_k: [S + 1] start of each sequence's keys; context length L_s = cu[s+1] - cu[s].
        cu_seqlens_q: [S + 1] query rows per sequence (None: one query per sequence); the queries
            of sequence s are its last q_len_s positions, as in PagedAttentionInt8.
        scale: default 1/sqrt(D).
        window, softcap, head_sink: as PagedAttentionInt8's (0 / 0 / None: off).

    Returns:
        float64 [T, Hq, D].
    """
    q = np.asarray(query, np.float64)
    k = np.asarray(key, np.float64)
    v = np.asarray(value, np.float64)
    t, hq, d = q.shape
    group = hq // k.shape[1]
    cuk = np.asarray(cu_seqlens_k, np.int64)
    cuq = np.arange(t + 1) if cu_seqlens_q is None else np.asarray(cu_seqlens_q, np.int64)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = np.zeros_like(q)
    for s in range(len(cuk) - 1):
        n, length = int(cuq[s + 1] - cuq[s]), int(cuk[s + 1] - cuk[s])
        ks, vs = k[cuk[s]:cuk[s + 1]], v[cuk[s]:cuk[s + 1]]
        kpos, qpos = np.arange(length)[None, :], (length - n + np.arange(n))[:, None]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window > 0 else True)
        for h in range(hq):
            sc = (q[cuq[s]:cuq[s + 1], h] @ ks[:, h // group].T) * scale
            if softcap > 0:
                sc = softcap * np.tanh(sc / softcap)
            sc = np.where(visible, sc, -np.inf)
            mx = sc.max(axis=1, keepdims=True)
            sink = None if head_sink is None else float(head_sink[h])
            if sink is not None:
                mx = np.maximum(mx, sink)
            p = np.exp(sc - mx)
            den = p.sum(axis=1, keepdims=True) + (0.0 if sink is None else np.exp(sink - mx))
            out[cuq[s]:cuq[s + 1], h] = (p / den) @ vs[:, h // group]
    return out


def build_paged_cache(key: np.ndarray, value: np.ndarray, cu_seqlens_k: np.ndarray, block_size: int,
                      rng: np.random.Generator, *, spare_blocks: int = 3, spare_columns: int = 1):
    """Quantizes contiguous K/V into a paged cache with scattered, shuffled blocks.

    Unused slots hold random codes and scales and unused block-table entries hold -1, so a kernel
    that reads outside the context shows up as a wrong result or an error.

    Args:
        key, value: float [sum L_s, Hkv, D]; cu_seqlens_k: [S + 1].
        block_size: B. rng: numpy Generator. spare_blocks: extra blocks never referenced.
        spare_columns: extra (unused, -1) block-table columns.

    Returns:
        dict with key_cache, value_cache, key_scale, value_scale, block_tables (int32 [S, M]),
        seq_lens (int32 [S]).
    """
    cuk = np.asarray(cu_seqlens_k, np.int64)
    lens = np.diff(cuk)
    hkv, d = key.shape[1], key.shape[2]
    blocks_per_seq = -(-lens // block_size)
    n = int(blocks_per_seq.sum()) + spare_blocks
    m = int(blocks_per_seq.max(initial=0)) + spare_columns
    perm = rng.permutation(n)
    tables = np.full((len(lens), max(m, 1)), -1, np.int32)
    slots = np.empty(int(cuk[-1]), np.int64)
    nxt = 0
    for s, nb in enumerate(blocks_per_seq):
        tables[s, :nb] = perm[nxt:nxt + nb]
        nxt += nb
        pos = np.arange(lens[s])
        slots[cuk[s]:cuk[s + 1]] = tables[s, pos // block_size].astype(np.int64) * block_size + pos % block_size
    kc = rng.integers(-127, 128, (n, hkv, block_size, d), dtype=np.int8)
    vc = rng.integers(-127, 128, (n, hkv, d, block_size), dtype=np.int8)
    ks = rng.uniform(0.5, 2.0, (n, hkv, block_size)).astype(np.float32)
    vs = rng.uniform(0.5, 2.0, (n, hkv, block_size)).astype(np.float32)
    kc, vc, ks, vs = quantize_kv_cache(key, value, slots, kc, vc, ks, vs)
    return {"key_cache": kc, "value_cache": vc, "key_scale": ks, "value_scale": vs,
            "block_tables": tables, "seq_lens": lens.astype(np.int32)}
