# SPDX-License-Identifier: MIT
"""``ort-ops rewrite`` and ``ort-ops verify`` end to end on a bundled fixture (in process)."""

from __future__ import annotations

import json
import pathlib

import pytest

from ort_ops.cli import main

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "attention" / "tx_sdpa_kv.onnx"


def test_rewrite_then_verify(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # Two norms a layer and the final one; Q/K/V and gate/up joined, RoPE of Q and K, the MLP's
    # SwiGLU and the attention prologue (Split, RoPE, QuantizeKVCache) in each of the two layers.
    assert report["fused"] == {"moe": 0, "attention": 2, "rotary": 4, "rmsnorm": 5, "matmul_concat": 4,
                               "swiglu": 2, "rotary_kv": 2}
    att = next(r for r in report["results"] if r["kind"] == "attention")
    assert att["details"]["interface"] == "paged" and att["declined"] == []
    assert main(["verify", "--quiet", str(FIXTURE), str(out), "--json", "--max-new-tokens", "16"]) == 0
    v = json.loads(capsys.readouterr().out)
    for key in ("token_agreement", "logits_max_abs_err", "length_match", "eos_match"):
        assert key in v["overall"] and all(key in p for p in v["prompts"])
    assert v["passed"] and v["rewritten_interface"] == "paged" and len(v["prompts"]) == 4


def test_rewrite_text_report_and_flags(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out), "--block-size", "32", "--pv-quant", "u8"]) == 0
    text = capsys.readouterr().out
    assert "attention: 2 block(s) fused (matmul: 2), interface: paged" in text
    assert "rmsnorm: 5 block(s) fused" in text
    assert "rotary: 4 block(s) fused (rotate_half: 4)" in text
    assert "swiglu: 2 block(s) fused (sigmoid_mul: 2)" in text
    assert "rotary_kv: 2 block(s) fused" in text and "declined" not in text
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out), "--no-attention", "--no-norms", "--no-concat-matmuls",
                 "--no-rotary", "--no-swiglu", "--no-rotary-kv", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fused"] == {"moe": 0}


