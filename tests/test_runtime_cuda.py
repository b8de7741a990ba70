# SPDX-License-Identifier: MIT
"""The paged runtime on ORT's CUDA EP (issue 18): the same steps as on the CPU give the same
logits (to the kernels' float rounding) with the caches living on the GPU, a bad table found by
a CUDA op fails that step with the op's one-line error, and ``ort-ops verify --device cuda``
passes on a bundled fixture. Every test is ``@pytest.mark.cuda`` and skips with the reason where
onnxruntime-gpu or a CUDA build of the library is missing.
"""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import onnxruntime as ort
import pytest

import ort_ops
from ort_ops.runtime import PagedRunner, generate
from tests.test_runtime import _paged_model
from tests.tolerances import ATTN_CPU_VS_CUDA_LOGITS_ATOL, ATTN_REWRITE_GREEDY_AGREEMENT

pytestmark = pytest.mark.cuda

if "CUDAExecutionProvider" not in ort.get_available_providers():
    pytest.skip("onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu not installed)", allow_module_level=True)
if not ort_ops.build_info().get("cuda"):
    pytest.skip("the ort-ops library was built without CUDA", allow_module_level=True)

# fp32 MatMuls in full fp32 (ORT's CUDA EP uses TF32 by default), so the CPU comparison measures
# the paged kernels and the bindings, not TF32's 10-bit mantissa.
CUDA_FP32 = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
CUDA_BLOCK = 16  # the CUDA kernels take blocks of 16+ keys (DESIGN.md)
FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "attention" / "tx_sdpa_kv.onnx"


def _steps(runner, prompts):
    out = [runner.step({i: p for i, p in enumerate(prompts[:3])})]
    out.append(runner.step({0: [5], 1: [6], 2: [7]}))
    runner.release(1)
    out.append(runner.step({0: [8], 2: [9], 3: prompts[3]}))  # a prefill joins running decodes
    out.append(runner.step({0: [10], 2: [11], 3: [12]}))
    return out


def test_cuda_steps_equal_cpu_steps_with_the_cache_on_the_gpu(rng):
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 40)]
    cpu = PagedRunner(_paged_model(CUDA_BLOCK), num_blocks=32)
    gpu = PagedRunner(_paged_model(CUDA_BLOCK), num_blocks=32, providers=CUDA_FP32)
    assert gpu.device == "cuda" and gpu.cache.device == "cuda"
    assert all(v.device_name().lower() == "cuda" for layer in gpu.cache.values for v in layer)
    ptrs = [v.data_ptr() for layer in gpu.cache.values for v in layer]
    for a, b in zip(_steps(cpu, prompts), _steps(gpu, prompts)):
        assert a.shape == b.shape and np.isfinite(b).all()
        np.testing.assert_allclose(b, a, atol=ATTN_CPU_VS_CUDA_LOGITS_ATOL, rtol=0)
    assert [v.data_ptr() for layer in gpu.cache.values for v in layer] == ptrs  # written in place


