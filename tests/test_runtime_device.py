# SPDX-License-Identifier: MIT
"""The runtime's device plumbing (ort_ops/runtime.py, issue 18): the binding path the CUDA EP
uses (caches as ORT-allocated OrtValues bound in place once, one OrtValue per step table, only
the logits back) run on the CPU EP with device="cpu" OrtValues, against the numpy path; chunked
prefill scheduling; device / providers resolution and the one-line refusals where this
onnxruntime has no CUDA EP; progress on stderr.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import ort_ops
from ort_ops.runtime import PagedKVCache, PagedRunner, _schedule, generate, resolve_device
from tests.test_runtime import _paged_model
from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL

HAS_CUDA_EP = "CUDAExecutionProvider" in ort.get_available_providers()
no_cuda_ep = pytest.mark.skipif(HAS_CUDA_EP, reason="this onnxruntime has the CUDA EP: nothing to refuse")


def _steps(runner, prompts):
    """Prefill three sequences, decode, drop one, decode two, let a fourth join mid-batch: the
    number of sequences (the logits' shape) changes from step to step."""
    out = [runner.step({i: p for i, p in enumerate(prompts[:3])})]
    out.append(runner.step({0: [5], 1: [6], 2: [7]}))
    runner.release(1)
    out.append(runner.step({0: [8], 2: [9]}))
    out.append(runner.step({0: [10], 2: [11], 3: prompts[3]}))  # a prefill joins running decodes
    out.append(runner.step({0: [12], 2: [13], 3: [14]}))
    return out


def test_device_binding_path_equals_host_path(rng):
    """The same steps through the device path (cache_on_device, CPU OrtValues) and the numpy path
    give identical logits and identical caches: only where the buffers live differs."""
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 6)]
    host = PagedRunner(_paged_model(), num_blocks=16)
    dev = PagedRunner(_paged_model(), num_blocks=16, cache_on_device=True)
    assert host.cache.device is None and dev.cache.device == "cpu" and not dev.cache.buffers
    assert all(v.device_name() == "cpu" for layer in dev.cache.values for v in layer)
    ptrs = [v.data_ptr() for layer in dev.cache.values for v in layer]
    for a, b in zip(_steps(host, prompts), _steps(dev, prompts)):
        assert a.shape == b.shape and np.isfinite(b).all()
        np.testing.assert_array_equal(a, b)
    for layer in range(host.meta["num_layers"]):
        for x, y in zip(host.cache.layer_arrays(layer), dev.cache.layer_arrays(layer)):
            np.testing.assert_array_equal(x, y)
    # the caches were written where they were allocated (bound in place, never replaced)
    assert [v.data_ptr() for layer in dev.cache.values for v in layer] == ptrs
    assert dev.cache.nbytes == host.cache.nbytes


def test_decode_buckets_equal_the_device_path(rng):
    """cuda_graph=True on the CPU EP runs decode steps in the fixed-shape buckets that CUDA
    captures (tables padded to the bucket's rows and a power-of-two width, padding rows on
    scratch blocks): the logits and every live block of the caches equal the unpadded steps'."""
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 6)]
    plain = PagedRunner(_paged_model(), num_blocks=16, cache_on_device=True)
    bucketed = PagedRunner(_paged_model(), num_blocks=16, cache_on_device=True, cuda_graph=True,
                           graph_batch_sizes=(1, 2, 4, 8))
    assert bucketed.cuda_graph and not plain.cuda_graph
    out_plain, out_bucketed = _steps(plain, prompts), _steps(bucketed, prompts)
    out_plain.append(plain.step({0: [15], 2: [16], 3: [17], 9: [3]}))  # a one-token prompt with decodes
    out_bucketed.append(bucketed.step({0: [15], 2: [16], 3: [17], 9: [3]}))
    for a, b in zip(out_plain, out_bucketed):
        np.testing.assert_array_equal(a, b)
    # decode steps of 3, 2, 3 and 4 sequences: buckets of 4 and 2 rows
    assert bucketed.graph_steps == 4 and sorted(s for s, _ in bucketed._buckets) == [2, 4]
    # the scratch block (7 padding rows of block size 8: one) follows the 16 blocks asked for and
    # is never given to a sequence; the padding rows wrote there
    assert bucketed.cache.scratch == [16] and bucketed.cache.allocator.num_blocks == 16
    assert bucketed.cache.allocator.free_blocks == plain.cache.allocator.free_blocks
    assert all(16 not in t for t in bucketed.cache.allocator.tables.values())
    assert np.any(bucketed.cache.layer_arrays(0)[2][16] != 0)  # key scales of padding rows' slots
    live = sorted({b for t in plain.cache.allocator.tables.values() for b in t})
    assert live == sorted({b for t in bucketed.cache.allocator.tables.values() for b in t})
    for layer in range(plain.meta["num_layers"]):
        for x, y in zip(plain.cache.layer_arrays(layer), bucketed.cache.layer_arrays(layer)):
            np.testing.assert_array_equal(x[live], y[live])


