# SPDX-License-Identifier: MIT
"""``--device cpu|cuda`` of ``ort-ops verify`` and ``ort-ops bench`` (issue 18), in process."""

from __future__ import annotations

import json
import pathlib

import onnxruntime as ort
import pytest

from ort_ops.cli import build_parser, main

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "attention" / "tx_sdpa_kv.onnx"


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_device_flag_parses(command):
    p = build_parser()
    assert p.parse_args([command, "a.onnx", "b.onnx"]).device == "cpu"
    assert p.parse_args([command, "a.onnx", "b.onnx", "--device", "cuda"]).device == "cuda"
    with pytest.raises(SystemExit) as e:
        p.parse_args([command, "a.onnx", "b.onnx", "--device", "tpu"])
    assert e.value.code == 2


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    out = tmp_path_factory.mktemp("dev") / "out.onnx"
    assert main(["rewrite", "--quiet", str(FIXTURE), str(out)]) == 0
    return out


def test_verify_and_bench_on_cpu_report_the_device(rewritten, capsys):
    capsys.readouterr()
    assert main(["verify", "--quiet", "--device", "cpu", str(FIXTURE), str(rewritten), "--json",
                 "--max-new-tokens", "8"]) == 0
    v = json.loads(capsys.readouterr().out)
    assert v["passed"] and v["device"] == "cpu" and v["overall"]["token_agreement"] >= 0.95
    assert main(["bench", str(FIXTURE), str(rewritten), "--device", "cpu", "--json", "--repeat", "1",
                 "--new-tokens", "3", "--prompt-len", "12", "--batch", "2", "--max-step-tokens", "5"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device"] == "cpu" and r["original"]["new_tokens"] == r["rewritten"]["new_tokens"] == 6


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="this onnxruntime has the CUDA EP: nothing to refuse")
@pytest.mark.parametrize("command", ["verify", "bench"])
def test_device_cuda_without_cuda_ep_is_one_line_exit_2(rewritten, command, capsys):
    capsys.readouterr()
    assert main([command, "--device", "cuda", str(FIXTURE), str(rewritten)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ort-ops: ") and "\n" not in err and "CUDAExecutionProvider" in err