def test_cuda_graph_decode_steps_equal_steps_run_node_by_node(rng):
    """Decode steps in padded buckets, captured as CUDA graphs and replayed, give the logits of
    the same steps run node by node (to the GEMMs' choice of algorithm for the padded row count),
    across a prefill joining the batch, a sequence leaving it and a one-token prompt filling a
    bucket; each bucket is its own graph."""
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 40)]

    def run(r):
        out = [r.step({i: p for i, p in enumerate(prompts[:3])})]
        for t in range(5):  # bucket 4: a regular Run, the capture, then replays
            out.append(r.step({0: [5 + t], 1: [6 + t], 2: [7 + t]}))
        r.release(1)
        out.append(r.step({0: [20], 2: [21], 3: prompts[3]}))  # a prefill joins: an ordinary Run
        for t in range(4):  # bucket 4 with a wider block table
            out.append(r.step({0: [22 + t], 2: [23 + t], 3: [24 + t]}))
        out.append(r.step({0: [30], 2: [31], 3: [32], 4: [7]}))  # a one-token prompt fills the bucket
        out.append(r.step({0: [33]}))  # bucket 1
        out.append(r.step({0: [34]}))
        out.append(r.step({0: [35]}))
        return out

    plain = PagedRunner(_paged_model(CUDA_BLOCK), num_blocks=40, providers=CUDA_FP32, cuda_graph=False)
    graph = PagedRunner(_paged_model(CUDA_BLOCK), num_blocks=40, providers=CUDA_FP32)
    assert graph.cuda_graph, graph.graph_note
    assert not plain.cuda_graph and plain.graph_steps == 0
    for a, b in zip(run(plain), run(graph)):
        assert a.shape == b.shape and np.isfinite(b).all()
        np.testing.assert_allclose(b, a, atol=1e-3, rtol=0)
        np.testing.assert_array_equal(b.argmax(-1), a.argmax(-1))
    # buckets (4 sequences, width 2), (4, 4), (1, 1) and (1, 2): the step where a one-token prompt
    # joins three decodes reads a 3-block table, (4, 4) again; sequence 0 reaches 17 tokens (two
    # blocks) in its last step. Each bucket has its own graph id.
    assert graph.graph_steps == 13, graph.graph_steps
    assert sorted(graph._buckets) == [(1, 1), (1, 2), (4, 2), (4, 4)], sorted(graph._buckets)
    ids = [b.run.get_run_config_entry("gpu_graph_id") for b in graph._buckets.values()]
    assert sorted(ids) == ["1", "2", "3", "4"], ids
    assert graph.cache.scratch and plain.cache.scratch == []  # scratch beside the 40 blocks asked for


def test_cuda_generate_follows_cpu_generate(rng):
    prompts = [list(rng.integers(3, 64, n)) for n in (4, 9, 15, 2)]
    ref = generate(_paged_model(CUDA_BLOCK), prompts, max_new_tokens=8, return_logits=True)
    out = generate(_paged_model(CUDA_BLOCK), prompts, max_new_tokens=8, return_logits=True, providers=CUDA_FP32,
                   forced_tokens=[r.tokens for r in ref], max_step_tokens=16)
    agree = np.mean([a == b for r, o in zip(ref, out) for a, b in zip(r.tokens, o.tokens)])
    assert agree >= ATTN_REWRITE_GREEDY_AGREEMENT, agree
    for r, o in zip(ref, out):
        np.testing.assert_allclose(o.logits, r.logits, atol=ATTN_CPU_VS_CUDA_LOGITS_ATOL, rtol=0)


def test_bad_block_table_fails_the_step_with_the_ops_error(rng):
    if getattr(ort_ops, "check_device_errors", None) is None:
        pytest.skip("this ort_ops has no check_device_errors")
    runner = PagedRunner(_paged_model(CUDA_BLOCK), num_blocks=8, device="cuda")
    runner.step({"a": list(rng.integers(3, 64, 5))})
    good = runner._tables

    def bad(batch):
        named, lens, cu = good(batch)
        named["block_tables"] = named["block_tables"] + 1000  # past the 8 blocks of the cache
        return named, lens, cu

    runner._tables = bad
    with pytest.raises(ValueError, match="block_tables"):
        runner.step({"a": [4]})
    runner._tables = good
    runner.release("a")
    assert np.isfinite(runner.step({"b": [3, 4, 5]})).all()  # the error was taken: the next step runs


def test_verify_device_cuda_on_a_fixture(tmp_path, capsys):
    from ort_ops.cli import main

    out = tmp_path / "out.onnx"
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", "--quiet", "--device", "cuda", str(FIXTURE), str(out), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["device"] == "cuda" and v["passed"]
    assert v["overall"]["token_agreement"] >= ATTN_REWRITE_GREEDY_AGREEMENT