def test_bucket_widths_bound_the_idle_grid():
    """Decode buckets' block-table widths: at least the step's, powers of two up to 1024 tokens,
    then multiples of 1024 tokens (the attention grid covers width x block size tokens)."""
    from ort_ops.runtime import _bucket_width

    for bs in (16, 32, 64, 128):
        prev = 0
        for width in range(1, 400):
            got, tokens = _bucket_width(width, bs), width * bs
            assert got >= width and got >= prev  # covers the table; never narrower for a longer one
            if tokens <= 1024:
                assert got * bs == 1 << (tokens - 1).bit_length() or (got == width and bs > 1024)
            else:
                assert got * bs - tokens < 1024 + bs and (got * bs) % 1024 == 0, (bs, width, got)
            prev = got
    assert _bucket_width(65, 64) == 80  # 4160 tokens -> 5120, not 8192


def test_a_given_cache_without_scratch_blocks_runs_without_buckets(rng):
    """A cache sized by its owner keeps every block: without scratch blocks the runner does not
    take any for padding rows (decode steps then run as ordinary Runs, graph_note says why); with
    them it uses those and nothing else."""
    model = _paged_model()
    meta = ort_ops.runtime.paged_metadata(model)
    exact = PagedKVCache(meta["num_layers"], meta["layer_dims"], meta["block_size"], 4, device="cpu")
    runner = PagedRunner(model, exact, cuda_graph=True, graph_batch_sizes=(1, 2, 4))
    assert not runner.cuda_graph and "scratch block" in runner.graph_note
    runner.step({"a": list(rng.integers(3, 64, 15)), "b": list(rng.integers(3, 64, 15))})
    runner.step({"a": [3], "b": [4]})  # all 4 blocks in use: the exact size still fits
    assert exact.allocator.free_blocks == 0 and runner.graph_steps == 0
    with_scratch = PagedKVCache(meta["num_layers"], meta["layer_dims"], meta["block_size"], 4, device="cpu",
                                scratch_blocks=1)
    runner = PagedRunner(model, with_scratch, cuda_graph=True, graph_batch_sizes=(1, 2, 4))
    assert runner.cuda_graph
    runner.step({"a": list(rng.integers(3, 64, 15)), "b": list(rng.integers(3, 64, 15))})
    runner.step({"a": [3], "b": [4]})
    assert with_scratch.allocator.free_blocks == 0 and runner.graph_steps == 1
    for_cuda = PagedKVCache.for_model(model, 4, device="cpu", scratch_blocks=None)
    assert for_cuda.scratch == []  # scratch by default on "cuda" only
    with pytest.raises(ValueError, match="scratch_blocks must be >= 0"):
        PagedKVCache(meta["num_layers"], meta["layer_dims"], meta["block_size"], 4, scratch_blocks=-1)


def test_decode_buckets_need_a_device_cache():
    with pytest.raises(ValueError, match="cuda_graph runs on a cache that lives on the device"):
        PagedRunner(_paged_model(), num_blocks=8, cuda_graph=True)
    with pytest.raises(ValueError, match="graph_batch_sizes must be positive"):
        PagedRunner(_paged_model(), num_blocks=8, cache_on_device=True, cuda_graph=True, graph_batch_sizes=(0, 4))


