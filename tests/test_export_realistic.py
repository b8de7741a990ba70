# SPDX-License-Identifier: MIT
"""graphs/export_realistic.py at its tiny size (issue 18): the export equals the torch model it
came from, has the documented KV-cache interface in the asked dtype, and rewrites to a paged
model that decodes like it. Needs torch and transformers, which CI does not install (skipped
there with the reason); each export takes a minute or two on two cores.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (CI stays light; pip install torch transformers)")
pytest.importorskip("transformers", reason="transformers not installed")

from graphs.export_realistic import SHAPES, build, main, make_config  # noqa: E402


def test_presets_have_the_issue_shapes():
    llama = make_config("llama")
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.head_dim, llama.intermediate_size, llama.vocab_size) == (16, 2048, 32, 8, 64, 8192, 32000)
    moe = make_config("qwen_moe")
    assert (moe.hidden_size, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (2048, 60, 4, 1408)
    assert moe.num_hidden_layers >= 8 and moe.shared_expert_intermediate_size > 0
    tiny = make_config("llama", tiny=True, layers=1, vocab=100)
    assert tiny.num_hidden_layers == 1 and tiny.vocab_size == 100 and tiny.head_dim == 64
    assert set(SHAPES) == {(f, t) for f in ("llama", "qwen_moe") for t in (False, True)}
    with pytest.raises(ValueError, match="family must be one of"):
        make_config("gpt")


def test_cli_documents_the_tiny_fp32_build(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--tiny" in out and "--dtype" in out and "fp32" in out and "--layers" in out and "--vocab" in out


@pytest.mark.slow
def test_tiny_fp32_llama_export_matches_torch_and_rewrites_to_paged(tmp_path):
    import onnx
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    from ort_ops.rewrite import rewrite_model
    from ort_ops.runtime import generate, paged_metadata
    from tests.tolerances import ATTN_REWRITE_GREEDY_AGREEMENT, EXPORT_VS_TORCH_FP32_ATOL

    path = build("llama", tmp_path, dtype="fp32", tiny=True, layers=1, vocab=128)
    m = onnx.load(str(path))
    ins = {i.name: i.type.tensor_type.elem_type for i in m.graph.input}
    outs = {o.name: o.type.tensor_type.elem_type for o in m.graph.output}
    assert list(ins)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert ins["past_key_values.0.key"] == ins["past_key_values.0.value"] == onnx.TensorProto.FLOAT
    assert outs["logits"] == outs["present.0.key"] == onnx.TensorProto.FLOAT

    # The export computes what the checkpoint saved beside it computes in torch.
    ids = np.random.default_rng(0).integers(3, 128, (1, 9))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(9)[None],
             "past_key_values.0.key": np.zeros((1, 2, 0, 64), np.float32),
             "past_key_values.0.value": np.zeros((1, 2, 0, 64), np.float32)}
    got = sess.run(["logits"], feeds)[0]
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "checkpoint")).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert np.isfinite(got).all()
    print(f"export vs torch: max abs {np.max(np.abs(got - want)):.3g}, max |logit| {np.max(np.abs(want)):.3g}")
    np.testing.assert_allclose(got, want, atol=EXPORT_VS_TORCH_FP32_ATOL, rtol=0)

    # ...and rewrites to a paged model whose greedy tokens follow the original's (teacher-forced).
    out, results = rewrite_model(str(path), str(tmp_path / "model.int8.onnx"), block_size=16)
    assert {r.kind: r.fused for r in results}["attention"] == 1
    assert paged_metadata(str(tmp_path / "model.int8.onnx"))["num_layers"] == 1
    prompts = [[5, 9, 17, 33], list(range(3, 20))]
    orig = generate(str(path), prompts, max_new_tokens=12)
    forced = generate(str(tmp_path / "model.int8.onnx"), prompts, forced_tokens=[g.tokens for g in orig],
                      cache_on_device=True)
    agree = np.mean([a == b for g, f in zip(orig, forced) for a, b in zip(g.tokens, f.tokens)])
    print(f"teacher-forced agreement {agree:.3f}")
    assert agree >= ATTN_REWRITE_GREEDY_AGREEMENT, agree


@pytest.mark.slow
def test_tiny_fp16_moe_export_is_fp16(tmp_path):
    import onnx

    path = build("qwen_moe", tmp_path, dtype="fp16", tiny=True, layers=1, vocab=128, checkpoint=False)
    m = onnx.load(str(path), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.output]}
    assert types["past_key_values.0.key"] == types["logits"] == types["present.0.value"] == onnx.TensorProto.FLOAT16
    props = {p.key: p.value for p in m.metadata_props}
    assert props["ort_ops.family"] == "qwen_moe" and props["ort_ops.dtype"] == "fp16"
    assert not (tmp_path / "checkpoint").exists()


def test_set_overrides_config_keywords(capsys):
    cfg = make_config("qwen_moe", tiny=True, overrides={"num_experts": 16, "hidden_size": 128})
    assert (cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok) == (16, 128, 4)
    with pytest.raises(SystemExit):
        main(["qwen_moe", "--out", "/nonexistent", "--set", "num_experts"])
    assert "KEY=VALUE" in capsys.readouterr().err


def _slices_graph():
    """Two Slices of one input (SlicesSplit's pattern), among other ops, for the matcher checks."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])
    inits = [numpy_helper.from_array(np.array(v, np.int64), n)
             for n, v in (("s0", [0]), ("e0", [4]), ("s1", [4]), ("e1", [8]), ("ax", [1]))]
    nodes = [helper.make_node("Slice", ["x", "s1", "e1", "ax"], ["b"]),
             helper.make_node("Slice", ["x", "s0", "e0", "ax"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Mul", ["r", "b"], ["y"])]
    return ir.from_proto(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                                           opset_imports=[helper.make_opsetid("", 18)]))


def test_fast_multi_output_matching_answers_as_the_matcher_does():
    """Every rule of onnxscript's optimizer whose pattern has several output nodes matches (or
    not) each node of a graph the same inside fast_multi_output_matching as outside it; the
    matcher's own method is back afterwards."""
    pytest.importorskip("onnxscript")
    from onnxscript.rewriter import _DEFAULT_REWRITE_RULES, _matcher

    from graphs.export_realistic import fast_multi_output_matching

    rules = [r for r in _DEFAULT_REWRITE_RULES if not r._target_pattern.has_single_output_node]
    assert rules  # SlicesSplit at least: what the context is for
    model = _slices_graph()

    def answers():
        return [(r.name, n.op_type, bool(r.match(model, model.graph, n))) for r in rules for n in model.graph]

    original = _matcher.SimplePatternMatcher.match
    plain = answers()
    with fast_multi_output_matching():
        assert _matcher.SimplePatternMatcher.match is not original
        fast = answers()
    assert _matcher.SimplePatternMatcher.match is original
    assert fast == plain
    assert any(op == "Slice" for _, op, _ in plain) and any(op != "Slice" for _, op, _ in plain)


@pytest.mark.slow
def test_fast_matching_leaves_the_transformers_export_unchanged(tmp_path, monkeypatch):
    """transformers' exporter of the tiny Qwen-MoE (its per-expert graph) writes the same graph
    and weights with fast_multi_output_matching as with onnxscript's matcher as it is."""
    import contextlib

    import onnx

    import graphs.export_realistic as er

    kw = dict(dtype="fp32", tiny=True, layers=1, vocab=128, exporter="transformers", checkpoint=False)
    fast = onnx.load(str(build("qwen_moe", tmp_path / "fast", **kw)))
    monkeypatch.setattr(er, "fast_multi_output_matching", contextlib.nullcontext)
    plain = onnx.load(str(build("qwen_moe", tmp_path / "plain", **kw)))
    assert len(fast.graph.node) > 100  # the per-expert form, 8 experts unrolled
    assert [(n.op_type, list(n.input), list(n.output)) for n in fast.graph.node] == \
        [(n.op_type, list(n.input), list(n.output)) for n in plain.graph.node]
    assert [(n.name, n.attribute) for n in fast.graph.node] == [(n.name, n.attribute) for n in plain.graph.node]
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in plain.graph.initializer}
    assert sorted(inits) == sorted(t.name for t in fast.graph.initializer)
    for t in fast.graph.initializer:
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(t), inits[t.name])
