# SPDX-License-Identifier: MIT
"""QuantizeKVCache and PagedAttentionInt8 CUDA kernels against ort_ops.reference.

The launchers run through ctypes (ort_ops.testing.attention_launchers) on torch CUDA tensors; every test is
``@pytest.mark.cuda`` and skips with the reason when torch, a GPU or a CUDA build is missing.
QuantizeKVCache codes and scales are bit-exact. PagedAttentionInt8 outputs (also with window,
softcap and head_sink, every kernel) are within the
bounds in tests/tolerances.py (why: the kernel's exp and summation order differ from numpy's,
which can move a W code by one at a rounding tie). Outputs are poisoned with NaN before each
run, so an unwritten element fails.

Alphabet: T query tokens, S sequences, Hq / Hkv heads, D head dim, B block size.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from ort_ops.testing.attention_launchers import cuda_unavailable_reason
from ort_ops.ops.paged_attention_int8 import build_paged_cache
from tests.ops.device_errors import assert_reported_both_ways
from tests.tolerances import (
    INT8_EXACT_ATOL,
    PA_CUDA_FLIP_BUDGET,
    PA_CUDA_FLOAT_ATOL_REL,
    PA_CUDA_FP16_OUT_RTOL,
    PA_CUDA_NONE_W_RTOL,
)

pytestmark = pytest.mark.cuda

_WHY = cuda_unavailable_reason()
if _WHY is not None:
    pytest.skip(f"CUDA kernels unavailable: {_WHY}", allow_module_level=True)

# Imported only after the skip: CI has no torch with CUDA.
import torch

from ort_ops.testing import attention_launchers as _cuda


def _dev(a):
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


# ---------------------------------------------------------------- QuantizeKVCache

@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("d,b", [(64, 16), (128, 32), (256, 64), (96, 16)])
def test_quantize_kv_cache_bit_exact(rng, dtype, d, b):
    t, hkv, n = 37, 3, 9
    key = (rng.standard_normal((t, hkv, d)) * rng.uniform(0.01, 30.0, (t, hkv, 1))).astype(dtype)
    value = (rng.standard_normal((t, hkv, d)) * rng.uniform(0.01, 30.0, (t, hkv, 1))).astype(dtype)
    key[3, 1] = 0  # amax 0: scale 0, codes 0
    slots = rng.permutation(n * b)[:t].astype(np.int64)
    slots[[5, 11]] = -1  # skipped tokens
    kc = rng.integers(-127, 128, (n, hkv, b, d), dtype=np.int8)
    vc = rng.integers(-127, 128, (n, hkv, d, b), dtype=np.int8)
    ks = rng.uniform(0.5, 2, (n, hkv, b)).astype(np.float32)
    vs = rng.uniform(0.5, 2, (n, hkv, b)).astype(np.float32)
    want = reference.quantize_kv_cache(key, value, slots, kc, vc, ks, vs)
    dev = [_dev(x) for x in (kc, vc, ks, vs)]
    assert _cuda.quantize_kv_cache(_dev(key), _dev(value), _dev(slots), *dev) == 0
    for name, w, g in zip(("key_cache", "value_cache", "key_scale", "value_scale"), want, dev):
        got = g.cpu().numpy()
        # Codes compared as integers, scales bit for bit (INT8_EXACT_ATOL: nothing to tolerate).
        diff = np.abs(got.astype(np.int64) - w) if w.dtype == np.int8 else \
            np.abs(got.view(np.int32).astype(np.int64) - w.view(np.int32))
        bad = np.argwhere(diff > INT8_EXACT_ATOL)
        assert bad.size == 0, f"{name}: {len(bad)} mismatches, first at {bad[:3].tolist()}"


@pytest.mark.parametrize("t", [4, 64, 65, 300])  # the in-kernel check (T <= 64) and the check kernel
def test_quantize_kv_cache_flags_bad_slots_and_nan(rng, t):
    """A slot past the cache or a live slot twice: flagged, and nothing of the launch is written
    (the caches stay byte for byte as they were). A NaN vector: flagged, only it unwritten."""
    hkv, d, b = 2, 64, 16
    n = (t + b - 1) // b + 1
    key = rng.standard_normal((t, hkv, d)).astype(np.float32)
    value = rng.standard_normal((t, hkv, d)).astype(np.float32)
    caches = [rng.integers(-127, 128, (n, hkv, b, d), dtype=np.int8), rng.integers(-127, 128, (n, hkv, d, b), dtype=np.int8),
              rng.uniform(0.5, 2, (n, hkv, b)).astype(np.float32), rng.uniform(0.5, 2, (n, hkv, b)).astype(np.float32)]
    good = rng.permutation(n * b)[:t].astype(np.int64)
    good[t // 2] = -1  # skipped: may repeat
    good[t - 1] = -1
    for why, slots in (("past the end", np.where(np.arange(t) == t - 2, n * b, good)),
                       ("repeated", np.where(np.arange(t) == t - 2, good[0], good))):
        dev = [_dev(x) for x in caches]
        assert _cuda.quantize_kv_cache(_dev(key), _dev(value), _dev(slots), *dev) & 1, why
        for before, after in zip(caches, dev):
            assert np.array_equal(after.cpu().numpy().view(np.uint8), before.view(np.uint8)), why
    dev = [_dev(x) for x in caches]
    assert _cuda.quantize_kv_cache(_dev(key), _dev(value), _dev(good), *dev) == 0
    for w, g in zip(reference.quantize_kv_cache(key, value, good, *caches), dev):
        assert np.array_equal(g.cpu().numpy().view(np.uint8), w.view(np.uint8))
    value[2, 1, 5] = np.nan
    dev = [_dev(x) for x in caches]
    live = np.arange(t, dtype=np.int64)
    assert _cuda.quantize_kv_cache(_dev(key), _dev(value), _dev(live), *dev) == 2
    assert np.array_equal(dev[3].cpu().numpy()[0, 1, 2:3].view(np.uint8), caches[3][0, 1, 2:3].view(np.uint8))


# ---------------------------------------------------------------- PagedAttentionInt8

def _make_case(rng, lens, q_lens, hq, hkv, d, b, dtype, *, decode):
    """Random K/V (per-token magnitudes vary) in a scattered paged cache plus queries."""
    total = int(sum(lens))
    cuk = np.concatenate([[0], np.cumsum(lens)])
    key = (rng.standard_normal((total, hkv, d)) * rng.uniform(0.2, 3.0, (total, hkv, 1))).astype(np.float32)
    value = (rng.standard_normal((total, hkv, d)) * rng.uniform(0.2, 3.0, (total, hkv, 1))).astype(np.float32)
    cache = build_paged_cache(key, value, cuk, b, rng)
    t = int(sum(q_lens))
    query = (rng.standard_normal((t, hq, d)) * 2.0).astype(dtype)
    cu = None if decode else np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return query, cache, cu


def _ref(query, cache, cu, **attrs):
    args = (query, cache["key_cache"], cache["value_cache"], cache["key_scale"], cache["value_scale"],
            cache["block_tables"], cache["seq_lens"], cu)
    try:
        out, step = reference.paged_attention_int8(*args, return_code_step=True, **attrs)
    except TypeError:  # a reference without the code-step report: use the largest possible step
        out = reference.paged_attention_int8(*args, **attrs)
        step = np.full(out.shape[:2], np.float32(cache["value_scale"].max()), np.float32)
    return out, step


def _run(query, cache, cu, **kw):
    args = [_dev(query)] + [_dev(cache[k]) for k in ("key_cache", "value_cache", "key_scale", "value_scale",
                                                     "block_tables", "seq_lens")]
    args.append(None if cu is None else _dev(cu))
    out = torch.full(query.shape, float("nan"), dtype=args[0].dtype, device="cuda")
    return _cuda.paged_attention_int8(*args, out=out, **kw)


def _check_close(got, want, step, cache, pv_quant, dtype, what=""):
    got = got.astype(np.float64)
    want64 = want.astype(np.float64)
    assert np.all(np.isfinite(got)), f"{what}: {np.sum(~np.isfinite(got))} non-finite outputs (unwritten?)"
    # Bound per (token, head): W-code flips (pv s8/u8) or fp16 W (pv none), float32 rounding,
    # and the output's own fp16 rounding (see tests/tolerances.py).
    if pv_quant == "none":
        bound = PA_CUDA_NONE_W_RTOL * 127.0 * float(cache["value_scale"].max()) * np.ones(want.shape[:2])
    else:
        bound = PA_CUDA_FLIP_BUDGET * 128.0 * step.astype(np.float64)
    bound = bound[:, :, None] + PA_CUDA_FLOAT_ATOL_REL * np.abs(want64).max()
    if dtype == "float16":
        bound = bound + PA_CUDA_FP16_OUT_RTOL * np.abs(want64)
    err = np.abs(got - want64)
    bad = np.argwhere(err > bound)
    assert bad.size == 0, (f"{what}: {len(bad)} of {err.size} outside the bound; first {bad[:3].tolist()}, "
                           f"max err {err.max():.3g}, bound there {bound[tuple(bad[0])]:.3g}")


DECODE_CASES = [
    # (seq lens, Hq, Hkv, D, B)
    ([1, 7, 129, 1025], 8, 2, 128, 16),
    ([300, 64, 513], 32, 8, 128, 32),
    ([257, 33], 4, 4, 64, 64),
    ([700, 5], 16, 2, 256, 16),
    ([96, 2000], 32, 1, 128, 64),  # G = 32: two head tiles of 16 rows
    # The warp-decode kernel (G <= 8, D 64 / 128): all 8 rows of its MMA used, blocks longer
    # than a 32-key stage (both halves of a stage in one block), partial last stages.
    ([500, 77, 1], 16, 2, 64, 128),
    ([1300, 31], 8, 1, 128, 256),
    ([1025, 64, 3], 8, 2, 128, 64),  # the benchmark shape: two 32-key stages a block
    # Blocks >= 64: two warps share each 64-key stage (each copies half of the V rows, whole rows);
    # lengths that leave the second warp of the last pair without keys (2049, 129) or with a few.
    ([2049, 95, 160, 129], 8, 2, 128, 128),
    # D 32: the decode kernel (8-byte K slices per lane) with 16-key half stages, with VROWS pair
    # stages, G 1; the general kernel with 4 warps (G 16: one 16-row tile).
    ([1, 7, 129, 1025], 8, 2, 32, 16),
    ([2049, 95, 160, 129], 8, 2, 32, 128),
    ([257, 33], 4, 4, 32, 32),
    ([700, 5, 64], 32, 2, 32, 64),
    # D 64, blocks >= 64: the dual-stage loop (two of a warp's 32-key stages an iteration; the
    # llama-1B shape G 4): counts of a warp's stages that are odd, even, zero (lengths 95, 129)
    # and leave the pair's last stage to one warp.
    ([2049, 95, 160, 129, 4096], 32, 8, 64, 64),
    ([1025, 64, 3, 288], 8, 2, 64, 128),
]


@pytest.mark.parametrize("pv_quant", ["s8", "u8", "none"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"L{'-'.join(map(str, c[0]))}-h{c[1]}x{c[2]}-d{c[3]}-b{c[4]}")
def test_decode_matches_reference(rng, case, pv_quant):
    lens, hq, hkv, d, b = case
    dtype = "float16" if rng.integers(2) else "float32"
    query, cache, _ = _make_case(rng, lens, [1] * len(lens), hq, hkv, d, b, dtype, decode=True)
    want, step = _ref(query, cache, None, pv_quant=pv_quant)
    for split in (0, 1, 3):
        got, status = _run(query, cache, None, pv_quant=pv_quant, num_splits=split)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        _check_close(got.cpu().numpy(), want, step, cache, pv_quant, dtype, f"{dtype} splits={split}")


@pytest.mark.parametrize("block", [32, 64])  # 64: a 32-key warp stage is half a block
@pytest.mark.parametrize("partition_size", [32, 96, 512, 2048])
def test_partition_size_changes_nothing_beyond_rounding(rng, partition_size, block):
    query, cache, _ = _make_case(rng, [1111, 40], [1, 1], 8, 2, 128, block, "float32", decode=True)
    want, step = _ref(query, cache, None, partition_size=partition_size)
    got, status = _run(query, cache, None, partition_size=partition_size)
    assert status == 0
    _check_close(got.cpu().numpy(), want, step, cache, "s8", "float32", f"P={partition_size}")


@pytest.mark.parametrize("pv_quant", ["s8", "none"])
@pytest.mark.parametrize("d,b", [(128, 64), (64, 32), (32, 16), (64, 64)])
def test_decode_running_max_jumps(rng, d, b, pv_quant):
    """Scores that climb by ~90 (log2 units) along sequence 0 and sit far below an early spike in
    sequence 1: the decode kernel rescales O and l only when a row's max passes its reference by
    more than 2^8, so sequence 0 crosses that threshold many times (with weights up to 2^8 above
    the reference in between) and sequence 1 never does after the spike. Both against the
    reference, with and without key splits."""
    lens, hq, hkv = [2500, 777], 8, 2
    g = hq // hkv
    query = (rng.standard_normal((len(lens), hq, d)) * 2.0).astype(np.float32)
    cuk = np.concatenate([[0], np.cumsum(lens)])
    key = (rng.standard_normal((sum(lens), hkv, d)) * 0.3).astype(np.float32)
    value = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    scale = 1.0 / np.sqrt(d)
    for s_i, n in enumerate(lens):
        pos = np.arange(n)
        if s_i == 0:
            c = (pos / n) * np.where((pos // 300) % 2 == 0, 1.0, 0.8)  # a climb with dips
        else:
            c = np.full(n, 0.2)
            c[3] = 1.0  # one spike at the start, then far below it
        for h in range(hkv):
            qg = query[s_i, h * g:(h + 1) * g]
            qdir = (qg / np.linalg.norm(qg, axis=1, keepdims=True)).sum(0)
            qdir /= np.linalg.norm(qdir)
            amp = 60.0 / (np.min(qg @ qdir) * scale)  # the weakest head's top score is ~60 (natural log)
            key[cuk[s_i]:cuk[s_i + 1], h] += (c[:, None] * amp * qdir[None, :]).astype(np.float32)
    cache = build_paged_cache(key, value, cuk, b, rng)
    want, step = _ref(query, cache, None, pv_quant=pv_quant)
    for split in (0, 1, 3):
        got, status = _run(query, cache, None, pv_quant=pv_quant, num_splits=split)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        _check_close(got.cpu().numpy(), want, step, cache, pv_quant, "float32", f"splits={split}")


@pytest.mark.parametrize("pv_quant", ["s8", "u8"])
def test_code_factor_saturates_for_tiny_weights(rng, pv_quant):
    """A group whose largest W is subnormal (L / max W overflows): both the decode kernel and the
    general kernel give the reference's exact group-0 sum (see the CPU test of the same name)."""
    from tests.ops.test_paged_attention_int8 import tiny_w_group_case
    for rows in (1, 3):  # decode kernel; general (prefill) kernel
        ins, want = tiny_w_group_case(rng, q_rows=rows)
        cache = {k: ins[k] for k in ("key_cache", "value_cache", "key_scale", "value_scale",
                                     "block_tables", "seq_lens")}
        cu = None if rows == 1 else np.array([0, rows], np.int32)
        for split in (0, 2):
            got, status = _run(ins["query"], cache, cu, pv_quant=pv_quant, num_splits=split)
            assert status == 0, _cuda.PA_STATUS.get(status, status)
            np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("pv_quant", ["s8", "u8", "none"])