@functools.cache
def _fp16_paged_model() -> bytes:
    """The fp16 dynamo fixture rewritten to paged: fp16 logits, whose coarse steps make exact
    ties at the maximum likelier than float32's."""
    import onnx_ir as ir

    from ort_ops.rewrite import rewrite_model

    path = pathlib.Path(__file__).resolve().parent / "fixtures" / "attention" / "dynamo_sdpa_kv_fp16.onnx"
    model, _ = rewrite_model(str(path), block_size=CUDA_BLOCK, moe=False)
    return ir.serde.serialize_model(model).SerializeToString()


@pytest.mark.parametrize("which", ["fp32", "fp16", "tied"])
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "node_by_node"])
def test_cuda_greedy_steps_are_the_argmax_of_the_step_logits(rng, which, cuda_graph):
    """On the GPU the next_token output's ArgMax (ORT's CUDA kernel: cuDNN's reduction with
    indices, fp16 cast to float32 first) picks np.argmax of the logits that a twin runner's steps
    bring back, in buckets captured as CUDA graphs and node by node; of a tie, the first index
    (the tied model: lm_head columns 2i and 2i+1 equal, so every pick must be even). The model's
    ArgMax must leave the capture possible: the graph runner still runs decode steps as graphs."""
    from tests.test_runtime_greedy import _drive, _with_tied_logits

    model = {"fp32": lambda: _paged_model(CUDA_BLOCK), "fp16": _fp16_paged_model,
             "tied": lambda: _with_tied_logits(_paged_model(CUDA_BLOCK))}[which]()
    prompts = [list(rng.integers(3, 64, n)) for n in (3, 10, 17, 40)]
    kw = {"num_blocks": 32, "providers": CUDA_FP32, "cuda_graph": cuda_graph}
    greedy, logits = PagedRunner(model, **kw), PagedRunner(model, **kw)
    assert greedy.token_name is not None and greedy.cuda_graph == cuda_graph, greedy.graph_note
    for _ in range(2):  # the second round replays the buckets the first captured
        for tokens, want in zip(_drive(greedy, prompts, True), _drive(logits, prompts, False)):
            assert tokens.dtype == np.int64
            np.testing.assert_array_equal(tokens, np.argmax(want, axis=-1))
            if which == "tied":
                assert np.all(tokens % 2 == 0), tokens
        for r in (greedy, logits):
            for s in (0, 2, 3):
                r.release(s)
    assert greedy.graph_steps == (6 if cuda_graph else 0)


def _captured_step_differences(plain, fused, rng) -> list[float]:
    """Max |logit difference| per step between two rewrites of one model (onnx_ir Models) run on
    the CUDA EP through the same steps: a packed prefill of 3 prompts, 6 decode steps in bucket 4
    (its regular Run, its capture, replays), then an ordinary packed Run."""
    import onnx_ir as ir

    from ort_ops.rewrite._graph import float32_io, has_bfloat16

    plan = [dict(enumerate(rng.integers(3, 60, n).tolist() for n in (5, 11, 17)))]
    plan += [{i: [int(rng.integers(3, 60))] for i in range(3)} for _ in range(6)]
    plan.append({0: [int(rng.integers(3, 60))], 2: rng.integers(3, 60, 3).tolist()})

    def run(model):
        if has_bfloat16(model):  # onnxruntime's Python API has no bfloat16 arrays: float32 logits
            model = float32_io(model)
        runner = PagedRunner(ir.to_proto(model).SerializeToString(), num_blocks=32, providers=CUDA_FP32)
        assert runner.cuda_graph, runner.graph_note
        out = [runner.step(s) for s in plan]
        assert runner.graph_steps == 6, runner.graph_steps
        return out

    return [float(np.abs(a - b).max()) for a, b in zip(run(plain), run(fused))]


