# SPDX-License-Identifier: MIT
"""Long runs and concurrency on the CPU EP.

- ``PagedRunner`` over many steps (1,000 here; 10,000 with ``--long-runs``) with sequences
  joining, leaving, decoding and prefilling in chunks at random, and now and then a step too big
  for the free blocks: the allocator's invariants hold after every step (every block owned by one
  sequence or free, tables exactly as long as the lengths need), a refused step changes nothing,
  no block is left when all sequences are gone, and every sequence's logits equal those of the
  same schedule run alone.
- Eight threads, each with its own sessions of all seven ops on the one loaded library, running
  at once: every output equal, byte for byte, to the single-threaded run.
- Two sessions updating disjoint sequences of one shared cache (the same numpy buffers bound in
  place in both) and attending over them, concurrently: the cache ends exactly as the reference
  leaves it, and each attention output equals the reference's.
"""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest

from ort_ops import reference
from ort_ops.ops import (dynamic_quant, grouped_matmul_dequant, grouped_matmul_swiglu_quant, moe_finalize_routing,
                         moe_init_routing, paged_attention_int8, quantize_kv_cache)
from ort_ops.ops._run import make_session
from ort_ops.ops.paged_attention_int8 import build_paged_cache
from ort_ops.runtime import PagedRunner
from tests.property import _harness as h
from tests.ops.test_paged_attention_int8 import _assert_matches
from tests.test_runtime import BLOCK, _paged_model
from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL

# --- the paged runtime over many steps ----------------------------------------------------------


