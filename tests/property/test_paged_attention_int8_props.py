# SPDX-License-Identifier: MIT
"""PagedAttentionInt8 on the CPU EP against ort_ops.reference.paged_attention_int8 for random
valid inputs: every head dim, block sizes 8..256, GQA ratios 1..8, 1 to 4 sequences of 0 to ~1000
cached tokens (partial blocks and 32-key groups, contexts on partition boundaries), decode (no
cu_seqlens_q) and prefill with history (sequences without queries, whose table rows may then
hold anything, whole prompts, one-token steps),
qk/pv quantization modes, partition sizes, softmax scales, sliding windows (1 key to more than
the context), logit softcaps, per-head sinks, float32/float16 queries, K/V and query magnitudes
from tiny to large, every ISA variant.
Outputs are held to tests/ops/test_paged_attention_int8.py's bound (float rounding plus at most a
few W codes moved at rounding ties, tests/tolerances.py).

Invalid inputs (block ids out of range, seq_lens beyond the table or below the query count,
non-monotone or short cu_seqlens_q, NaN/Inf queries or sinks, disagreeing shapes, ranks, dtypes,
unsupported head dims and block sizes, GQA ratios that do not divide, misaligned buffers, bad
attributes) are refused naming the op and the input, every input buffer unchanged."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from ort_ops import reference
from ort_ops.ops import paged_attention_int8
from ort_ops.ops.paged_attention_int8 import build_paged_cache
from tests.ops.test_paged_attention_int8 import _assert_matches
from tests.property import _harness as h
from tests.property import _strategies as S

SCHEMA = paged_attention_int8.SCHEMA
CACHE = ("key_cache", "value_cache", "key_scale", "value_scale", "block_tables", "seq_lens")


@st.composite
def shapes(draw, max_len=300):
    d = draw(st.sampled_from(paged_attention_int8.SUPPORTED_HEAD_DIMS))
    b = draw(st.sampled_from([8, 16, 32, 64, 128, 256]))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    s = draw(st.integers(1, 4))
    decode = draw(st.booleans())
    lengths = [st.integers(1, 40), st.integers(1, max_len), st.sampled_from([1, 31, 32, 33, 255, 256, 257])]
    if s == 1:  # long contexts for a single sequence (keeps the reference's cost in bounds)
        lengths.append(st.integers(500, 1000))
    lens = [draw(st.one_of(*lengths)) for _ in range(s)]
    if decode:
        q_lens = None
    else:
        # Every sequence has at least one query row (DESIGN.md: T == S means decode).
        q_lens = [draw(st.one_of(st.just(1), st.integers(1, min(n, 24)), st.just(n))) for n in lens]
    return d, b, hkv, hkv * group, lens, q_lens


def make_case(rng, d, b, hkv, hq, lens, q_lens, dtype=np.float32, q_regime="normal", kv_spread=1.0, v_spread=1.0):
    """Inputs for the op (the paged cache scattered over shuffled blocks, random bytes in unused
    slots, -1 past each table row's used blocks) and max |V|, the scale of the outputs."""
    cuk = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    k = (rng.standard_normal((cuk[-1], hkv, d)) * kv_spread).astype(np.float32)
    v = (rng.standard_normal((cuk[-1], hkv, d)) * v_spread).astype(np.float32)
    cache = build_paged_cache(k, v, cuk, b, rng)
    t = len(lens) if q_lens is None else int(sum(q_lens))
    ins = {"query": S.floats(rng, (t, hq, d), dtype, q_regime), **{n: cache[n] for n in CACHE}}
    if q_lens is not None:
        ins["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return ins, float(np.abs(v).max(initial=0.0))


@st.composite
def valid_inputs(draw):
    d, b, hkv, hq, lens, q_lens = draw(shapes())
    rng = np.random.default_rng(draw(S.seeds))
    # Query regimes without "huge": scores of 1e37-sized queries overflow float32 by definition.
    q_regime = draw(st.sampled_from(["normal", "tiny", "ties", "zeros", "outliers"]))
    dtype = draw(S.float_dtypes)
    # V magnitudes: not below 1e-20 (with value scales near FLT_MIN the W factor saturates and the
    # kernels' unnormalized W differ from the spec's, DESIGN.md); float16 outputs (the query's
    # dtype) stay below 65504.
    v_exp = draw(st.sampled_from([-20, -3, 0, 3] + ([20] if dtype == np.float32 else [])))
    qk = draw(st.sampled_from(["s8", "none"]))
    # qk "none" takes float dot products, summed in another order than numpy's: their rounding
    # grows with |score| and exp amplifies it, beyond the bound's float term once scores reach
    # ~1e4 (found by a soak run). Its queries and keys stay as small as the op tests' (|q| <= 3,
    # key spread <= 1, scale <= 0.5), scores of a few tens; with qk s8 the integer dot is exact,
    # so large scores round alike in both.
    k_exp = draw(st.sampled_from([-30, -3, 0, 2] if qk == "s8" else [-30, -3, 0]))
    ins, vmax = make_case(rng, d, b, hkv, hq, lens, q_lens, dtype, q_regime,
                          kv_spread=10.0 ** k_exp, v_spread=10.0 ** v_exp)
    if qk == "none":
        amax = float(np.abs(ins["query"]).max(initial=0.0))
        if amax > 3.0:
            ins["query"] = (ins["query"].astype(np.float32) * np.float32(3.0 / amax)).astype(dtype)
    if q_lens is not None and draw(st.booleans()):
        # A sequence without queries is not read: its table row may hold anything.
        for i, nq in enumerate(q_lens):
            if nq == 0:
                ins["block_tables"][i] = rng.integers(-2**31, 2**31 - 1, ins["block_tables"].shape[1])
    attrs = {"qk_quant": qk, "pv_quant": draw(st.sampled_from(["s8", "u8", "none"])),
             "partition_size": draw(st.sampled_from([32, 64, 96, 256, 512]))}
    if draw(st.booleans()):
        attrs["scale"] = draw(st.sampled_from([0.0, -0.125, 1e-3, 0.5] + ([4.0] if qk == "s8" else [])))
    if draw(st.booleans()):
        attrs["window"] = draw(st.one_of(st.integers(1, 40), st.integers(1, 1100), st.sampled_from([1, 32, 33, 256])))
    if draw(st.booleans()):
        attrs["softcap"] = draw(st.sampled_from([0.25, 1.0, 5.0, 50.0]))
    if draw(st.booleans()):
        # Sinks far above the scores shrink every W by the same factor: kept to +30 so W stays
        # far above the code factor's saturation (V scales down to 1e-20, DESIGN.md).
        spread = draw(st.sampled_from([0.5, 3.0, 30.0]))
        ins["head_sink"] = (rng.uniform(-1.0, 1.0, ins["query"].shape[1]) * spread).astype(np.float32)
    query_free = k_exp == -30 or attrs.get("scale") == 0.0  # scores (about) independent of the query
    return ins, vmax, attrs, draw(S.isas()), query_free


@given(valid_inputs())
def test_matches_reference(case):
    ins, vmax, attrs, isa, query_free = case
    (got,) = h.run(SCHEMA, ins, attrs, isa=isa)
    if "head_sink" in ins:  # a sink shrinks the outputs: hold them to their own scale, not max |V|
        want = reference.paged_attention_int8(**ins, **attrs)
        vmax = min(vmax, float(np.abs(want.astype(np.float64)).max(initial=0.0)))
    # Heads of a kv group that see the same scores share W codes, so a rounding tie moves them
    # together: moved rows are counted per group. Where the scores do not depend on the query at
    # all, every row that sees a tied group moves with it: only the per-element bound applies.
    _assert_matches(got, ins, vmax, moved_unit=ins["query"].shape[1] // ins["key_cache"].shape[1],
                    count_moved_rows=not query_free, **attrs)


INVALID = ("block_high", "block_negative", "seq_len_past_table", "seq_len_negative", "seq_len_below_queries",
           "cu_not_monotone", "cu_wrong_end", "cu_shape", "cu_empty_sequence", "decode_t_ne_s", "nonfinite_query", "query_rank",
           "head_dim", "block_size", "gqa", "value_cache_shape", "scale_shape", "seq_lens_shape", "query_dtype",
           "table_dtype", "cu_dtype", "misaligned", "attr", "sink_nonfinite", "sink_shape", "sink_dtype")


@st.composite
def invalid_inputs(draw):
    d, b, hkv, hq, lens, q_lens = draw(shapes(max_len=80))
    rng = np.random.default_rng(draw(S.seeds))
    ins, _ = make_case(rng, d, b, hkv, hq, lens, q_lens, draw(S.float_dtypes))
    attrs = {}
    kind = draw(st.sampled_from(INVALID))
    s = len(lens)
    q = np.ones(s, np.int64) if q_lens is None else np.asarray(q_lens)
    with_q = [i for i in range(s) if q[i] > 0 and lens[i] > 0]
    bt, sl = ins["block_tables"], ins["seq_lens"]
    n = ins["key_cache"].shape[0]
    bad = "block_tables"
    if kind in ("block_high", "block_negative") and with_q:
        i = draw(st.sampled_from(with_q))
        j = draw(st.integers(0, (lens[i] - 1) // b))
        bt[i, j] = draw(st.integers(n, 2**31 - 1)) if kind == "block_high" else draw(st.integers(-2**31, -1))
    elif kind == "seq_len_past_table":
        bad = "seq_lens"
        sl[draw(st.integers(0, s - 1))] = draw(st.integers(bt.shape[1] * b + 1, 2**31 - 1))
    elif kind == "seq_len_negative":
        bad = "seq_lens"
        sl[draw(st.integers(0, s - 1))] = draw(st.integers(-2**31, -1))
    elif kind == "seq_len_below_queries" and with_q:
        bad = "seq_lens"
        i = draw(st.sampled_from(with_q))
        sl[i] = q[i] - 1
    elif kind == "cu_empty_sequence" and q_lens is not None and s >= 2:
        bad = "cu_seqlens_q"  # a sequence without query rows: its rows go to the next one
        i = draw(st.integers(0, s - 2))
        ins["cu_seqlens_q"][i + 1] = ins["cu_seqlens_q"][i]
    elif kind in ("cu_not_monotone", "cu_wrong_end", "cu_shape") and q_lens is not None:
        bad = "cu_seqlens_q"
        cu = ins["cu_seqlens_q"]
        if kind == "cu_not_monotone" and s >= 2:
            i = draw(st.integers(1, s - 1))
            cu[i] = cu[i + 1] + draw(st.integers(1, 5))  # rises past its successor, so one step is negative
        elif kind == "cu_wrong_end":
            cu[draw(st.sampled_from([0, s]))] += draw(st.sampled_from([-3, -1, 1, 7]))
        else:
            ins["cu_seqlens_q"] = cu[:-1] if draw(st.booleans()) else np.append(cu, cu[-1])
    elif kind == "decode_t_ne_s" and q_lens is None:
        bad = "query"
        ins["query"] = np.concatenate([ins["query"], ins["query"][:1]])
    elif kind == "nonfinite_query" and ins["query"].size:
        bad = "query"
        ins["query"].flat[draw(st.integers(0, ins["query"].size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif kind == "query_rank":
        bad = "query"
        ins["query"] = ins["query"].reshape(ins["query"].shape[0], hq * d)
    elif kind == "head_dim":
        bad = ["head_dim must", "query"]  # the head dim is dim 2 of 'query'; the message calls it head_dim
        d2 = draw(st.sampled_from([16, 48, 72, 100, 512]))  # 32, 64, 80, 96, 128, 256 are supported
        t = ins["query"].shape[0]
        ins["query"] = np.zeros((t, hq, d2), ins["query"].dtype)
        kn = ins["key_cache"].shape
        ins["key_cache"] = np.zeros((kn[0], kn[1], kn[2], d2), np.int8)
        ins["value_cache"] = np.zeros((kn[0], kn[1], d2, kn[2]), np.int8)
    elif kind == "block_size":
        bad = "key_cache"
        b2 = draw(st.sampled_from([1, 4, 12, 24, 512]))
        kn = ins["key_cache"].shape
        ins["key_cache"] = np.zeros((kn[0], kn[1], b2, kn[3]), np.int8)
        ins["value_cache"] = np.zeros((kn[0], kn[1], kn[3], b2), np.int8)
        ins["key_scale"] = np.zeros((kn[0], kn[1], b2), np.float32)
        ins["value_scale"] = np.zeros((kn[0], kn[1], b2), np.float32)
    elif kind == "gqa":
        bad = "key_cache"
        kn = ins["key_cache"].shape
        hkv2 = draw(st.sampled_from([0, hq + 1] + ([5] if hq % 5 else [])))
        ins["key_cache"] = np.zeros((kn[0], hkv2, kn[2], kn[3]), np.int8)
        ins["value_cache"] = np.zeros((kn[0], hkv2, kn[3], kn[2]), np.int8)
        ins["key_scale"] = np.zeros((kn[0], hkv2, kn[2]), np.float32)
        ins["value_scale"] = np.zeros((kn[0], hkv2, kn[2]), np.float32)
    elif kind == "value_cache_shape":
        bad = "value_cache"
        ins["value_cache"] = np.ascontiguousarray(ins["value_cache"].transpose(0, 1, 3, 2))
        if b == d:
            ins["value_cache"] = ins["value_cache"][:-1] if n > 1 else np.zeros((2, *ins["value_cache"].shape[1:]), np.int8)
    elif kind == "scale_shape":
        bad = draw(st.sampled_from(["key_scale", "value_scale"]))
        ins[bad] = np.zeros((n + 1, *ins[bad].shape[1:]), np.float32)
    elif kind == "seq_lens_shape":
        bad = "seq_lens"
        ins["seq_lens"] = np.append(sl, sl[:1])
    elif kind == "query_dtype":
        bad = "query"
        ins["query"] = ins["query"].astype(draw(st.sampled_from([np.float64, np.int8, np.int32])))
    elif kind == "misaligned" and ins["query"].size:
        bad = draw(st.sampled_from(["query", "key_scale", "value_scale", "block_tables", "seq_lens"]))
        ins[bad] = S.misaligned(ins[bad])
    elif kind == "table_dtype":
        ins["block_tables"] = bt.astype(np.int64)
    elif kind == "sink_nonfinite":
        bad = "head_sink"
        ins["head_sink"] = np.zeros(hq, np.float32)
        ins["head_sink"][draw(st.integers(0, hq - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif kind == "sink_shape":
        bad = "head_sink"
        ins["head_sink"] = np.zeros(draw(st.sampled_from([(hq + 1,), (hq, 1), (1,) if hq > 1 else (2,)])), np.float32)
    elif kind == "sink_dtype":
        bad = "head_sink"
        ins["head_sink"] = np.zeros(hq, draw(st.sampled_from([np.float16, np.float64])))
    elif kind == "cu_dtype" and q_lens is not None:
        bad = "cu_seqlens_q"
        ins["cu_seqlens_q"] = ins["cu_seqlens_q"].astype(np.int64)
    else:  # attributes, and the kinds above that do not apply to the drawn shapes
        bad, value = draw(st.sampled_from([("qk_quant", "u8"), ("qk_quant", "int8"), ("pv_quant", "fp8"),
                                           ("pv_quant", ""), ("partition_size", 0), ("partition_size", 48),
                                           ("partition_size", -256), ("scale", float("inf")),
                                           ("scale", float("nan")), ("window", -1), ("window", -2**40),
                                           ("softcap", -0.5), ("softcap", float("nan")),
                                           ("softcap", float("inf"))]))
        attrs[bad] = value
    return ins, attrs, bad, draw(S.isas()), kind != "misaligned"


@given(invalid_inputs())
def test_invalid_refused(case):
    ins, attrs, bad, isa, ref_refuses = case  # numpy has no notion of a misaligned buffer
    h.assert_refused(SCHEMA, ins, attrs, bad, isa=isa, reference=reference.paged_attention_int8 if ref_refuses else None)
