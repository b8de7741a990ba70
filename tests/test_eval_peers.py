# SPDX-License-Identifier: MIT
"""ORT's QMoE as the real op in whole models (benchmarks/peers_ort.py, issue 21's peers), on
hand-built MoE blocks and the committed MoE fixtures (tiny random-weight decoders, seconds).

What is checked: the routing ORT 1.32's CPU QMoE computes for each mapping the rewrite uses (the
premise of the mapping), every rewritten block against the float MoE of the dequantized weights
under the block's own routing, whole-model logits against the float graph holding the same
dequantized weights (benchmarks/eval_perplexity.py's emulation: numpy dequantization, float ops)
and against the float original, the declines, and the evaluation's rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from benchmarks import eval_perplexity as ev
from benchmarks import peers_ort
from graphs.moe import _qmoe_codes, build_contrib_moe, build_moe
from ort_ops.testing import moe_layer as ml
from tests.tolerances import (
    MOE_FLOAT_VS_REFERENCE_RTOL,
    QMOE_PEER_FP16_VS_DEQUANTIZED_FLOAT_REL_L2,
    QMOE_PEER_LOGITS_REL_L2,
    QMOE_PEER_VS_DEQUANTIZED_FLOAT_ATOL,
)

MOE_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "moe"
H, I, E, K = 64, 32, 8, 2


def _dequant(m: np.ndarray, bits: int) -> np.ndarray:
    """m [E, out, in] through QMoE's codes and back: (q - zero point) * scale (the op's schema)."""
    q, s = _qmoe_codes(m, bits)
    if bits == 4:
        q = np.stack([q & 0x0F, q >> 4], axis=-1).reshape(q.shape[:2] + (-1,))
    return ((q.astype(np.float32) - (128 if bits == 8 else 8)) * s[:, :, None]).astype(np.float32)


def _effective(w: ml.MoeWeights, bits: int) -> ml.MoeWeights:
    """The float weights a QMoE node of w's experts holds (x @ W orientation)."""
    gu = w.w_gate_up.transpose(0, 2, 1)                  # [E, 2I, H]: gate rows, then up rows
    inter = gu.shape[1] // 2
    g, u = _dequant(gu[:, :inter].copy(), bits), _dequant(gu[:, inter:].copy(), bits)
    d = _dequant(w.w_down.transpose(0, 2, 1).copy(), bits)
    return ml.MoeWeights(w.router, np.concatenate([g, u], 1).transpose(0, 2, 1).copy(), d.transpose(0, 2, 1).copy())


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("normalize, router_weights, renormalized", [
    (1, False, True), (0, False, True), (0, True, False),
], ids=["normalize", "no-normalize-no-weights", "no-normalize-router-weights"])
def test_ort_qmoe_routing(rng, bits, normalize, router_weights, renormalized):
    """The premise of peers_ort.QMOE_ROUTING, on one QMoE node of ORT 1.32's CPU EP: the top-k
    weights are renormalized with normalize_routing_weights 1 and also with 0 when router_weights
    is absent; with 0 and router_weights (the softmax) they mix as they are."""
    w = ml.random_moe_weights(rng, H, I, E)
    proto = build_contrib_moe(w, K, bool(normalize), op="QMoE", layout="swiglu", bits=bits)
    x = rng.standard_normal((29, H)).astype(np.float32)
    logits = (x @ w.router).astype(np.float32)
    feeds = {"x": x, "router_logits": logits}
    if router_weights:
        node = proto.graph.node[0]
        ins = list(node.input) + [""] * (14 - len(node.input)) + ["router_weights"]
        del node.input[:]
        node.input.extend(ins)
        proto.graph.input.append(helper.make_tensor_value_info("router_weights", onnx.TensorProto.FLOAT, ["T", E]))
        p = np.exp(logits - logits.max(-1, keepdims=True))
        feeds["router_weights"] = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    got = _session(proto).run(None, feeds)[0]
    weff = _effective(w, bits)
    want = ml.moe_layer_float(x, weff, K, routing=ml.route(x, w.router, K, renormalized))
    other = ml.moe_layer_float(x, weff, K, routing=ml.route(x, w.router, K, not renormalized))
    assert np.all(np.isfinite(got))
    assert _rel_err(got, want) <= MOE_FLOAT_VS_REFERENCE_RTOL
    assert _rel_err(got, other) > 100 * MOE_FLOAT_VS_REFERENCE_RTOL   # the two routings are told apart