@pytest.mark.parametrize("name", ["dynamo_sdpa_kv_fp16", "dynamo_sdpa_kv_bf16", "gptoss_sinks_kv"])
def test_rotary_fusion_in_captured_decode_steps(name, rng):
    """The RoPE fusion's com.microsoft RotaryEmbedding on the CUDA EP (the [1, T, N*D] input, the
    constant offset position [0], caches sliced from each step's cos/sin; float16, bfloat16 and
    float32), in decode steps captured as CUDA graphs and replayed: the logits of the same s8/s8
    rewrite without it (the CUDA kernels' quantization), on the same GPU, the same steps."""
    from ort_ops.rewrite import rewrite_model
    from ort_ops.rewrite.pipeline import RewriteOptions
    from ort_ops.rewrite.rotary import fuse_rotary
    from tests.tolerances import ROTARY_CUDA_S8_LOGITS_ATOL

    plain, _ = rewrite_model(str(FIXTURE.parent / f"{name}.onnx"), moe=False, rotary=False)  # s8/s8: CUDA's
    fused = plain.clone()
    assert fuse_rotary(fused, RewriteOptions()).fused == 4
    errs = _captured_step_differences(plain, fused, rng)
    print(name, "max abs logit difference per step", errs)
    assert max(errs) <= ROTARY_CUDA_S8_LOGITS_ATOL, errs


@pytest.mark.parametrize("name", ["dynamo_sdpa_kv_fp16", "dynamo_sdpa_kv_bf16", "dynamo_sdpa_kv"])
def test_skip_norm_fusion_in_captured_decode_steps(name, rng, monkeypatch):
    """The norms pass's com.microsoft SkipSimplifiedLayerNormalization (residual Add and norm in one
    kernel, output 3 the sum for the next residual Add) on the CUDA EP, in decode steps captured as
    CUDA graphs and replayed: the logits of the same s8/s8 rewrite with the residual Adds left
    alone (Add + SimplifiedLayerNormalization), on the same GPU, the same steps."""
    from ort_ops.rewrite import rmsnorm
    from ort_ops.rewrite import rewrite_model
    from tests.tolerances import SKIP_NORM_CUDA_S8_LOGITS_ATOL

    src = str(FIXTURE.parent / f"{name}.onnx")
    fused, results = rewrite_model(src, moe=False)
    assert next(r for r in results if r.kind == "rmsnorm").details["skip"] == 4
    monkeypatch.setattr(rmsnorm, "_residual_add", lambda norm: None)
    plain, results = rewrite_model(src, moe=False)
    assert next(r for r in results if r.kind == "rmsnorm").details["skip"] == 0
    errs = _captured_step_differences(plain, fused, rng)
    print(name, "max abs logit difference per step", errs)
    assert max(errs) <= SKIP_NORM_CUDA_S8_LOGITS_ATOL, errs


def test_moe_model_decode_steps_are_captured(tmp_path, rng):
    """A rewritten Qwen-MoE export (transformers' exporter, fp16, a shared expert: tiny preset)
    on the CUDA EP: the session takes CUDA graphs (no host-to-device copy node: the shared
    expert's group list comes from Range, not from a Shape read in host memory), and its captured
    greedy decode steps pick the tokens of the same steps run node by node."""
    pytest.importorskip("transformers")
    from graphs.export_realistic import build
    from ort_ops.rewrite import rewrite_model

    src = build("qwen_moe", tmp_path, dtype="fp16", tiny=True, exporter="transformers", checkpoint=False)
    out = tmp_path / "model.int8.onnx"
    _, results = rewrite_model(str(src), str(out), block_size=CUDA_BLOCK, moe_weight_layout="ENK")
    assert {r.kind: r.fused for r in results}["moe"] > 0
    prompts = [list(rng.integers(3, 500, n)) for n in (5, 19, 33)]

    def run(r):
        picks = [r.step_greedy({i: p for i, p in enumerate(prompts)})]
        for _ in range(6):
            picks.append(r.step_greedy({i: [int(t)] for i, t in enumerate(picks[-1])}))
        return np.stack(picks)

    graph = PagedRunner(str(out), num_blocks=40, device="cuda")
    assert graph.cuda_graph, graph.graph_note
    plain = PagedRunner(str(out), num_blocks=40, device="cuda", cuda_graph=False)
    got, want = run(graph), run(plain)
    assert graph.graph_steps >= 4, graph.graph_steps
    assert (got == want).mean() >= 0.9, (got, want)  # near-tied picks of random weights may differ