def test_verify_fails_on_a_wrong_model(tmp_path, capsys):
    """A 'rewritten' model whose lm_head is negated decodes other tokens: exit 1, FAIL; a
    truncated file: exit 2."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(FIXTURE))
    last = next(n for n in m.graph.node if "logits" in n.output)
    inits = {t.name: t for t in m.graph.initializer}
    w = next(i for i in last.input if i in inits)
    inits[w].CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(inits[w]), w))
    wrong = tmp_path / "wrong.onnx"
    onnx.save(m, str(wrong))
    assert main(["verify", "--quiet", str(FIXTURE), str(wrong), "--max-new-tokens", "8"]) == 1
    assert "FAIL" in capsys.readouterr().out
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(FIXTURE.read_bytes()[:1000])
    assert main(["verify", "--quiet", str(FIXTURE), str(bad)]) == 2


@pytest.mark.parametrize("args", [["rewrite", "/nonexistent.onnx", "x.onnx"], ["verify", "/nonexistent.onnx", "y"]])
def test_missing_model_one_line_error(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ort-ops: ") and "not found" in err[-1]


def test_unreadable_model_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    assert main(["rewrite", str(bad), str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ort-ops: ") and "not a readable ONNX model" in err[-1]


def test_verify_moe_only_rewrite_runs_dense(tmp_path, capsys):
    """A rewrite without paged attention (MoE only) is verified by running both models through
    the same left-padded generation loop (the rewritten one with the library registered)."""
    moe = sorted((FIXTURE.parent.parent / "moe").glob("*_kv.onnx"))
    if not moe:
        pytest.skip("no MoE fixture with a KV cache in tests/fixtures/moe")
    out = tmp_path / "moe_only.onnx"
    assert main(["rewrite", "--quiet", "--no-attention", str(moe[0]), str(out), "--json"]) == 0
    assert "attention" not in json.loads(capsys.readouterr().out)["fused"]
    main(["verify", "--quiet", "--json", "--max-new-tokens", "8", str(moe[0]), str(out)])
    v = json.loads(capsys.readouterr().out)
    assert v["rewritten_interface"] == "dense"
    assert v["overall"]["logits_max_abs_err"] < 1.0 and v["overall"]["length_match"]


def test_bench_reports_both_models(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out)]) == 0
    capsys.readouterr()
    assert main(["bench", str(FIXTURE), str(out), "--json", "--repeat", "1", "--new-tokens", "4",
                 "--prompt-len", "8", "--batch", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["original"]["new_tokens"] == r["rewritten"]["new_tokens"] == 8
    assert r["speedup"] > 0 and r["kv_bytes_per_token"]["int8_paged"] < r["kv_bytes_per_token"]["original"]
    assert r["kv_bytes_per_token"]["original_dtype"] == "float32"


def test_verify_runs_a_bfloat16_pair_through_float32_twins(tmp_path, capsys):
    """onnxruntime's CPU EP has no bfloat16 MatMul: verify runs both models' float32 twins and
    says so; the bf16 fixture's rewrite passes as its fp32 sibling does."""
    src = FIXTURE.parent / "dynamo_sdpa_kv_bf16.onnx"
    out = tmp_path / "out.onnx"
    assert main(["rewrite", "--quiet", str(src), str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", str(src), str(out), "--json", "--max-new-tokens", "8"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["bfloat16"].startswith("both models as their float32 twins")
    assert v["rewritten_interface"] == "paged" and v["overall"]["token_agreement"] >= 0.95


def test_rewrite_swiglu_is_on_by_default_and_no_swiglu_turns_it_off(tmp_path, capsys):
    """The SwiGLU pass runs by default after the joined projections (one block a layer), as with
    --swiglu; with --no-swiglu the report has no swiglu entry and the model no SwiGLU node."""
    import onnx

    out = tmp_path / "out.onnx"
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out)]) == 0
    assert "swiglu: 2 block(s) fused (sigmoid_mul: 2)" in capsys.readouterr().out
    assert sum(n.op_type == "SwiGLU" for n in onnx.load(str(out)).graph.node) == 2
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out), "--swiglu"]) == 0
    assert "swiglu: 2 block(s) fused (sigmoid_mul: 2)" in capsys.readouterr().out
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out), "--no-swiglu", "--json"]) == 0
    assert "swiglu" not in json.loads(capsys.readouterr().out)["fused"]
    assert not any(n.op_type == "SwiGLU" for n in onnx.load(str(out)).graph.node)


def test_rewrite_rotary_kv_is_on_by_default_and_no_rotary_kv_turns_it_off(tmp_path, capsys):
    """The RotaryQuantizeKVCache pass runs by default after the others (one block a layer), as
    with --rotary-kv; with --no-rotary it declines every layer (no RotaryEmbedding to take); with
    --no-rotary-kv the report has no rotary_kv entry and the model keeps its QuantizeKVCaches."""
    import onnx

    def ops(path):
        return [n.op_type for n in onnx.load(str(path)).graph.node]

    out = tmp_path / "out.onnx"
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out)]) == 0
    text = capsys.readouterr().out
    assert "rotary_kv: 2 block(s) fused" in text and "declined" not in text
    assert ops(out).count("RotaryQuantizeKVCache") == 2 and "QuantizeKVCache" not in ops(out)
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out), "--rotary-kv"]) == 0
    assert "rotary_kv: 2 block(s) fused" in capsys.readouterr().out
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out), "--no-rotary", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fused"]["rotary_kv"] == 0 and report["declined"]["rotary_kv"] == 2
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out), "--no-rotary-kv", "--json"]) == 0
    assert "rotary_kv" not in json.loads(capsys.readouterr().out)["fused"]
    assert ops(out).count("QuantizeKVCache") == 2 and "RotaryQuantizeKVCache" not in ops(out)
