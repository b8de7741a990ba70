# SPDX-License-Identifier: MIT
"""The plumbing of benchmarks/eval_perplexity.py (issue 21) on the committed fixtures: which token
each logit row scores, prefill + decode through the paged runtime, the INT8 peers' emulation, and
graphs/train_models.py's corpus split. No torch needed (the trained models are not in CI); the
export test runs only where torch and transformers are installed."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from benchmarks import eval_perplexity as ev
from graphs.attention import emulate_kv_int8
from tests.tolerances import ATTN_REWRITE_EMULATED_LOGITS_ATOL, ATTN_REWRITE_LOGITS_ATOL

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DENSE = FIXTURES / "attention" / "tx_sdpa_kv.onnx"       # Llama-style, vocab 128, 2 layers, KV cache
MOE = FIXTURES / "moe" / "mixtral_dynamo_batched.onnx"    # Mixtral batched_mm, 4 experts, vocab 64, no cache
VOCAB = 128


def _windows(seed: int, count: int, length: int, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, (count, length)).astype(np.int64)


def test_token_nll_is_cross_entropy():
    rng = np.random.default_rng(0)
    # Uniform logits: every token has probability 1/V.
    assert np.allclose(ev.token_nll(np.zeros((3, 50)), np.array([0, 7, 49])), math.log(50), rtol=0, atol=1e-12)
    # Two logits: NLL of the first = log(1 + e^(b - a)), written out in float64.
    a, b = rng.standard_normal(5), rng.standard_normal(5)
    want = np.log1p(np.exp(b - a))
    assert np.allclose(ev.token_nll(np.stack([a, b], -1), np.zeros(5, np.int64)), want, rtol=0, atol=1e-12)
    # Large logits do not overflow (the max is taken out first).
    assert np.isfinite(ev.token_nll(np.array([[1e4, 0.0]]), np.array([1]))).all()


def test_compare_to_float_is_paired():
    ref = np.array([[1.0, 2.0], [3.0, 4.0]])
    r = ev.compare_to_float(ref + np.array([[0.1, 0.3], [0.1, 0.3]]), ref)
    assert math.isclose(r["delta_nll"], 0.2) and math.isclose(r["delta_nll_se"], np.std([0.1, 0.3, 0.1, 0.3], ddof=1) / 2)
    assert math.isclose(r["delta_pct"], 100 * (math.exp(0.2) - 1))
    assert math.isclose(r["ppl"], math.exp(2.7))


def test_windows_are_consecutive_and_bounded():
    s = np.arange(1000)
    w = ev.eval_windows(s, 300, 5)
    assert w.shape == (3, 300) and w[1, 0] == 300 and w[2, -1] == 899
    with pytest.raises(ValueError, match="fewer than one 2000-token window"):
        ev.eval_windows(s, 2000, 1)


def test_score_dense_aligns_with_incremental_decoding():
    """The whole-window forward scores token p + 1 with the logits of position p: the same NLLs
    as decoding the window token by token with past/present (ort_ops.generate, teacher-forced)."""
    from ort_ops.runtime import generate

    win, score = _windows(1, 2, 20), 6
    nll = ev.score_dense(str(DENSE), win, score)
    gens = generate(str(DENSE), [list(r[:-score]) for r in win], forced_tokens=[list(r[-score:]) for r in win],
                    return_logits=True, with_library=False)
    for i, g in enumerate(gens):
        want = ev.token_nll(g.logits, win[i, -score:])
        np.testing.assert_allclose(nll[i], want, rtol=0, atol=1e-4)   # float32 logits, summed in another order


def test_score_dense_in_chunks_equals_the_whole_window():
    """--float-chunk: the window fed 7 tokens a Run with the model's own KV cache gives the
    whole-window forward's NLLs (float32 sums in another order), chunk boundaries inside the
    scored tail included."""
    win, score = _windows(1, 2, 20), 6
    whole = ev.score_dense(str(DENSE), win, score)
    chunked = ev.score_dense(str(DENSE), win, score, chunk=7)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4)
    assert not np.array_equal(ev.score_dense(str(DENSE), win[:, ::-1].copy(), score, chunk=7), whole)


@pytest.fixture(scope="module")
def paged_kv8(tmp_path_factory):
    out, paged, fused = ev.make_variant(DENSE, "attn kv8", tmp_path_factory.mktemp("kv8"), 16)
    # only the attention changed (the variant's label): passes on by default that run fuse nothing
    # (swiglu and rotary_kv: make_variant leaves the projections and the RoPE chains as exported)
    assert paged and {kind: n for kind, n in fused.items() if n} == {"attention": 2}
    return out


def test_score_paged_equals_emulated_kv_quantization(paged_kv8, tmp_path):
    """Prefill + packed decode on the paged INT8 cache (qk/pv none) against the original with the
    same K/V quantization emulated in its graph, scored by the whole-window path: each NLL moves by
    at most twice the logits' difference (|d log_softmax| <= 2 max |d logit|), so an off-by-one in
    the prefill/decode split or a wrong sequence in the packed step cannot pass."""
    win, score = _windows(2, 3, 40), 9   # 31-token prefills: two 16-token blocks, one partly filled
    emu = tmp_path / "emu.onnx"
    onnx.save(emulate_kv_int8(onnx.load(str(DENSE))), str(emu))
    got = ev.score_paged(str(paged_kv8), win, score)
    want = ev.score_dense(str(emu), win, score)
    assert np.all(np.isfinite(got))
    assert np.abs(got - want).max() <= 2 * ATTN_REWRITE_EMULATED_LOGITS_ATOL
    # A shifted target (the next token's NLL) is far from it: the check can see an off-by-one.
    assert np.abs(got[:, 1:] - want[:, :-1]).max() > 10 * 2 * ATTN_REWRITE_EMULATED_LOGITS_ATOL


def test_score_paged_chunked_prefill_equals_one_step(paged_kv8):
    """--float-chunk on the paged path: each window's prefill fed 7 tokens a step (its cache
    continued) gives the NLLs of the one packed prefill step, to float rounding (the quantized
    cache holds the same codes either way; only the float sums' order in attention may change)."""
    win, score = _windows(2, 3, 40), 9
    whole = ev.score_paged(str(paged_kv8), win, score)
    chunked = ev.score_paged(str(paged_kv8), win, score, chunk=7)
    np.testing.assert_allclose(chunked, whole, rtol=0, atol=1e-4)
    assert not np.allclose(ev.score_paged(str(paged_kv8), win[:, ::-1].copy(), score, chunk=7), whole, atol=1e-2)


def test_gqa_int8_emulation_stores_on_the_grid(tmp_path):
    """Every present K/V of the emulated model is clip(rint(x / s), -128, 127) * s of the float
    model's, with s = calibrated max / 127 per layer (tensor) or per (head, channel)."""
    from ort_ops.runtime import DenseRunner

    calib = _windows(3, 2, 24)
    amax = ev.calibrate_kv(str(DENSE), calib)
    assert len(amax) == 2 and amax[0][0].shape == (1, 64)
    probe = _windows(4, 1, 30)       # other text: values past the calibrated max saturate
    raw = DenseRunner(str(DENSE)).run(probe, np.ones_like(probe), None)[1]
    for per in ("tensor", "channel"):
        emu = ev.emulate_gqa_int8(DENSE, tmp_path / f"{per}.onnx", amax, per)
        got = DenseRunner(str(emu)).run(probe, np.ones_like(probe), None)[1]
        for layer in range(2):
            for j in range(2):
                a = amax[layer][j]
                s = (np.float32(a.max()) if per == "tensor" else a[None, :, None, :]) / np.float32(127)
                x = raw[2 * layer + j]
                if layer == 0:  # layer 0's K/V depend only on the embeddings: the same input as raw's
                    want = np.clip(np.rint(x / s), -128, 127) * s
                    np.testing.assert_allclose(got[2 * layer + j], want, rtol=1e-6, atol=0)
                codes = got[2 * layer + j] / s
                assert np.abs(codes - np.rint(codes)).max() < 1e-3 and np.abs(codes).max() <= 128 + 1e-3


def test_qmoe_emulation_quantizes_each_output_channel(tmp_path):
    """The stacked expert weights hold QMoE's values: per output channel (the axis MatMul does not
    reduce), scale max|W| / qmax, codes rint(W / scale) in [-qmax - 1, qmax]; nothing else moves."""
    m0 = onnx.load(str(MOE))
    before = {i.name: numpy_helper.to_array(i) for i in m0.graph.initializer}
    for bits, qmax in ((8, 127), (4, 7)):
        out, changed = ev.emulate_qmoe(MOE, tmp_path / f"q{bits}.onnx", bits, 4)
        assert changed == 2   # gate/up and down of the fixture's one MoE layer
        after = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(out)).graph.initializer}
        moved = [n for n in before if not np.array_equal(before[n], after[n])]
        assert len(moved) == 2
        for n in moved:
            w = before[n].astype(np.float64)
            assert w.shape[0] == 4 and w.ndim == 3
            # batched_mm multiplies W_e [out, in] by x [in, 1]: the output channel is axis 1.
            s = np.abs(w).max(axis=2, keepdims=True) / qmax
            want = np.clip(np.rint(w / s), -qmax - 1, qmax) * s
            np.testing.assert_allclose(after[n], want, rtol=1e-6, atol=1e-7)
    # The moved initializers are the ones the model computes with: its predictions change.
    win = _windows(5, 1, 16, vocab=64)
    assert np.abs(ev.score_dense(str(MOE), win, 8) - ev.score_dense(str(tmp_path / "q8.onnx"), win, 8)).max() > 0