@pytest.mark.parametrize("hq,hkv,d,b", [(8, 2, 128, 16), (4, 1, 64, 32), (6, 2, 256, 64), (1, 1, 128, 16),
                                        (8, 2, 32, 16), (32, 2, 32, 64), (2, 2, 32, 32)])
def test_prefill_with_history_matches_reference(rng, hq, hkv, d, b, pv_quant):
    q_lens = [7, 1, 40]
    lens = [7 + 300, 1, 40 + 95]  # history of 300, none, 95
    dtype = "float16" if rng.integers(2) else "float32"
    query, cache, cu = _make_case(rng, lens, q_lens, hq, hkv, d, b, dtype, decode=False)
    want, step = _ref(query, cache, cu, pv_quant=pv_quant)
    for split in (0, 2):
        got, status = _run(query, cache, cu, pv_quant=pv_quant, num_splits=split)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        _check_close(got.cpu().numpy(), want, step, cache, pv_quant, dtype, f"prefill splits={split}")


def test_close_to_exact_attention(rng):
    """Sanity against float64 attention on the unquantized K/V (INT8 K, V, Q and W): the
    relative L2 error stays at the INT8 level (a lost scale or a wrong group would not)."""
    lens, hq, hkv, d = [2048, 999], 8, 2, 128
    cuk = np.concatenate([[0], np.cumsum(lens)])
    key = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    value = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    cache = build_paged_cache(key, value, cuk, 32, rng)
    query = (rng.standard_normal((2, hq, d)) * 3).astype(np.float32)
    exact = reference.exact_attention(query, key, value, cuk)
    for pv in ("s8", "u8", "none"):
        got, status = _run(query, cache, None, pv_quant=pv)
        assert status == 0
        rel = np.linalg.norm(got.cpu().numpy() - exact) / np.linalg.norm(exact)
        assert rel < 0.05, f"pv {pv}: relative L2 {rel:.4f} vs exact attention"


