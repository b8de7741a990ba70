# SPDX-License-Identifier: MIT
"""Greedy steps (ort_ops/runtime.py ``PagedRunner.step_greedy``): the paged model's next_token
output (ArgMax of the logits, in the graph) brings back one token id per sequence instead of the
logits. Every expected token is np.argmax of the logits that ``step`` returns on the numpy path of
another runner fed the same steps, never a value of the path under test alone: on the numpy path,
the device-binding path (cache_on_device) and the fixed-shape buckets (cuda_graph, uncaptured on
the CPU EP); for a model whose logits are one row per sequence ("last") and one per packed token
("all"); for a model written before the output existed (stripped here), which still gives the
same tokens; and for generate, whose tokens do not depend on whether it keeps the logits.
"""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from ort_ops.paged_interface import NEXT_TOKEN, PAGED_META_KEY, read_metadata
from ort_ops.rewrite import rewrite_model
from ort_ops.runtime import PagedRunner, generate, paged_metadata
from tests.test_runtime import _paged_model

FIXTURE_ALL_ROWS = pathlib.Path(__file__).resolve().parent / "fixtures" / "attention" / "gemma2_softcap_kv.onnx"

# The three binding paths; buckets of 1, 2, 4, 8 rows, so a decode of three runs padded in four.
PATHS = {
    "host": {},
    "device": {"cache_on_device": True},
    "bucket": {"cache_on_device": True, "cuda_graph": True, "graph_batch_sizes": (1, 2, 4, 8)},
}


@functools.cache
def _all_rows_model() -> bytes:
    """A paged model whose lm_head is not a plain MatMul (Gemma 2's final softcap): logits of
    every packed token, logits_rows "all"."""
    model, _ = rewrite_model(str(FIXTURE_ALL_ROWS), moe=False)
    data = ir.serde.serialize_model(model).SerializeToString()
    assert paged_metadata(data)["logits_rows"] == "all"
    return data


def _without_next_token(data: bytes) -> bytes:
    """The model as the rewrite wrote it before next_token existed: the output, the nodes that
    only it reads, and the metadata key removed."""
    proto = onnx.load_from_string(data)
    name = read_metadata(proto)["next_token"]
    proto.graph.output.remove(next(o for o in proto.graph.output if o.name == name))
    dead = {name}
    while dead:  # the ArgMax, then what only it read (a Cast), up to what something else reads
        value = dead.pop()
        node = next((n for n in proto.graph.node if value in n.output), None)
        read = any(value in n.input for n in proto.graph.node) or value in {o.name for o in proto.graph.output}
        if node is None or read:
            continue
        proto.graph.node.remove(node)
        dead.update(node.input)
    for p in proto.metadata_props:
        if p.key == PAGED_META_KEY:
            meta = json.loads(p.value)
            del meta["next_token"]
            p.value = json.dumps(meta)
    return proto.SerializeToString()


def _with_tied_logits(data: bytes) -> bytes:
    """The model with lm_head's columns 2i and 2i+1 equal: every logit equals its neighbour's,
    so each row's maximum is a tie between an even and the following odd token id."""
    proto = onnx.load_from_string(data)
    meta = read_metadata(proto)
    lm_head = next(n for n in proto.graph.node if meta["logits"] in n.output)
    assert lm_head.op_type == "MatMul"
    init = next(t for t in proto.graph.initializer if t.name == lm_head.input[1])
    w = onnx.numpy_helper.to_array(init).copy()
    w[:, 1::2] = w[:, 0::2]
    init.CopyFrom(onnx.numpy_helper.from_array(w, init.name))
    return proto.SerializeToString()


def _drive(runner: PagedRunner, prompts, greedy: bool) -> list[np.ndarray]:
    """The same five steps through ``step`` or ``step_greedy``: a packed prefill of three prompts,
    a decode of three (a 4-row bucket: one padding row), a packed decode of two after a release
    (a 2-row bucket), a prefill joining two decodes (a mixed step: no bucket), a decode of three."""
    run = runner.step_greedy if greedy else runner.step
    out = [run({0: prompts[0], 1: prompts[1], 2: prompts[2]})]
    out.append(run({0: [5], 1: [6], 2: [7]}))
    runner.release(1)
    out.append(run({0: [8], 2: [9]}))
    out.append(run({0: [10], 2: [11], 3: prompts[3]}))
    out.append(run({0: [12], 2: [13], 3: [14]}))
    return out


def _expected(model: bytes, prompts) -> list[np.ndarray]:
    """np.argmax of the logits of the numpy path's ``step`` (the reference runner)."""
    return [np.argmax(logits, axis=-1) for logits in _drive(PagedRunner(model, num_blocks=16), prompts, False)]


def _check(model: bytes, path: str, prompts) -> PagedRunner:
    runner = PagedRunner(model, num_blocks=16, **PATHS[path])
    got = _drive(runner, prompts, True)
    for want, tokens in zip(_expected(model, prompts), got):
        assert tokens.dtype == np.int64 and tokens.shape == want.shape
        np.testing.assert_array_equal(tokens, want)
    if path == "bucket":
        assert runner.graph_steps == 3 and sorted(s for s, _ in runner._buckets) == [2, 4]
    return runner


@pytest.mark.parametrize("path", list(PATHS))
def test_step_greedy_is_the_argmax_of_the_step_logits(rng, path):
    """One row per sequence ("last"): the prefill, packed decodes of three and two sequences
    (padded buckets on the bucket path) and a mixed step give the argmax of step's logits."""
    assert paged_metadata(_paged_model())["next_token"] == NEXT_TOKEN
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 6)]
    runner = _check(_paged_model(), path, prompts)
    assert runner.token_name == NEXT_TOKEN