@pytest.mark.parametrize("routing, renormalized", [
    ("softmax_topk_renorm", True), ("softmax_topk", False), ("topk_softmax", True),
])
@pytest.mark.parametrize("bits", [8, 4])
def test_unrolled_block_becomes_qmoe(rng, tmp_path, routing, renormalized, bits):
    """An optimum-style unrolled block (graphs/moe.py) with each routing QMoE computes becomes one
    QMoE node whose output is the float MoE of the dequantized weights under that routing."""
    w = ml.random_moe_weights(rng, H, I, E)
    src, dst = tmp_path / "moe.onnx", tmp_path / "moe.qmoe.onnx"
    onnx.save(build_moe(w, K, routing=routing), str(src))
    rep = peers_ort.rewrite_to_qmoe(src, dst, bits)
    assert len(rep["blocks"]) == 1 and not rep["declined"], rep
    b = rep["blocks"][0]
    assert (b["normalize_routing_weights"], b["router_weights"]) == ((0, True) if routing == "softmax_topk" else (1, False))
    fused = onnx.load(str(dst))
    assert [n.op_type for n in fused.graph.node if n.domain == "com.microsoft"] == ["QMoE"]
    assert not any(n.op_type in ("NonZero", "ScatterElements") for n in fused.graph.node)   # the float experts are gone
    x = rng.standard_normal((37, H)).astype(np.float32)
    got = _session(fused).run(None, {"x": x})[0]
    want = ml.moe_layer_float(x, _effective(w, bits), K, routing=ml.route(x, w.router, K, renormalized))
    assert np.all(np.isfinite(got)) and _rel_err(got, want) <= MOE_FLOAT_VS_REFERENCE_RTOL