def test_bad_inputs_are_flagged_not_read(rng):
    query, cache, _ = _make_case(rng, [100, 50], [1, 1], 4, 2, 64, 16, "float32", decode=True)
    bad = dict(cache)
    bad["block_tables"] = cache["block_tables"].copy()
    bad["block_tables"][1, 2] = 10_000  # a block the context needs, out of range
    assert _run(query, bad, None)[1] & 1
    bad["block_tables"][1, 2] = -1
    assert _run(query, bad, None)[1] & 1
    bad = dict(cache, seq_lens=np.array([100, cache["block_tables"].shape[1] * 16 + 1], np.int32))
    assert _run(query, bad, None)[1] & 2
    q = query.copy()
    q[0, 1, 3] = np.inf
    assert _run(q, cache, None)[1] & 8
    cu = np.array([0, 2, 1], np.int32)  # not rising to T
    q2 = np.concatenate([query, query[:0]])
    assert _run(q2, cache, cu)[1] & 4


@pytest.mark.parametrize("d,b", [(128, 64), (64, 128), (64, 64)])
def test_bad_block_flagged_in_shared_stages(monkeypatch, rng, d, b):
    """Blocks >= 64 (the warp-decode stages two warps share): an out-of-range block id the
    context needs is flagged, whether it holds many keys of a stage or only the sequence's last;
    at D 64 in each of its loops (ORT_OPS_PA_DECODE)."""
    query, cache, _ = _make_case(rng, [4 * b + 1, 3 * b], [1, 1], 8, 2, d, b, "float32", decode=True)
    for loop in ("wide", "dual", "single") if d == 64 else ("default",):
        if loop in ("single", "dual"):
            monkeypatch.setenv("ORT_OPS_PA_DECODE", loop)
        for s, blk in ((0, 4), (0, 1), (1, 2)):  # block 4 of sequence 0 holds only its last key
            for bad_id in (10_000, -1):
                bad = dict(cache)
                bad["block_tables"] = cache["block_tables"].copy()
                bad["block_tables"][s, blk] = bad_id
                for split in (0, 1, 3):
                    assert _run(query, bad, None, num_splits=split)[1] & 1, (loop, s, blk, bad_id, split)


@pytest.mark.parametrize("d,b,msg", [(96, 16, "head_dim must be one of"), (64, 8, "block_size must be a power of two >= 16")])
def test_unsupported_configs_are_refused(rng, d, b, msg):
    query, cache, _ = _make_case(rng, [20], [1], 2, 1, d, b, "float32", decode=True)
    with pytest.raises(ValueError, match=msg):
        _run(query, cache, None)