def test_cli_end_to_end(tmp_path, capsys):
    """main() on a directory laid out as train_models.py writes it (the dense fixture as the
    model): a table and a JSON report whose INT8 rows stay within the logits bound of the float
    row (|d NLL| <= 2 max |d logit|) and whose peer rows are marked as emulations."""
    (tmp_path / "dense.onnx").symlink_to(DENSE)
    rng = np.random.default_rng(6)
    np.save(tmp_path / "eval_tokens.npy", rng.integers(3, VOCAB, 200).astype(np.int32))
    np.save(tmp_path / "train_tokens_head.npy", rng.integers(3, VOCAB, 1024).astype(np.int32))
    (tmp_path / "manifest.json").write_text(json.dumps({"seed": 7, "config": {"name": "fixture"}}))
    rc = ev.main(["--models", str(tmp_path), "--contexts", "48,64", "--windows", "2", "--score", "5",
                  "--variants", "attn s8/s8,moe w8a8", "--peers", "gqa-int8 tensor,qmoe8", "--calib-windows", "2",
                  "--json", str(tmp_path / "r.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| attn s8/s8 |" in out and "| peer GQA INT8 per tensor (emulated) |" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["seed"] == 7 and r["windows"] == 2
    d = r["models"]["dense"]
    assert set(d) == {"float", "attn s8/s8", "peer GQA INT8 per tensor (emulated)"}   # no MoE in this model
    for ctx in ("48", "64"):
        f = d["float"][ctx]
        assert 1.0 < f["ppl"] < 10 * VOCAB and f["windows"] == 2
        assert abs(d["attn s8/s8"][ctx]["nll"] - f["nll"]) <= 2 * ATTN_REWRITE_LOGITS_ATOL
        assert d["peer GQA INT8 per tensor (emulated)"]["emulated"] is True
    assert ev.main(["--models", str(tmp_path), "--variants", "attn s9"]) == 2


def test_corpus_split_is_disjoint_and_deterministic():
    """Held-out files are those whose CRC-32 of the relative path is 0 mod 16: disjoint from the
    training files, the same on every call, and not empty."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
    import train_models as tm

    root, train, held = tm.corpus_files(with_tests=False)
    assert held and train and not set(train) & set(held)
    assert all(zlib.crc32(p.relative_to(root).as_posix().encode()) % 16 == 0 for p in held)
    assert tm.corpus_files(with_tests=False)[2] == held
    assert not [p for p in train + held if "site-packages" in p.parts]


@pytest.mark.slow
def test_trained_model_export_is_rewritten(tmp_path):
    """graphs/train_models.py's export (a random-weight tiny MoE model; training is not needed for
    the form) is taken by both fusions and runs paged."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
    import train_models as tm

    torch.manual_seed(0)
    model = tm.build_model("moe", tm.TINY).eval()
    tm.export(model, "moe", tmp_path / "moe.onnx")
    _out, paged, fused = ev.make_variant(tmp_path / "moe.onnx", "both s8/s8", tmp_path, 16)
    # only the MoE and the attention changed (the variant's label), whatever else ran fused nothing
    assert paged and {kind: n for kind, n in fused.items() if n} == {"moe": tm.TINY.layers,
                                                                     "attention": tm.TINY.layers}
