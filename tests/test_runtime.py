# SPDX-License-Identifier: MIT
"""The paged KV-cache runtime (ort_ops/runtime.py): block allocation and release, several
sequences of different lengths in one packed step, prefill then decode, chunked prefill and
sequences joining a running batch, caches updated in place through IOBinding, greedy generate
with EOS and max-token stops. Runs a hand-built decoder (graphs/attention.py) rewritten to paged.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir
import pytest

from graphs.attention import build_decoder
from ort_ops.rewrite import rewrite_model
from ort_ops.runtime import BlockAllocator, PagedKVCache, PagedRunner, generate, paged_metadata
from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL

BLOCK = 8


@functools.cache
def _paged_model(block_size: int = BLOCK) -> bytes:
    m, results = rewrite_model(ir.serde.deserialize_model(build_decoder("sdpa", hq=4, hkv=2, seed=5)),
                               block_size=block_size, moe=False)
    assert results[0].fused == 2
    return ir.serde.serialize_model(m).SerializeToString()


def test_block_allocator_reserve_release_reuse():
    a = BlockAllocator(num_blocks=6, block_size=4)
    a.reserve("x", 5)  # 2 blocks
    a.reserve("y", 4)  # 1 block
    assert a.tables == {"x": [0, 1], "y": [2]} and a.free_blocks == 3
    np.testing.assert_array_equal(a.slots("x", 3, 3), [3, 4, 5])
    a.reserve("x", 9)  # grows to 3 blocks
    assert a.tables["x"] == [0, 1, 3]
    a.release("x")
    assert a.free_blocks == 5 and "x" not in a.tables
    a.reserve("z", 8)
    assert a.tables["z"] == [0, 1]  # freed blocks are reused, lowest first
    with pytest.raises(RuntimeError, match="KV cache full"):
        a.reserve("w", 100)


def test_paged_model_interface():
    meta = paged_metadata(_paged_model())
    assert meta["num_layers"] == 2 and meta["num_kv_heads"] == 2 and meta["head_dim"] == 64
    assert meta["block_size"] == BLOCK and meta["logits_rows"] == "last"
    cache = PagedKVCache.for_model(_paged_model(), num_blocks=4)
    k, v, ks, _ = cache.buffers[0]
    assert k.shape == (4, 2, BLOCK, 64) and v.shape == (4, 2, 64, BLOCK) and ks.shape == (4, 2, BLOCK)
    assert k.dtype == np.int8 and ks.dtype == np.float32


def test_batch_equals_sequences_alone(rng):
    """Three prompts of different lengths prefilled in one packed step, then decoded together,
    give each sequence what it gets alone; only the new slots of the cache change per step."""
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17)]
    together = PagedRunner(_paged_model(), num_blocks=16)
    first = together.step({i: p for i, p in enumerate(prompts)})
    before = [a.copy() for a in together.cache.buffers[0]]
    step2 = together.step({0: [5], 1: [6], 2: [7]})
    after = together.cache.buffers[0]
    # decode wrote exactly one slot per sequence (in place, through IOBinding)
    changed = np.argwhere(np.any(before[0] != after[0], axis=(1, 3)))  # (block, offset) pairs
    assert len(changed) <= 3 and np.any(before[2] != after[2])
    for i, p in enumerate(prompts):
        alone = PagedRunner(_paged_model(), num_blocks=16)
        np.testing.assert_allclose(alone.step({"s": p})[0], first[i], atol=ATTN_REWRITE_EMULATED_LOGITS_ATOL)
        np.testing.assert_allclose(alone.step({"s": [5 + i]})[0], step2[i], atol=ATTN_REWRITE_EMULATED_LOGITS_ATOL)


def test_chunked_prefill_and_joining_sequences(rng):
    """A prompt prefilled in two chunks equals one prefill; a sequence may join a batch that is
    already decoding (continuous batching), and released blocks return to the pool."""
    p = list(rng.integers(3, 64, 21))
    q = list(rng.integers(3, 64, 6))
    one = PagedRunner(_paged_model(), num_blocks=16)
    full = one.step({"a": p})[0]
    chunked = PagedRunner(_paged_model(), num_blocks=16)
    chunked.step({"a": p[:9]})
    part = chunked.step({"a": p[9:], "b": q})  # chunk of a + prefill of b in one step
    np.testing.assert_allclose(part[0], full, atol=ATTN_REWRITE_EMULATED_LOGITS_ATOL)
    alone_b = PagedRunner(_paged_model(), num_blocks=16).step({"b": q})[0]
    np.testing.assert_allclose(part[1], alone_b, atol=ATTN_REWRITE_EMULATED_LOGITS_ATOL)
    free = chunked.cache.allocator.free_blocks
    chunked.release("a")
    assert chunked.cache.allocator.free_blocks == free + 3  # 21 tokens / 8 per block


def test_generate_max_tokens_and_eos(rng):
    prompts = [list(rng.integers(3, 64, n)) for n in (4, 9, 15, 2)]
    ref = generate(_paged_model(), prompts, max_new_tokens=10)
    assert all(len(r.tokens) == 10 and not r.stopped_by_eos for r in ref)
    eos = ref[2].tokens[4]
    out = generate(_paged_model(), prompts, max_new_tokens=10, eos_token_id=eos)
    for r0, r in zip(ref, out):
        if eos in r0.tokens:
            k = r0.tokens.index(eos)
            assert r.tokens == r0.tokens[: k + 1] and r.stopped_by_eos
        else:
            assert r.tokens == r0.tokens and not r.stopped_by_eos


def test_generate_releases_blocks_and_reports_full_cache(rng):
    prompts = [list(rng.integers(3, 64, 20))]
    runner = PagedRunner(_paged_model(), num_blocks=2)  # 16 tokens of room
    with pytest.raises(RuntimeError, match="KV cache full"):
        runner.step({"a": prompts[0]})
    with pytest.raises(ValueError, match="at least one token"):
        generate(_paged_model(), [[]])