# ---------------------------------------------------------------- through onnxruntime-gpu (CUDA EP)

@pytest.fixture
def cuda_ep():
    """Sessions on the CUDA EP with profiling on, so a test can prove where the node ran."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu not installed)")

    from ort_ops._lib import session_options
    from ort_ops.ops._schema import single_op_model

    def make(schema, inputs, **attrs):
        model = single_op_model(schema, inputs, **attrs)
        so = session_options()
        so.enable_profiling = True
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CUDAExecutionProvider", "CPUExecutionProvider"])

    return make


def _providers_of(sess, op_type):
    import json

    with open(sess.end_profiling()) as f:
        events = json.load(f)
    return {e["args"].get("provider") for e in events
            if e.get("cat") == "Node" and e["args"].get("op_name") == op_type}


def test_cuda_ep_quantize_then_attend(cuda_ep, rng):
    """QuantizeKVCache then PagedAttentionInt8 as ORT sessions on the CUDA EP (decode and prefill),
    against the references; a bad block table or slot mapping is reported with the op's message
    and a QuantizeKVCache Run with a bad slot mapping writes nothing."""
    from ort_ops.ops import paged_attention_int8 as pa_mod
    from ort_ops.ops import quantize_kv_cache as qkv_mod

    lens, hq, hkv, d, b = [300, 77], 8, 2, 128, 16
    cuk = np.concatenate([[0], np.cumsum(lens)])
    key = rng.standard_normal((sum(lens), hkv, d)).astype(np.float16)
    value = rng.standard_normal((sum(lens), hkv, d)).astype(np.float16)
    cache = build_paged_cache(key.astype(np.float32), value.astype(np.float32), cuk, b, rng)
    tables = cache["block_tables"]
    slots = np.concatenate([tables[s, np.arange(n) // b].astype(np.int64) * b + np.arange(n) % b
                            for s, n in enumerate(lens)])
    n_blocks = cache["key_cache"].shape[0]
    empty = {"key_cache": np.zeros_like(cache["key_cache"]), "value_cache": np.zeros_like(cache["value_cache"]),
             "key_scale": np.zeros_like(cache["key_scale"]), "value_scale": np.zeros_like(cache["value_scale"])}
    feeds = {"key": key, "value": value, "slot_mapping": slots, **empty}
    sess = cuda_ep(qkv_mod.SCHEMA, feeds)
    got = sess.run(None, feeds)
    assert _providers_of(sess, "QuantizeKVCache") == {"CUDAExecutionProvider"}
    want = reference.quantize_kv_cache(key, value, slots, *empty.values())
    for g, w_ in zip(got, want):
        assert np.array_equal(g.view(np.uint8), w_.view(np.uint8))
    caches = dict(zip(("key_cache", "value_cache", "key_scale", "value_scale"), got))
    assert n_blocks == caches["key_cache"].shape[0]

    for q_lens in ([1, 1], [5, 33]):
        query = rng.standard_normal((sum(q_lens), hq, d)).astype(np.float16)
        cu = None if q_lens == [1, 1] else np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        pf = {"query": query, **caches, "block_tables": tables, "seq_lens": cache["seq_lens"]}
        if cu is not None:
            pf["cu_seqlens_q"] = cu
        sess = cuda_ep(pa_mod.SCHEMA, pf, pv_quant="u8")
        out = sess.run(None, pf)[0]
        assert _providers_of(sess, "PagedAttentionInt8") == {"CUDAExecutionProvider"}
        want, step = _ref(query, dict(cache, **caches), cu, pv_quant="u8")
        _check_close(out, want, step, dict(cache, **caches), "u8", "float16", f"ORT CUDA EP q_lens={q_lens}")

    bad = dict(pf, block_tables=tables.copy())
    bad["block_tables"][0, 0] = n_blocks + 5
    sess = cuda_ep(pa_mod.SCHEMA, bad, pv_quant="u8")
    (out,) = assert_reported_both_ways(
        sess, bad, pf, rf"PagedAttentionInt8: input 'block_tables' must hold block ids in 0..{n_blocks - 1}")
    _check_close(out, want, step, dict(cache, **caches), "u8", "float16", "ORT CUDA EP after a bad Run")

    # QuantizeKVCache: a repeated live slot or one past the cache writes nothing of that Run.
    qkv = cuda_ep(qkv_mod.SCHEMA, feeds)
    for bad_slots in (np.concatenate([slots[:-1], slots[:1]]), np.where(np.arange(slots.size) == 3, n_blocks * b, slots)):
        got = assert_reported_both_ways(qkv, dict(feeds, slot_mapping=bad_slots.astype(np.int64)), feeds,
                                        r"QuantizeKVCache: input 'slot_mapping' must hold slots < ")
        for g, w_ in zip(got, reference.quantize_kv_cache(key, value, slots, *empty.values())):
            assert np.array_equal(g.view(np.uint8), w_.view(np.uint8))


@pytest.mark.parametrize("d", [128, 32])
@pytest.mark.parametrize("pv_quant", ["s8", "none"])
def test_decode_kernel_takes_cu_seqlens_when_one_query_each(rng, pv_quant, d):
    """decode_with_cu (what the CUDA op sets when T == S with cu_seqlens_q, every decode step of a
    rewritten model): one row per sequence runs the decode kernel on cu_seqlens_q and matches the
    reference; a T == S step that is not one row each (a sequence of 2 and one of 0, which the
    contract refuses) is flagged with its own bit and computes nothing; a bad cu_seqlens_q is
    still flagged as such."""
    lens, hq, hkv, b = [300, 1025, 64], 8, 2, 64
    query, cache, _ = _make_case(rng, lens, [1, 1, 1], hq, hkv, d, b, "float16", decode=True)
    cu = np.arange(4, dtype=np.int32)
    want, step = _ref(query, cache, cu, pv_quant=pv_quant)
    for split in (0, 1, 3):
        got, status = _run(query, cache, cu, pv_quant=pv_quant, num_splits=split, decode_with_cu=True)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        _check_close(got.cpu().numpy(), want, step, cache, pv_quant, "float16", f"decode_with_cu splits={split}")
    uneven = np.array([0, 2, 2, 3], np.int32)  # T == S = 3, but 2 / 0 / 1 rows
    _, status = _run(query, cache, uneven, pv_quant=pv_quant, decode_with_cu=True)
    assert status & 16 and not status & 4, status
    bad = np.array([0, 1, 3, 2], np.int32)  # falls: invalid, whatever the kernel
    _, status = _run(query, cache, bad, pv_quant=pv_quant, decode_with_cu=True)
    assert status & 4, status


@pytest.mark.parametrize("d", [128, 32])
def test_cuda_ep_decode_steps_with_cu_seqlens(cuda_ep, rng, d):
    """A rewritten model passes cu_seqlens_q on every step: on the CUDA EP a one-row-each step runs
    the decode kernel and equals the reference; a T == S step that is not one row each (a sequence
    without query rows, which the contract refuses) is reported as a bad cu_seqlens_q, and the
    session then answers the good step again."""
    from ort_ops.ops import paged_attention_int8 as pa_mod

    lens, hq, hkv, b = [300, 77, 1030], 8, 2, 64
    query, cache, cu = _make_case(rng, lens, [1, 1, 1], hq, hkv, d, b, "float16", decode=False)
    feeds = {"query": query, **{k: cache[k] for k in ("key_cache", "value_cache", "key_scale", "value_scale",
                                                      "block_tables", "seq_lens")}, "cu_seqlens_q": cu}
    sess = cuda_ep(pa_mod.SCHEMA, feeds, pv_quant="s8")
    out = sess.run(None, feeds)[0]
    assert _providers_of(sess, "PagedAttentionInt8") == {"CUDAExecutionProvider"}
    want, step = _ref(query, cache, cu, pv_quant="s8")
    _check_close(out, want, step, cache, "s8", "float16", "ORT CUDA EP cu q_lens=[1, 1, 1]")
    uneven = dict(feeds, cu_seqlens_q=np.array([0, 2, 2, 3], np.int32))
    (out,) = assert_reported_both_ways(
        sess, uneven, feeds, r"PagedAttentionInt8: input 'cu_seqlens_q' must rise from 0 to T = 3 with at least one")
    _check_close(out, want, step, cache, "s8", "float16", "ORT CUDA EP after a bad Run")


# ---------------------------------------------------------------- prefill kernel (cuda_prefill.cu)
# Launches with max_q_len * G >= 32, D 64 / 128 and G in {1, 2, 4, 8} run the 64-row prefill
# kernel; ORT_OPS_PA_PREFILL=general forces the general kernel (read at each launch), so both
# paths stay tested on the same shapes.

PREFILL_CASES = [
    # (q lens, history lens, Hq, Hkv, D, B): several sequences through cu_seqlens_q, partial last
    # blocks and 32-key groups, a sequence with one new token on a long history, one without history.
    ([70, 1, 33, 130], [300, 1000, 0, 61], 8, 2, 128, 64),     # G 4
    ([129, 1, 40], [95, 700, 257], 32, 4, 128, 16),            # G 8, block 16
    ([100, 17], [333, 1], 4, 4, 64, 32),                       # G 1, D 64, block 32
    ([64, 3, 90], [64, 2000, 5], 4, 2, 64, 64),                # G 2, D 64
    ([200], [1500], 8, 1, 128, 32),                            # G 8, one sequence, block 32
    ([47, 66], [129, 450], 2, 2, 128, 128),                    # G 1, block 128
]


@pytest.mark.parametrize("kernel", ["prefill", "general"])
@pytest.mark.parametrize("pv_quant", ["s8", "u8", "none"])
@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: f"q{'-'.join(map(str, c[0]))}-h{c[2]}x{c[3]}-d{c[4]}-b{c[5]}")
def test_prefill_kernel_matches_reference(monkeypatch, rng, case, pv_quant, kernel):
    q_lens, hist, hq, hkv, d, b = case
    if kernel == "general":
        monkeypatch.setenv("ORT_OPS_PA_PREFILL", "general")
    lens = [q + h for q, h in zip(q_lens, hist)]
    dtype = "float16" if rng.integers(2) else "float32"
    query, cache, cu = _make_case(rng, lens, q_lens, hq, hkv, d, b, dtype, decode=False)
    want, step = _ref(query, cache, cu, pv_quant=pv_quant)
    # Splits 2 and 3 with partition 96: split starts that are not multiples of 64 (a stage then
    # spans two blocks of 64).
    for split, part in ((0, 256), (2, 256), (3, 96)):
        got, status = _run(query, cache, cu, pv_quant=pv_quant, num_splits=split, partition_size=part)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        _check_close(got.cpu().numpy(), want, step, cache, pv_quant, dtype,
                     f"{kernel} {dtype} splits={split} P={part}")


@pytest.mark.parametrize("pv_quant", ["s8", "u8", "none"])
@pytest.mark.parametrize("d,b", [(128, 64), (64, 16)])
def test_prefill_extreme_scores(rng, d, b, pv_quant):
    """Peaked softmax in prefill: scores up to ~+-400 (natural log), so most weights underflow,
    the running max jumps by far more than the lazy-rescale threshold between stages, and whole
    32-key groups weigh nothing next to their stage's max; against the reference, with splits."""
    q_lens, hist, hq, hkv = [96, 40], [700, 90], 8, 2
    lens = [q + h for q, h in zip(q_lens, hist)]
    cuk = np.concatenate([[0], np.cumsum(lens)])
    key = (rng.standard_normal((sum(lens), hkv, d)) * rng.uniform(0.1, 6.0, (sum(lens), hkv, 1))).astype(np.float32)
    value = rng.standard_normal((sum(lens), hkv, d)).astype(np.float32)
    ramp = np.concatenate([np.linspace(0.2, 3.0, n) for n in lens]).astype(np.float32)  # later keys larger
    key *= ramp[:, None, None]
    cache = build_paged_cache(key, value, cuk, b, rng)
    query = (rng.standard_normal((sum(q_lens), hq, d)) * 12.0).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    want, step = _ref(query, cache, cu, pv_quant=pv_quant)
    for split in (0, 3):
        got, status = _run(query, cache, cu, pv_quant=pv_quant, num_splits=split)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        _check_close(got.cpu().numpy(), want, step, cache, pv_quant, "float32", f"splits={split}")