def check_allocator(alloc) -> None:
    """Every block is free or owned by exactly one sequence; a table holds exactly the blocks its
    cached length needs; the free list has no duplicates."""
    owned = [b for t in alloc.tables.values() for b in t]
    free = list(alloc._free)
    assert len(set(owned)) == len(owned), "a block is owned twice"
    assert len(set(free)) == len(free), "a block is free twice"
    assert not set(owned) & set(free), "a block is both owned and free"
    assert sorted(owned + free) == list(range(alloc.num_blocks)), "a block is lost"
    assert set(alloc.tables) == set(alloc.lengths)
    for sid, table in alloc.tables.items():
        assert len(table) == -(-alloc.lengths[sid] // alloc.block_size), f"sequence {sid}: table vs length"


def _snapshot(alloc):
    return ({k: list(v) for k, v in alloc.tables.items()}, dict(alloc.lengths), list(alloc._free))


def test_paged_runner_long_random_schedule(request):
    steps = 10_000 if request.config.getoption("--long-runs") else 1_000
    rng = np.random.default_rng(2020)
    num_blocks = 20  # 160 tokens: six sequences of up to 40-token prompts outgrow it now and then
    runner = PagedRunner(_paged_model(), num_blocks=num_blocks)
    alloc = runner.cache.allocator
    pending: dict = {}   # seq id -> prompt tokens not yet prefilled
    history: dict = {}   # seq id -> [(chunk tokens, logits of its last token)]
    done: list = []
    next_id = 0
    refused = 0
    for _ in range(steps):
        # Sequences leave at random; new ones join with a prompt of 1..40 tokens.
        for sid in [s for s in history if s not in pending and rng.random() < 0.08]:
            runner.release(sid)
            done.append(history.pop(sid))
        if len(history) < 6 and rng.random() < 0.5:
            pending[next_id] = list(rng.integers(3, 64, int(rng.integers(1, 41))))
            history[next_id] = []
            next_id += 1
        if not history:
            continue
        batch = {}
        for sid in history:
            if sid in pending:  # chunked prefill: the next 1..16 prompt tokens
                n = int(rng.integers(1, 17))
                batch[sid] = pending[sid][:n]
            elif rng.random() < 0.9:  # decode one token (sequences may also sit a step out)
                batch[sid] = [int(rng.integers(3, 64))]
        if not batch:
            continue
        need = sum(-(-(alloc.lengths.get(s, 0) + len(t)) // BLOCK) - len(alloc.tables.get(s, [])) for s, t in batch.items())
        if need > alloc.free_blocks:
            # Too big for the free blocks: refused as a whole, nothing reserved, nothing written.
            before = _snapshot(alloc)
            cache_before = [a.copy() for a in runner.cache.buffers[0]]
            with pytest.raises(RuntimeError, match="KV cache full"):
                runner.step(batch)
            assert _snapshot(alloc) == before
            assert all(np.array_equal(a, b) for a, b in zip(cache_before, runner.cache.buffers[0]))
            refused += 1
            # Make room: the longest running sequence leaves.
            victim = max((s for s in history if s not in pending), key=lambda s: alloc.lengths.get(s, 0), default=None)
            if victim is None:
                victim = next(iter(history))
                pending.pop(victim)
            runner.release(victim)
            done.append(history.pop(victim))
            check_allocator(alloc)
            continue
        logits = runner.step(batch)
        for row, (sid, toks) in enumerate(batch.items()):
            history[sid].append((toks, logits[row]))
            if sid in pending:
                pending[sid] = pending[sid][len(toks):]
                if not pending[sid]:
                    del pending[sid]
        check_allocator(alloc)
    for sid in list(history):
        runner.release(sid)
        done.append(history.pop(sid))
    check_allocator(alloc)
    assert alloc.free_blocks == num_blocks and not alloc.tables, "blocks leaked"
    print(f"paged runner: {steps} steps, {len(done)} sequences, {refused} refused steps, 0 blocks leaked")
    assert refused > 0 and len(done) > steps // 40  # the schedule did exercise joins, leaves and refusals
    # Each sequence alone, through the same chunks: the same logits at every step.
    alone = PagedRunner(_paged_model(), num_blocks=num_blocks)
    checked = 0
    for seq in done:
        for toks, want in seq:
            got = alone.step({"s": toks})[0]
            np.testing.assert_allclose(got, want, atol=ATTN_REWRITE_EMULATED_LOGITS_ATOL, rtol=0)
            checked += 1
        alone.release("s")
        check_allocator(alone.cache.allocator)
    assert alone.cache.allocator.free_blocks == num_blocks and checked > 0
    print(f"paged runner: {checked} steps of {len(done)} sequences replayed alone, equal")


# --- eight threads, all ops ----------------------------------------------------------------------


def _all_op_cases(rng):
    """One input set per op: (schema, inputs, attrs, outputs bound in place onto inputs), and
    max |V| of the attention case (the scale of its outputs)."""
    t, hkv, d, n, b = 6, 2, 64, 8, 16
    kv = {"key_cache": rng.integers(-127, 128, (n, hkv, b, d), dtype=np.int8),
          "value_cache": rng.integers(-127, 128, (n, hkv, d, b), dtype=np.int8),
          "key_scale": rng.uniform(0.1, 1, (n, hkv, b)).astype(np.float32),
          "value_scale": rng.uniform(0.1, 1, (n, hkv, b)).astype(np.float32)}
    qkv = {"key": rng.standard_normal((t, hkv, d)).astype(np.float32),
           "value": rng.standard_normal((t, hkv, d)).astype(np.float32),
           "slot_mapping": rng.choice(n * b, t, replace=False).astype(np.int64), **kv}
    lens = np.array([40, 97, 3])
    cuk = np.concatenate([[0], np.cumsum(lens)])
    v = rng.standard_normal((cuk[-1], hkv, d)).astype(np.float32)
    cache = build_paged_cache(rng.standard_normal((cuk[-1], hkv, d)).astype(np.float32), v, cuk, b, rng)
    pa = {"query": rng.standard_normal((7, 8, d)).astype(np.float32), **{k: cache[k] for k in (
        "key_cache", "value_cache", "key_scale", "value_scale", "block_tables", "seq_lens")},
        "cu_seqlens_q": np.array([0, 3, 6, 7], np.int32)}
    m, k, e, nn, topk, h = 24, 64, 4, 32, 2, 48
    gl = np.array([5, 5, 17, 24], np.int64)
    gemm = {"x": rng.integers(-127, 128, (m, k), dtype=np.int8), "weight": rng.integers(-127, 128, (e, k, nn), dtype=np.int8),
            "weight_scale": rng.uniform(0, 0.01, (e, nn)).astype(np.float32),
            "x_scale": rng.uniform(0, 0.01, m).astype(np.float32), "group_list": gl}
    return float(np.abs(v).max()), [
        (dynamic_quant.SCHEMA, {"x": rng.standard_normal((5, 3, 70)).astype(np.float32)}, {}, {}),
        (quantize_kv_cache.SCHEMA, qkv, {}, {c + "_out": c for c in kv}),
        (paged_attention_int8.SCHEMA, pa, {"pv_quant": "u8"}, {}),
        (grouped_matmul_swiglu_quant.SCHEMA, gemm, {}, {}),
        (grouped_matmul_dequant.SCHEMA, dict(gemm, weight=gemm["weight"][:, :, :16].copy(),
                                             weight_scale=gemm["weight_scale"][:, :16].copy()), {}, {}),
        (moe_init_routing.SCHEMA, {"x": rng.standard_normal((m, h)).astype(np.float32),
                                   "expert_ids": rng.integers(0, e, (m, topk)).astype(np.int32)}, {"num_experts": e}, {}),
        (moe_finalize_routing.SCHEMA, {"expert_out": rng.standard_normal((m * topk, h)).astype(np.float32),
                                       "sorted_to_flat": rng.permutation(m * topk).astype(np.int32),
                                       "topk_weights": rng.uniform(0, 1, (m, topk)).astype(np.float32),
                                       "residual": rng.standard_normal((m, h)).astype(np.float32)}, {}, {}),
    ]


def _run_bound(sess, schema, inputs, in_place):
    """One Run through IOBinding on ``sess``, in-place outputs on the inputs' own buffers (the
    property tests' harness); outputs as bytes."""
    return [a.tobytes() for a in h.run(schema, inputs, in_place=in_place, sess=sess)]


def test_eight_threads_all_ops_equal_single_threaded():
    rng = np.random.default_rng(88)
    pa_vmax, cases = _all_op_cases(rng)

    def fresh(inputs):  # each Run starts from the same bytes (QuantizeKVCache writes its caches)
        return {k: v.copy() for k, v in inputs.items()}

    expected = []
    for schema, inputs, attrs, in_place in cases:
        sess = make_session(schema, inputs, intra_op_threads=1, **attrs)
        expected.append(_run_bound(sess, schema, fresh(inputs), in_place))
    # The single-threaded results are the references' (bit-exact ops) or within the PA bound.
    for (schema, inputs, attrs, _), outs in zip(cases, expected):
        if schema.name == "PagedAttentionInt8":
            got = np.frombuffer(outs[0], np.float32).reshape(inputs["query"].shape)
            _assert_matches(got, inputs, pa_vmax, **attrs)
            continue
        want = getattr(reference, {"DynamicQuant": "dynamic_quant", "QuantizeKVCache": "quantize_kv_cache",
                                   "GroupedMatmulSwigluQuant": "grouped_matmul_swiglu_quant",
                                   "GroupedMatmulDequant": "grouped_matmul_dequant", "MoeInitRouting": "moe_init_routing",
                                   "MoeFinalizeRouting": "moe_finalize_routing"}[schema.name])(**inputs, **attrs)
        want = want if isinstance(want, tuple) else (want,)
        assert [np.ascontiguousarray(w).tobytes() for w in want] == outs, schema.name

    threads, rounds = 8, 12
    barrier = threading.Barrier(threads)
    errors: list = []

    def worker(seed):
        try:
            sessions = [make_session(schema, inputs, intra_op_threads=2, **attrs) for schema, inputs, attrs, _ in cases]
            order = np.random.default_rng(seed)
            barrier.wait()
            for _ in range(rounds):
                for i in order.permutation(len(cases)):
                    schema, inputs, _, in_place = cases[i]
                    got = _run_bound(sessions[i], schema, fresh(inputs), in_place)
                    if got != expected[i]:
                        errors.append(f"thread {seed}: {schema.name} differs from the single-threaded run")
        except Exception as e:  # noqa: BLE001 - reported below with the thread's id
            errors.append(f"thread {seed}: {type(e).__name__}: {e}")

    pool = [threading.Thread(target=worker, args=(s,)) for s in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors, errors[:5]


# --- two sessions, one shared cache ----------------------------------------------------------------


def test_two_sessions_update_disjoint_sequences_of_one_cache():
    """Two threads, each with its own QuantizeKVCache and PagedAttentionInt8 sessions, grow one
    sequence each in the same cache buffers (bound in place in both sessions) for several steps,
    attending after every write. The cache ends as the reference leaves it after all writes, and
    every attention output equals the reference over the cache as it was at that step."""
    rng = np.random.default_rng(2)
    hkv, hq, d, b, n = 2, 4, 64, 8, 16
    cache = {"key_cache": np.zeros((n, hkv, b, d), np.int8), "value_cache": np.zeros((n, hkv, d, b), np.int8),
             "key_scale": np.zeros((n, hkv, b), np.float32), "value_scale": np.zeros((n, hkv, b), np.float32)}
    blocks = {0: list(range(0, n, 2)), 1: list(range(1, n, 2))}  # disjoint: even and odd blocks
    chunks = {s: [int(c) for c in rng.integers(1, 9, 6)] for s in (0, 1)}
    kv = {s: [(rng.standard_normal((c, hkv, d)).astype(np.float32), rng.standard_normal((c, hkv, d)).astype(np.float32))
              for c in chunks[s]] for s in (0, 1)}
    queries = {s: [rng.standard_normal((c, hq, d)).astype(np.float32) for c in chunks[s]] for s in (0, 1)}
    outputs: dict = {0: [], 1: []}
    errors: list = []
    barrier = threading.Barrier(2)
    shapes = dict(cache)

    def slots_of(s, start, count):
        pos = np.arange(start, start + count)
        return np.asarray(blocks[s], np.int64)[pos // b] * b + pos % b

    def worker(s):
        try:
            q0, k0 = queries[s][0], kv[s][0][0]
            wsess = make_session(quantize_kv_cache.SCHEMA, {"key": k0, "value": k0, "slot_mapping": np.zeros(len(k0), np.int64),
                                                            **shapes}, dynamic_shapes=True, intra_op_threads=1)
            table = np.asarray([blocks[s]], np.int32)
            asess = make_session(paged_attention_int8.SCHEMA, {"query": q0, **shapes, "block_tables": table,
                                                               "seq_lens": np.ones(1, np.int32),
                                                               "cu_seqlens_q": np.zeros(2, np.int32)},
                                 dynamic_shapes=True, intra_op_threads=1)
            values = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in cache.items()}  # the shared buffers
            barrier.wait()
            length = 0
            for step, c in enumerate(chunks[s]):
                io = wsess.io_binding()
                io.bind_cpu_input("key", kv[s][step][0])
                io.bind_cpu_input("value", kv[s][step][1])
                io.bind_cpu_input("slot_mapping", slots_of(s, length, c))
                for name, v in values.items():
                    io.bind_ortvalue_input(name, v)
                    io.bind_ortvalue_output(name + "_out", v)
                wsess.run_with_iobinding(io)
                length += c
                feeds = {"query": queries[s][step], **cache, "block_tables": table,
                         "seq_lens": np.array([length], np.int32), "cu_seqlens_q": np.array([0, c], np.int32)}
                outputs[s].append((asess.run(None, feeds)[0], length))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"sequence {s}: {type(e).__name__}: {e}")

    pool = [threading.Thread(target=worker, args=(s,)) for s in (0, 1)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert not errors, errors
    # The reference: all writes of both sequences applied to an empty cache.
    want = {k: np.zeros_like(v) for k, v in cache.items()}
    for s in (0, 1):
        length = 0
        for step, c in enumerate(chunks[s]):
            want = dict(zip(want, reference.quantize_kv_cache(*kv[s][step], slots_of(s, length, c), *want.values())))
            length += c
    for name in cache:
        assert cache[name].tobytes() == want[name].tobytes(), name
    # Each sequence's attention at every step saw exactly its own tokens so far (the other
    # sequence's blocks are never read; its own later slots were not yet written).
    for s in (0, 1):
        for step, (out, length) in enumerate(outputs[s]):
            c = chunks[s][step]
            ins = {"query": queries[s][step], **want, "block_tables": np.asarray([blocks[s]], np.int32),
                   "seq_lens": np.array([length], np.int32), "cu_seqlens_q": np.array([0, c], np.int32)}
            vmax = max(float(np.abs(v).max()) for _, v in kv[s][: step + 1])
            _assert_matches(out, ins, vmax)