@pytest.mark.parametrize("path", list(PATHS))
def test_step_greedy_on_logits_of_every_packed_token(rng, path):
    """logits_rows "all": next_token is [1, T], one per packed token; the step returns each
    sequence's last one."""
    prompts = [list(rng.integers(3, 128, n)) for n in (5, 12, 9, 7)]
    _check(_all_rows_model(), path, prompts)


@pytest.mark.parametrize("path", list(PATHS))
def test_a_model_without_next_token_gives_the_same_tokens(rng, path):
    """A paged model written before next_token (no output, no metadata key) still reads, and its
    greedy steps (the argmax of step's logits on the host) give the same tokens."""
    old = _without_next_token(_paged_model())
    proto = onnx.load_from_string(old)
    assert not any(n.op_type == "ArgMax" for n in proto.graph.node)
    assert NEXT_TOKEN not in {o.name for o in proto.graph.output}
    assert paged_metadata(old)["next_token"] is None
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 6)]
    runner = _check(old, path, prompts)
    assert runner.token_name is None
    new = _drive(PagedRunner(_paged_model(), num_blocks=16, **PATHS[path]), prompts, True)
    for a, b in zip(_drive(PagedRunner(old, num_blocks=16, **PATHS[path]), prompts, True), new):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("path", list(PATHS))
def test_ties_go_to_the_first_maximum(rng, path):
    """Logits whose maximum is always tied (lm_head columns 2i and 2i+1 equal): the graph's
    ArgMax picks the first of the tie, the even id, as np.argmax does."""
    tied = _with_tied_logits(_paged_model())
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 6)]
    logits = _drive(PagedRunner(tied, num_blocks=16), prompts, False)
    assert all(np.array_equal(x[:, 0::2], x[:, 1::2]) for x in logits)  # every logit is tied
    _check(tied, path, prompts)
    for tokens in _drive(PagedRunner(tied, num_blocks=16, **PATHS[path]), prompts, True):
        assert np.all(tokens % 2 == 0), tokens


@pytest.mark.parametrize("path", ["device", "bucket"])
def test_greedy_and_logits_steps_alternate_on_one_binding(rng, path):
    """The device path keeps one binding (the bucket path one per bucket) for the runner's life:
    greedy steps and logits steps interleaved on it each return what they should."""
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 6)]
    ref = _drive(PagedRunner(_paged_model(), num_blocks=16), prompts, False)
    runner = PagedRunner(_paged_model(), num_blocks=16, **PATHS[path])
    got = [runner.step({0: prompts[0], 1: prompts[1], 2: prompts[2]}),
           runner.step_greedy({0: [5], 1: [6], 2: [7]})]
    runner.release(1)
    got += [runner.step({0: [8], 2: [9]}), runner.step_greedy({0: [10], 2: [11], 3: prompts[3]}),
            runner.step({0: [12], 2: [13], 3: [14]})]
    for i, (want, out) in enumerate(zip(ref, got)):
        if i % 2:
            np.testing.assert_array_equal(out, np.argmax(want, axis=-1))
        else:
            np.testing.assert_array_equal(out, want)


def test_a_greedy_bucket_step_copies_back_only_the_tokens(rng):
    """In a bucket the tokens have their own fixed-shape device value beside the logits'; a
    greedy step reads back that one alone."""

    class _NotRead:
        def numpy(self):
            raise AssertionError("a greedy bucket step read the logits back")

    runner = PagedRunner(_paged_model(), num_blocks=16, **PATHS["bucket"])
    ref = PagedRunner(_paged_model(), num_blocks=16)
    prompts = {0: list(rng.integers(3, 64, 7)), 1: list(rng.integers(3, 64, 12))}
    runner.step_greedy(prompts)
    ref.step(prompts)
    runner.step_greedy({0: [4], 1: [5]})
    ref.step({0: [4], 1: [5]})
    (bucket,) = runner._buckets.values()
    assert bucket.tokens is not None and bucket.tokens.shape() == [1, 2]
    bucket.logits = _NotRead()
    tokens = runner.step_greedy({0: [6], 1: [7]})
    np.testing.assert_array_equal(tokens, np.argmax(ref.step({0: [6], 1: [7]}), axis=-1))
    assert runner.graph_steps == 2


@pytest.mark.parametrize("path", list(PATHS))
def test_generate_tokens_do_not_depend_on_keeping_logits(rng, path):
    """generate without logits (greedy steps) emits the tokens it emits with them (the argmax of
    each kept row), with EOS stops, chunked prefill, and teacher forcing."""
    kw = {k: v for k, v in PATHS[path].items() if k != "graph_batch_sizes"}
    prompts = [list(rng.integers(3, 64, n)) for n in (4, 9, 15, 2)]
    first = generate(_paged_model(), prompts, max_new_tokens=8, return_logits=True, **kw)
    eos = first[1].tokens[3]
    forced = [list(rng.integers(3, 64, 6)) for _ in prompts]
    for extra in ({"eos_token_id": eos}, {"eos_token_id": eos, "max_step_tokens": 7}, {"forced_tokens": forced}):
        with_logits = generate(_paged_model(), prompts, max_new_tokens=8, return_logits=True, **kw, **extra)
        without = generate(_paged_model(), prompts, max_new_tokens=8, **kw, **extra)
        old = generate(_without_next_token(_paged_model()), prompts, max_new_tokens=8, **kw, **extra)
        if "eos_token_id" in extra:
            assert any(r.stopped_by_eos for r in with_logits)
        for a, b, c in zip(with_logits, without, old):
            assert a.tokens == list(np.argmax(a.logits, axis=-1))
            assert b.tokens == a.tokens == c.tokens and b.stopped_by_eos == a.stopped_by_eos
            assert b.logits is None