@pytest.mark.parametrize("pv_quant", ["s8", "u8"])
def test_prefill_code_factor_saturates_for_tiny_weights(rng, pv_quant):
    """The tiny-W group of test_code_factor_saturates_for_tiny_weights with 20 query rows (G 2:
    40 rows, the prefill kernel): the reference's exact group-0 sum."""
    from tests.ops.test_paged_attention_int8 import tiny_w_group_case
    ins, want = tiny_w_group_case(rng, q_rows=20)
    cache = {k: ins[k] for k in ("key_cache", "value_cache", "key_scale", "value_scale", "block_tables", "seq_lens")}
    for split in (0, 2):
        got, status = _run(ins["query"], cache, np.array([0, 20], np.int32), pv_quant=pv_quant, num_splits=split)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("b", [16, 64])
def test_prefill_bad_inputs_are_flagged(rng, b):
    """The prefill kernel flags an out-of-range block id the context needs (also one holding only
    the last key), a seq_len below the query count and a NaN query, as the general kernel does."""
    q_lens, hist = [40, 20], [3 * b, 2 * b - 20]
    lens = [q + h for q, h in zip(q_lens, hist)]
    query, cache, cu = _make_case(rng, lens, q_lens, 8, 2, 128, b, "float32", decode=False)
    last = (lens[0] - 1) // b
    for s, blk in ((0, 1), (0, last), (1, 0)):
        for bad_id in (10_000, -1):
            bad = dict(cache, block_tables=cache["block_tables"].copy())
            bad["block_tables"][s, blk] = bad_id
            for split in (0, 3):
                assert _run(query, bad, cu, num_splits=split)[1] & 1, (s, blk, bad_id, split)
    bad = dict(cache, seq_lens=np.array([lens[0], 10], np.int32))  # 10 < 20 queries
    assert _run(query, bad, cu)[1] & 2
    q = query.copy()
    q[45, 3, 7] = np.nan
    assert _run(q, cache, cu)[1] & 8