@pytest.fixture(scope="module")
def fixture_runs(tmp_path_factory):
    """{(fixture, bits): (path, report)} of the two decoder fixtures QMoE can express."""
    tmp = tmp_path_factory.mktemp("qmoe")
    out = {}
    for name in ("mixtral_dynamo_batched", "qwen2moe_dynamo_shared"):
        probe_ids = np.load(MOE_FIXTURES / f"{name}.npz")["input_ids"].reshape(-1)
        for bits in (8, 4):
            for act in ("float32", "float16"):
                dst = tmp / f"{name}.qmoe{bits}.{act}.onnx"
                key = (name, bits) if act == "float32" else (name, bits, act)
                out[key] = dst, peers_ort.rewrite_to_qmoe(MOE_FIXTURES / f"{name}.onnx", dst, bits,
                                                          probe_ids=probe_ids, activations=act)
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name, routing", [
    ("mixtral_dynamo_batched", "softmax -> topk -> renormalize"),   # Mixtral: top-2 renormalized
    ("qwen2moe_dynamo_shared", "softmax -> topk"),                  # Qwen2-MoE: not renormalized, shared expert
])
def test_fixture_logits(fixture_runs, tmp_path, name, routing, bits):
    """A whole exported decoder with its MoE block on QMoE: logits equal the float graph holding the
    same dequantized expert weights (eval_perplexity.emulate_qmoe) to float32 rounding, and stay
    within the bits' rounding of the float original, on a 24-token prompt and on one token."""
    from ort_ops.runtime import DenseRunner

    dst, rep = fixture_runs[name, bits]
    assert [b["routing"] for b in rep["blocks"]] == [routing] and not rep["declined"], rep
    assert sum(n.op_type == "QMoE" for n in onnx.load(str(dst)).graph.node) == 1
    src = MOE_FIXTURES / f"{name}.onnx"
    emu, changed = ev.emulate_qmoe(src, tmp_path / "emu.onnx", bits, 4)
    assert changed == 2
    ids = np.load(MOE_FIXTURES / f"{name}.npz")["input_ids"]
    for prompt in (ids, ids[:, :1]):
        mask = np.ones_like(prompt)
        got = DenseRunner(str(dst)).run(prompt, mask, None)[0]
        want = DenseRunner(str(emu)).run(prompt, mask, None)[0]
        ref = DenseRunner(str(src)).run(prompt, mask, None)[0]
        assert np.all(np.isfinite(got))
        assert np.abs(got - want).max() <= QMOE_PEER_VS_DEQUANTIZED_FLOAT_ATOL
        assert ml.relative_l2(got, ref) <= QMOE_PEER_LOGITS_REL_L2[bits]
    assert ml.relative_l2(got, ref) > 0   # the expert weights the model computes with did change


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", ["mixtral_dynamo_batched", "qwen2moe_dynamo_shared"])
def test_fixture_logits_float16_activations(fixture_runs, tmp_path, name, bits):
    """activations="float16": the QMoE node reads float16 (Casts of x, logits and, for Qwen2-MoE,
    router_weights) and the model's logits stay within float16's rounding of the float graph
    holding the same dequantized weights."""
    from ort_ops.runtime import DenseRunner

    dst, rep = fixture_runs[name, bits, "float16"]
    assert len(rep["blocks"]) == 1 and rep["blocks"][0]["activations"] == "float16"
    m = onnx.load(str(dst))
    producers = {o: n for n in m.graph.node for o in n.output}
    (qmoe,) = [n for n in m.graph.node if n.op_type == "QMoE"]
    fed = [producers[i] for i in (qmoe.input[0], qmoe.input[1], *qmoe.input[14:]) if i]
    assert all(n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT16 for n in fed)
    emu, _ = ev.emulate_qmoe(MOE_FIXTURES / f"{name}.onnx", tmp_path / "emu.onnx", bits, 4)
    ids = np.load(MOE_FIXTURES / f"{name}.npz")["input_ids"]
    for prompt in (ids, ids[:, :1]):
        got = DenseRunner(str(dst)).run(prompt, np.ones_like(prompt), None)[0]
        want = DenseRunner(str(emu)).run(prompt, np.ones_like(prompt), None)[0]
        assert got.dtype == np.float32 and np.all(np.isfinite(got))
        assert ml.relative_l2(got, want) <= QMOE_PEER_FP16_VS_DEQUANTIZED_FLOAT_REL_L2