def test_device_path_writes_only_new_slots(rng):
    runner = PagedRunner(_paged_model(), num_blocks=8, cache_on_device=True)
    runner.step({"a": list(rng.integers(3, 64, 11))})
    before = [a.copy() for a in runner.cache.layer_arrays(0)]
    runner.step({"a": [4]})
    after = runner.cache.layer_arrays(0)
    bs = runner.cache.block_size
    slot = int(runner.cache.allocator.slots("a", 11, 1)[0])
    changed = np.argwhere(np.any(before[0] != after[0], axis=(1, 3)))  # (block, offset) of key rows
    assert {(int(b), int(o)) for b, o in changed} == {(slot // bs, slot % bs)}
    changed_scales = np.argwhere(before[2] != after[2])  # (block, kv head, offset)
    assert {int(b) * bs + int(o) for b, _, o in changed_scales} == {slot}


def test_generate_on_device_path_equals_host_path(rng):
    prompts = [list(rng.integers(3, 64, n)) for n in (4, 9, 15, 2)]
    ref = generate(_paged_model(), prompts, max_new_tokens=8, return_logits=True)
    eos = ref[1].tokens[3]
    ref = generate(_paged_model(), prompts, max_new_tokens=8, return_logits=True, eos_token_id=eos)
    out = generate(_paged_model(), prompts, max_new_tokens=8, return_logits=True, eos_token_id=eos,
                   device="cpu", cache_on_device=True)
    assert any(r.stopped_by_eos for r in ref)
    for r0, r in zip(ref, out):
        assert r.tokens == r0.tokens and r.stopped_by_eos == r0.stopped_by_eos
        np.testing.assert_array_equal(r.logits, r0.logits)


@pytest.mark.parametrize("cache_on_device", [False, True], ids=["numpy", "ortvalue"])
def test_chunked_prefill_generate_equals_one_step_prefill(rng, cache_on_device):
    """Prompts longer than max_step_tokens prefill in chunks while shorter ones already decode;
    every sequence still gets the tokens and (to the paged kernels' rounding) the logits of a
    one-step prefill."""
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 29, 12)]
    ref = generate(_paged_model(), prompts, max_new_tokens=6, return_logits=True)
    out = generate(_paged_model(), prompts, max_new_tokens=6, return_logits=True, max_step_tokens=7,
                   cache_on_device=cache_on_device)
    for r0, r in zip(ref, out):
        assert r.tokens == r0.tokens
        np.testing.assert_allclose(r.logits, r0.logits, atol=ATTN_REWRITE_EMULATED_LOGITS_ATOL)
    with pytest.raises(ValueError, match="max_step_tokens must be >= 1"):
        generate(_paged_model(), prompts, max_step_tokens=0)


def test_schedule_decodes_first_then_prompt_chunks():
    pending = {"a": (0, [1, 2, 3, 4, 5]), "b": (1, [9]), "c": (2, [6, 7, 8]), "d": (3, [4])}
    assert _schedule(pending, None) == {"a": [1, 2, 3, 4, 5], "b": [9], "c": [6, 7, 8], "d": [4]}
    assert _schedule(pending, 5) == {"b": [9], "d": [4], "a": [1, 2, 3]}
    assert _schedule(pending, 9) == {"b": [9], "d": [4], "a": [1, 2, 3, 4, 5], "c": [6, 7]}
    assert _schedule(pending, 1) == {"b": [9]}


def test_device_errors_are_checked_after_each_cuda_run(rng, monkeypatch):
    """On "cuda" a step calls ort_ops.check_device_errors() after the Run (where the library
    offers it) and lets its error through; the CPU paths never call it."""
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("PagedAttentionInt8: input 'block_tables' holds block 99, expected < 16")

    monkeypatch.setattr(ort_ops, "check_device_errors", check, raising=False)
    runner = PagedRunner(_paged_model(), num_blocks=16, cache_on_device=True)
    runner.step({"a": [3, 4, 5]})
    assert calls == []
    runner.device = "cuda"  # the CUDA path's bindings on CPU OrtValues
    runner.step({"a": [6]})
    with pytest.raises(ValueError, match="input 'block_tables'"):
        runner.step({"a": [7]})
    monkeypatch.delattr(ort_ops, "check_device_errors")
    runner.step({"b": [8]})  # a library without the hook: nothing to check