@pytest.mark.parametrize("kernel", ["prefill", "general"])
@pytest.mark.parametrize("pv_quant", ["s8", "none"])
@pytest.mark.parametrize("b", [16, 64])
def test_prefill_ignores_nan_scales_past_seq_len(monkeypatch, rng, b, pv_quant, kernel):
    """Cache slots past a sequence's length (in its last block) may hold anything: NaN key and
    value scales there must not reach the output (a kernel that copies whole blocks or chunks must
    zero those weights, not multiply a zero probability by NaN)."""
    if kernel == "general":
        monkeypatch.setenv("ORT_OPS_PA_PREFILL", "general")
    q_lens, hist = [50, 7], [3 * b + 5, 70]
    lens = [q + h for q, h in zip(q_lens, hist)]
    query, cache, cu = _make_case(rng, lens, q_lens, 8, 2, 128, b, "float32", decode=False)
    for s, n in enumerate(lens):
        last = cache["block_tables"][s, (n - 1) // b]
        for name in ("key_scale", "value_scale"):
            cache[name][last, :, (n - 1) % b + 1:] = np.nan
    want, step = _ref(query, cache, cu, pv_quant=pv_quant)
    finite = dict(cache, value_scale=np.nan_to_num(cache["value_scale"]))  # for the bound only
    for split in (0, 3):
        got, status = _run(query, cache, cu, pv_quant=pv_quant, num_splits=split)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        _check_close(got.cpu().numpy(), want, step, finite, pv_quant, "float32", f"{kernel} splits={split}")


# ---------------------------------------------------------------- many splits; the op's status word

@pytest.mark.parametrize("d", [128, 64, 32])
@pytest.mark.parametrize("pv_quant", ["s8", "none"])
def test_decode_many_splits(rng, pv_quant, d):
    """Decode with 32-key partitions split 64 and 66 ways (and 40 / 3 / auto): the merge kernel's
    batches of splits, split starts that are and are not 64-aligned (the shared 64-key stages and
    the per-warp ones), against the reference; the same launch three times over one workspace with
    the output poisoned in between, so that a merge reading a stale partial would show."""
    hq, hkv, b = 8, 2, 64
    for lens, splits in (([2048, 700, 33], (64, 40, 3, 0)), ([2100, 65, 1], (66, 64))):
        query, cache, _ = _make_case(rng, lens, [1] * len(lens), hq, hkv, d, b, "float16", decode=True)
        want, step = _ref(query, cache, None, pv_quant=pv_quant, partition_size=32)
        args = [_dev(query)] + [_dev(cache[k]) for k in ("key_cache", "value_cache", "key_scale", "value_scale",
                                                         "block_tables", "seq_lens")]
        for split in splits:
            pa = _cuda.PagedAttention(*args, pv_quant=pv_quant, partition_size=32, num_splits=split)
            pa.status_word.zero_()
            for rep in range(3):
                pa.out.fill_(float("nan"))
                pa()
                assert pa.status() == 0
                _check_close(pa.out.cpu().numpy(), want, step, cache, pv_quant, "float16",
                             f"lens {lens} splits {split} ({pa.nsplit}) launch {rep}")


def test_status_word_in_mapped_host_memory(rng):
    """The CUDA op keeps its status word in pinned host memory that the kernels write through the
    device mapping (no memset, no copy back; cuda_op.cc): bad block ids, seq_lens and a non-finite
    query set their bits there from many CTAs at once (splits 0 / 3 / 16), and a good launch
    leaves it 0."""
    query, cache, _ = _make_case(rng, [3000, 700], [1, 1], 8, 2, 128, 64, "float32", decode=True)
    args = [_dev(query)] + [_dev(cache[k]) for k in ("key_cache", "value_cache", "key_scale", "value_scale",
                                                     "block_tables", "seq_lens")]
    word = torch.zeros(1, dtype=torch.int32).pin_memory()  # mapped: unified addressing

    def status_of(a, split):
        pa = _cuda.PagedAttention(*a, num_splits=split)
        pa.status_word = word
        word.zero_()
        pa()
        torch.cuda.synchronize()
        return int(word.item())

    bad_bt = cache["block_tables"].copy()
    bad_bt[0, 3:40] = 10_000
    bad_bt[1, 5] = -1
    bad_sl = np.array([3000, cache["block_tables"].shape[1] * 64 + 1], np.int32)
    q_nan = query.copy()
    q_nan[1, 3, 7] = np.nan
    for split in (0, 3, 16):
        assert status_of(args, split) == 0
        a = list(args)
        a[5] = _dev(bad_bt)
        assert status_of(a, split) == 1
        a = list(args)
        a[6] = _dev(bad_sl)
        assert status_of(a, split) == 2
        a = list(args)
        a[0] = _dev(q_nan)
        assert status_of(a, split) == 8
        a[5] = _dev(bad_bt)
        assert status_of(a, split) == 9


# ---------------------------------------------------------------- window, softcap, head_sink (DESIGN.md)
# Every kernel: decode_warp_kernel (G <= 8, D 32 / 64 / 128), the general kernel (D 256, G 16; and
# prefill with ORT_OPS_PA_PREFILL=general), the prefill kernel; with and without key splits (the
# sink joins the final denominator, or the merge kernel's).

def _sinks(rng, hq, kind):
    if kind == "mixed":
        return (rng.standard_normal(hq) * 3.0).astype(np.float32)
    return np.full(hq, {"pos_large": 30.0, "neg_large": -30.0}[kind], np.float32)


def _run_extras(query, cache, cu, head_sink=None, **kw):
    return _run(query, cache, cu, head_sink=None if head_sink is None else _dev(head_sink), **kw)


WINDOW_DECODE_CASES = [
    # (seq lens, Hq, Hkv, D, B, window)
    ([1, 7, 129, 1025], 8, 2, 128, 16, 70),     # warp decode, B 16: half-stages before the window
    ([2049, 95, 160, 129], 8, 2, 128, 128, 300),  # warp decode, VROWS (64-key pair stages)
    ([500, 77, 1], 16, 2, 64, 64, 33),           # warp decode, D 64
    ([700, 5], 16, 2, 256, 16, 100),              # general kernel (D 256)
    ([96, 2000], 32, 1, 128, 64, 1000),           # general kernel (G 32)
    ([1300, 31], 8, 1, 128, 256, 5000),           # window longer than every context
    ([1, 7, 129, 1025], 8, 2, 32, 16, 70),        # warp decode, D 32, B 16
    ([2049, 95, 160, 129], 8, 2, 32, 128, 300),   # warp decode, D 32, VROWS
    ([700, 5, 300], 32, 2, 32, 64, 100),          # general kernel, D 32 (G 16)
]


@pytest.mark.parametrize("pv_quant", ["s8", "u8", "none"])
@pytest.mark.parametrize("case", WINDOW_DECODE_CASES,
                         ids=lambda c: f"L{'-'.join(map(str, c[0]))}-h{c[1]}x{c[2]}-d{c[3]}-b{c[4]}-w{c[5]}")
def test_decode_window_softcap_sink(rng, case, pv_quant):
    lens, hq, hkv, d, b, window = case
    dtype = "float16" if rng.integers(2) else "float32"
    query, cache, _ = _make_case(rng, lens, [1] * len(lens), hq, hkv, d, b, dtype, decode=True)
    sink = _sinks(rng, hq, "mixed")
    for attrs in ({"window": window}, {"softcap": 3.0}, {"window": window, "softcap": 30.0}):
        for hs in (None, sink):
            want, step = _ref(query, cache, None, pv_quant=pv_quant, partition_size=96, head_sink=hs, **attrs)
            for split in (0, 1, 3):
                got, status = _run_extras(query, cache, None, hs, pv_quant=pv_quant, num_splits=split,
                                          partition_size=96, **attrs)
                assert status == 0, _cuda.PA_STATUS.get(status, status)
                _check_close(got.cpu().numpy(), want, step, cache, pv_quant, dtype,
                             f"{dtype} {attrs} sink={hs is not None} splits={split}")


@pytest.mark.parametrize("loop", ["wide", "dual", "single"])
@pytest.mark.parametrize("pv_quant", ["s8", "u8", "none"])
@pytest.mark.parametrize("b", [64, 128])
def test_head_dim_64_stage_loops(monkeypatch, rng, b, pv_quant, loop):
    """Head dim 64 with blocks >= 64 runs its 8-warp one-stage loop (the default, "wide");
    ORT_OPS_PA_DECODE=dual forces the 4-warp loop that runs two of a warp's 32-key stages an
    iteration, =single the 4-warp one-stage loop. Each against the reference with
    a window (its start mid-stage and mid-block), softcap and sinks, splits 0 / 1 / 3 / 7 at the
    default partition (64-aligned split starts: the shared stages), lengths whose last iteration
    has one stage, two, or only the partner's."""
    if loop != "wide":
        monkeypatch.setenv("ORT_OPS_PA_DECODE", loop)
    lens, hq, hkv, d = [3001, 97, 190, 1, 2176], 32, 8, 64
    dtype = "float16"
    query, cache, _ = _make_case(rng, lens, [1] * len(lens), hq, hkv, d, b, dtype, decode=True)
    sink = _sinks(rng, hq, "mixed")
    for attrs in ({}, {"window": 333}, {"softcap": 3.0}, {"window": 1500, "softcap": 30.0}):
        for hs in (None, sink):
            want, step = _ref(query, cache, None, pv_quant=pv_quant, head_sink=hs, **attrs)
            for split in (0, 1, 3, 7):
                got, status = _run_extras(query, cache, None, hs, pv_quant=pv_quant, num_splits=split, **attrs)
                assert status == 0, _cuda.PA_STATUS.get(status, status)
                _check_close(got.cpu().numpy(), want, step, cache, pv_quant, dtype,
                             f"{loop} {attrs} sink={hs is not None} splits={split}")


@pytest.mark.parametrize("kind", ["pos_large", "neg_large", "mixed"])
@pytest.mark.parametrize("d,b", [(128, 64), (256, 16), (32, 64), (64, 64)])
def test_decode_sink_with_and_without_splits(rng, kind, d, b):
    """Sinks far above the scores (+30: outputs shrink by ~e^-30; the bound is relative to the
    reference's own output) and far below (-30: no effect), merged by the split merge or not."""
    query, cache, _ = _make_case(rng, [2048, 700, 33], [1, 1, 1], 8, 2, d, b, "float32", decode=True)
    sink = _sinks(rng, 8, kind)
    want, step = _ref(query, cache, None, head_sink=sink, partition_size=32)
    for split in (1, 3, 40, 0):
        got, status = _run_extras(query, cache, None, sink, partition_size=32, num_splits=split)
        assert status == 0, _cuda.PA_STATUS.get(status, status)
        _check_close(got.cpu().numpy(), want, step, cache, "s8", "float32", f"sink {kind} splits={split}")


def _poison_before_window(cache, lens, q_lens, window, how):
    """Blocks wholly before each sequence's first query's window: their block-table entries -1
    and INT32_MAX in turn ("table": a kernel that reads one flags kPaBlockOutOfRange), or NaN
    scales and -128 codes in those blocks ("cache")."""
    out = {k: v.copy() for k, v in cache.items()}
    b = cache["key_cache"].shape[2]
    n = 0
    for s, (length, nq) in enumerate(zip(lens, q_lens)):
        first = max(0, length - nq - window + 1)
        for j in range(first // b):
            if how == "table":
                out["block_tables"][s, j] = -1 if j % 2 else np.iinfo(np.int32).max
            else:
                blk = cache["block_tables"][s, j]
                for name in ("key_scale", "value_scale"):
                    out[name][blk] = np.nan
                for name in ("key_cache", "value_cache"):
                    out[name][blk] = -128
            n += 1
    assert n > 0
    return out


@pytest.mark.parametrize("how", ["table", "cache"])
@pytest.mark.parametrize("kernel", ["prefill", "general"])
@pytest.mark.parametrize("d,b", [(128, 16), (128, 64), (64, 32), (256, 16), (32, 16)])
def test_window_reads_nothing_before_it(monkeypatch, rng, d, b, kernel, how):
    """DESIGN.md: block-table entries of blocks wholly before the window, and those blocks, are
    never read (decode: not even launched). Poisoned, nothing is flagged and the output equals
    the reference on the clean cache, in decode (every kernel the shape reaches, with and without
    splits) and prefill (the prefill kernel where it applies, and the general one)."""
    if kernel == "general":
        monkeypatch.setenv("ORT_OPS_PA_PREFILL", "general")
    hq, hkv = 8, 2
    for q_lens, window in (([1, 1, 1], 70), ([40, 1, 70], 45)):
        lens = [150 + q_lens[0], 300, 700 + q_lens[2]]
        decode = q_lens == [1, 1, 1]
        query, cache, cu = _make_case(rng, lens, q_lens, hq, hkv, d, b, "float32", decode=decode)
        bad = _poison_before_window(cache, lens, q_lens, window, how)
        want, step = _ref(query, cache, cu, window=window, partition_size=32)
        for split in (0, 3):
            got, status = _run(query, bad, cu, window=window, partition_size=32, num_splits=split)
            assert status == 0, _cuda.PA_STATUS.get(status, status)
            _check_close(got.cpu().numpy(), want, step, cache, "s8", "float32",
                         f"{kernel} {how} decode={decode} splits={split}")


@pytest.mark.parametrize("kernel", ["prefill", "general"])
@pytest.mark.parametrize("pv_quant", ["s8", "u8", "none"])
@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: f"q{'-'.join(map(str, c[0]))}-h{c[2]}x{c[3]}-d{c[4]}-b{c[5]}")
def test_prefill_window_softcap_sink(monkeypatch, rng, case, pv_quant, kernel):
    q_lens, hist, hq, hkv, d, b = case
    if kernel == "general":
        monkeypatch.setenv("ORT_OPS_PA_PREFILL", "general")
    lens = [q + h for q, h in zip(q_lens, hist)]
    dtype = "float16" if rng.integers(2) else "float32"
    query, cache, cu = _make_case(rng, lens, q_lens, hq, hkv, d, b, dtype, decode=False)
    sink = _sinks(rng, hq, "mixed")
    for attrs in ({"window": 45}, {"window": 129, "softcap": 5.0}, {"softcap": 0.5}):
        want, step = _ref(query, cache, cu, pv_quant=pv_quant, head_sink=sink, **attrs)
        for split, part in ((0, 256), (3, 96)):
            got, status = _run_extras(query, cache, cu, sink, pv_quant=pv_quant, num_splits=split,
                                      partition_size=part, **attrs)
            assert status == 0, _cuda.PA_STATUS.get(status, status)
            _check_close(got.cpu().numpy(), want, step, cache, pv_quant, dtype,
                         f"{kernel} {dtype} {attrs} splits={split} P={part}")


PREFILL_D32_CASES = [
    # (q lens, history lens, Hq, Hkv, D, B) for D 32, which the prefill kernel does not take: the
    # general kernel with 4 warps, 16-row tiles (G 4: 4 queries x 4 heads; G 16: one query) and
    # the 8-row instance (G 1 with 5 query rows in all).
    ([70, 1, 33, 130], [300, 1000, 0, 61], 8, 2, 32, 64),
    ([129, 1, 40], [95, 700, 257], 32, 2, 32, 16),
    ([3, 2], [500, 40], 2, 2, 32, 32),
]


@pytest.mark.parametrize("pv_quant", ["s8", "u8", "none"])
@pytest.mark.parametrize("case", PREFILL_D32_CASES,
                         ids=lambda c: f"q{'-'.join(map(str, c[0]))}-h{c[2]}x{c[3]}-d{c[4]}-b{c[5]}")
def test_head_dim_32_prefill(rng, case, pv_quant):
    """D 32 prefill on the general kernel against the reference: plain, and with window, softcap
    and head_sink; with and without key splits (split starts off 64 with partition 96)."""
    q_lens, hist, hq, hkv, d, b = case
    lens = [q + h for q, h in zip(q_lens, hist)]
    dtype = "float16" if rng.integers(2) else "float32"
    query, cache, cu = _make_case(rng, lens, q_lens, hq, hkv, d, b, dtype, decode=False)
    sink = _sinks(rng, hq, "mixed")
    for attrs, hs in (({}, None), ({"window": 45}, sink), ({"window": 129, "softcap": 5.0}, sink),
                      ({"softcap": 0.5}, None)):
        want, step = _ref(query, cache, cu, pv_quant=pv_quant, head_sink=hs, **attrs)
        for split, part in ((0, 256), (2, 256), (3, 96)):
            got, status = _run_extras(query, cache, cu, hs, pv_quant=pv_quant, num_splits=split,
                                      partition_size=part, **attrs)
            assert status == 0, _cuda.PA_STATUS.get(status, status)
            _check_close(got.cpu().numpy(), want, step, cache, pv_quant, dtype,
                         f"{dtype} {attrs} sink={hs is not None} splits={split} P={part}")


def test_cuda_ep_window_softcap_sink(cuda_ep, rng):
    """The attributes and the head_sink input reach the kernels through the CUDA EP (cuda_op.cc):
    decode and prefill sessions against the reference; a negative window fails the session."""
    from ort_ops.ops import paged_attention_int8 as pa_mod

    lens, hq, hkv, d, b = [300, 77, 1030], 8, 2, 128, 64
    attrs = {"window": 100, "softcap": 20.0, "pv_quant": "s8"}
    for q_lens in ([1, 1, 1], [40, 1, 70]):
        query, cache, cu = _make_case(rng, lens, q_lens, hq, hkv, d, b, "float16", decode=q_lens == [1, 1, 1])
        sink = _sinks(rng, hq, "mixed")
        feeds = {"query": query, **{k: cache[k] for k in ("key_cache", "value_cache", "key_scale", "value_scale",
                                                          "block_tables", "seq_lens")}, "head_sink": sink}
        if cu is not None:
            feeds["cu_seqlens_q"] = cu
        sess = cuda_ep(pa_mod.SCHEMA, feeds, **attrs)
        out = sess.run(None, feeds)[0]
        assert _providers_of(sess, "PagedAttentionInt8") == {"CUDAExecutionProvider"}
        want, step = _ref(query, cache, cu, head_sink=sink, **attrs)
        _check_close(out, want, step, cache, "s8", "float16", f"ORT CUDA EP q_lens={q_lens}")
    with pytest.raises(Exception, match=r"PagedAttentionInt8: attribute 'window' must be >= 0"):
        cuda_ep(pa_mod.SCHEMA, feeds, window=-3)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("d", [128, 256, 32])
def test_non_finite_sink_is_flagged(rng, d, split):
    """A NaN/Inf sink (checked on the host by the CPU op) is flagged by the kernel that adds it to
    the denominator: the write path with one split, the merge kernel with several."""
    query, cache, _ = _make_case(rng, [300, 40], [1, 1], 8, 2, d, 16, "float32", decode=True)
    for bad in (np.nan, np.inf):
        sink = np.zeros(8, np.float32)
        sink[5] = bad
        _, status = _run_extras(query, cache, None, sink, num_splits=split, partition_size=32)
        assert status & 32, _cuda.PA_STATUS.get(status, status)