def test_fixture_qmoe_runs_on_the_cpu_ep(fixture_runs):
    assert peers_ort.node_providers(fixture_runs["mixtral_dynamo_batched", 8][0], "QMoE",
                                    ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_sigmoid_router_declined(tmp_path):
    """DeepSeek-V3's sigmoid, group-limited, scaled routing is not what QMoE computes from logits:
    declined with the routing named, no model written."""
    dst = tmp_path / "out.onnx"
    rep = peers_ort.rewrite_to_qmoe(MOE_FIXTURES / "deepseekv3_dynamo.onnx", dst, 8)
    assert not rep["blocks"] and len(rep["declined"]) == 2
    assert all("sigmoid" in d["reason"] and "is not one QMoE computes" in d["reason"] for d in rep["declined"])
    assert not dst.exists()
    with pytest.raises(ValueError, match="bits must be one of"):
        peers_ort.rewrite_to_qmoe(MOE_FIXTURES / "deepseekv3_dynamo.onnx", dst, 3)


def _models_dir(tmp_path: Path, name: str) -> Path:
    (tmp_path / "moe.onnx").symlink_to(MOE_FIXTURES / f"{name}.onnx")
    rng = np.random.default_rng(8)
    np.save(tmp_path / "eval_tokens.npy", rng.integers(3, 64, 120).astype(np.int32))
    np.save(tmp_path / "train_tokens_head.npy", rng.integers(3, 64, 600).astype(np.int32))
    (tmp_path / "manifest.json").write_text(json.dumps({"seed": 0, "config": {"name": "fixture", "experts": 4}}))
    return tmp_path


def test_eval_rows_real_and_emulated(tmp_path):
    """evaluate(): the ORT-op row and the emulated row of the same peer are separate, labelled, and
    score the same predictions (the same dequantized weights, float32 rounding apart)."""
    d = _models_dir(tmp_path, "mixtral_dynamo_batched")
    rep = ev.evaluate(d, contexts=[40], windows=2, score=6, variants=[], block_size=16, threads=None,
                      agreement=0, peers=["qmoe8", "qmoe8 emulated"], only=["moe"], log=lambda s: None)
    m = rep["models"]["moe"]
    real, emu = m["peer QMoE 8-bit (ORT op)"], m["peer QMoE 8-bit (emulated)"]
    assert real["emulated"] is False and real["op"] == "com.microsoft.QMoE" and real["blocks"] == 1
    assert real["provider"] == ["CPUExecutionProvider"] and emu["emulated"] is True
    # |d NLL| <= 2 max |d logit| per prediction, so the means differ by at most that.
    assert abs(real["40"]["nll"] - emu["40"]["nll"]) <= 2 * QMOE_PEER_VS_DEQUANTIZED_FLOAT_ATOL
    table = ev.format_table(rep, [40])
    assert "| peer QMoE 8-bit (ORT op) |" in table and "| peer QMoE 8-bit (emulated) |" in table


def test_eval_row_says_when_the_device_cannot_run_it(tmp_path):
    """A peer whose session the device cannot create is a row with the reason, not a failed run
    (here --device cuda on an onnxruntime without the CUDA EP)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP: the refusal cannot be provoked this way")
    d = _models_dir(tmp_path, "mixtral_dynamo_batched")
    stream = np.load(d / "eval_tokens.npy")
    res = ev.run_ort_peer(d / "moe.onnx", "qmoe8", tmp_path, d, stream, [40], 2, 6, {}, device="cuda")
    assert res["error"].startswith("does not run on --device cuda: ") and "40" not in res
    table = ev.format_table({"windows": 2, "score": 6, "device": "cuda", "models": {"moe": {"peer x": res}}}, [40])
    assert "| peer x | does not run on --device cuda: " in table
    # A QMoE node the CUDA EP left to the CPU EP: scored, and the row names the EP that ran it.
    fell_back = {"provider": ["CPUExecutionProvider"], "40": {"ppl": 2.0, "delta_pct": 0.1, "delta_nll_se": 0.001}}
    table = ev.format_table({"windows": 2, "score": 6, "device": "cuda", "models": {"moe": {"peer y": fell_back}}}, [40])
    assert "| peer y [QMoE ran on CPUExecutionProvider] | 2.000 (+0.10 % +- 0.10) |" in table
    table = ev.format_table({"windows": 2, "score": 6, "device": "cpu", "models": {"moe": {"peer y": fell_back}}}, [40])
    assert "| peer y | 2.000" in table


@pytest.mark.cuda
@pytest.mark.parametrize("activations", ["float32", "float16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_fixture_qmoe_on_the_cuda_ep(fixture_runs, bits, activations):
    """With onnxruntime-gpu: the rewritten fixture on a CUDA EP session. Where the CUDA EP takes
    the QMoE node, its logits stay within the bits' rounding of the float original (full fp32, no
    TF32); where it does not, ORT runs the node on the CPU EP, which the eval's row reports, and
    this test skips naming the EP that ran it."""
    import onnxruntime as ort

    from ort_ops.runtime import DenseRunner

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu not installed)")
    cuda = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    key = ("mixtral_dynamo_batched", bits) + (() if activations == "float32" else (activations,))
    dst, _ = fixture_runs[key]
    ran_on = peers_ort.node_providers(dst, "QMoE", cuda)
    if ran_on != ["CUDAExecutionProvider"]:
        pytest.skip(f"the CUDA EP did not take the {activations} QMoE node: it ran on {ran_on}")
    ids = np.load(MOE_FIXTURES / "mixtral_dynamo_batched.npz")["input_ids"]
    mask = np.ones_like(ids)
    got = DenseRunner(str(dst), providers=cuda).run(ids, mask, None)[0]
    ref = DenseRunner(str(MOE_FIXTURES / "mixtral_dynamo_batched.onnx")).run(ids, mask, None)[0]
    assert np.all(np.isfinite(got)) and ml.relative_l2(got, ref) <= QMOE_PEER_LOGITS_REL_L2[bits]