def test_resolve_device_and_providers():
    assert resolve_device() == ("cpu", ["CPUExecutionProvider"])
    assert resolve_device("cpu") == ("cpu", ["CPUExecutionProvider"])
    assert resolve_device(None, ["CPUExecutionProvider"]) == ("cpu", ["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, got 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="contradicts providers"):
        resolve_device("cuda", ["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="at least one execution provider"):
        resolve_device(None, [])


@no_cuda_ep
def test_cuda_refused_without_the_cuda_ep():
    """Without onnxruntime-gpu, "cuda" is a one-line error naming the missing provider, from
    every entry point, before any session or cache is made."""
    for call in (lambda: resolve_device("cuda"),
                 lambda: resolve_device(None, [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]),
                 lambda: PagedRunner(_paged_model(), device="cuda"),
                 lambda: PagedKVCache.for_model(_paged_model(), num_blocks=4, device="cuda"),
                 lambda: generate(_paged_model(), [[3, 4]], device="cuda")):
        with pytest.raises(ValueError, match="needs onnxruntime with the CUDAExecutionProvider") as e:
            call()
        assert "\n" not in str(e.value) and ort.__version__ in str(e.value)


def test_cache_placement_mismatch_is_refused():
    numpy_cache = PagedKVCache.for_model(_paged_model(), num_blocks=4)
    with pytest.raises(ValueError, match="the cache lives on the host"):
        PagedRunner(_paged_model(), numpy_cache, cache_on_device=True)
    device_cache = PagedKVCache.for_model(_paged_model(), num_blocks=4, device="cpu")
    with pytest.raises(ValueError, match="the cache lives on cpu but this runner needs it on the host"):
        PagedRunner(_paged_model(), device_cache, cache_on_device=False)
    with pytest.raises(ValueError, match="cache device must be one of cpu, cuda"):
        PagedKVCache.for_model(_paged_model(), num_blocks=4, device="gpu")


def test_progress_on_stderr(rng, capsys):
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 5)]
    generate(_paged_model(), prompts, max_new_tokens=4, progress=True, cache_on_device=True)
    err = capsys.readouterr().err
    assert "generate [" in err and err.rstrip().endswith("8/8")  # 2 sequences x 4 tokens


def test_step_tables_equal_a_per_sequence_construction(rng):
    """The step tables, computed for all tokens at once, equal the tables built one sequence at
    a time from the allocator (slots, positions, padded block tables, lengths, cu_seqlens_q)."""
    runner = PagedRunner(_paged_model(), num_blocks=64)
    runner.step({"a": list(rng.integers(3, 64, 19)), "b": [4, 5]})
    batch = {"a": [7], "c": np.asarray(rng.integers(3, 64, 12)), "b": [8, 9, 10]}
    before = dict(runner.cache.allocator.lengths)
    named, lens, cu = runner._tables(batch)
    alloc = runner.cache.allocator
    starts = [before.get(s, 0) for s in batch]
    want_slots = np.concatenate([alloc.slots(s, st, len(t)) for (s, t), st in zip(batch.items(), starts)])
    want_pos = np.concatenate([np.arange(st, st + len(t)) for t, st in zip(batch.values(), starts)])
    width = max(len(alloc.tables[s]) for s in batch)
    want_bt = np.array([alloc.tables[s] + [0] * (width - len(alloc.tables[s])) for s in batch], np.int32)
    np.testing.assert_array_equal(named["slot_mapping"], want_slots)
    np.testing.assert_array_equal(named["position_ids"], want_pos[None, :])
    np.testing.assert_array_equal(named["input_ids"], np.concatenate([np.asarray(t) for t in batch.values()])[None, :])
    np.testing.assert_array_equal(named["block_tables"], want_bt)
    assert lens == [20, 12, 5] and cu == [0, 1, 13, 16]
    np.testing.assert_array_equal(named["seq_lens"], lens)
    assert named["slot_mapping"].dtype == np.int64 and named["block_tables"].dtype == np.int32
    assert named["seq_lens"].dtype == named["cu_seqlens_q"].dtype == np.int32


def test_dense_past_on_device_equals_numpy_past(rng):
    """An original export with past/present, its presents bound where the session runs and fed
    back as OrtValues (the CUDA path, here on CPU OrtValues), decodes exactly as with numpy
    past and present through session.run."""
    import pathlib

    fixture = pathlib.Path(__file__).resolve().parent / "fixtures" / "attention" / "tx_sdpa_kv.onnx"
    prompts = [list(rng.integers(3, 128, n)) for n in (4, 9)]
    ref = generate(str(fixture), prompts, max_new_tokens=6, return_logits=True)
    out = generate(str(fixture), prompts, max_new_tokens=6, return_logits=True, cache_on_device=True)
    for r0, r in zip(ref, out):
        assert r.tokens == r0.tokens
        np.testing.assert_array_equal(r.logits, r0.logits)
