# SPDX-License-Identifier: MIT
"""``ort-ops rewrite``, ``verify`` and ``bench`` on hostile files: truncated, corrupt and empty
models, a model whose external data file is missing or cut short, a model without the inputs a
decoder needs, and an output path that cannot be written. Each is one line on stderr
("ort-ops: ..." naming the file), exit 2, no traceback, and no output file (nor a temporary one)
left behind, also when the save itself fails halfway."""

from __future__ import annotations

import pathlib

import onnx
import pytest
from onnx import TensorProto, helper
from onnx.external_data_helper import convert_model_to_external_data

from ort_ops.cli import main

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "attention" / "tx_sdpa_kv.onnx"


def _one_line_exit_2(capsys, argv, *fragments):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("ort-ops: ") or "..." not in line]  # progress lines
    assert len(err) == 1, f"expected one error line, got {err}"
    assert err[0].startswith("ort-ops: ") and "Traceback" not in err[0]
    for f in fragments:
        assert f in err[0], f"{f!r} not in {err[0]!r}"
    return err[0]


def _hostile(tmp_path, kind) -> pathlib.Path:
    p = tmp_path / f"{kind}.onnx"
    data = FIXTURE.read_bytes()
    if kind == "truncated":
        p.write_bytes(data[: len(data) // 3])
    elif kind == "corrupt":
        p.write_bytes(bytes((b * 7 + 13) % 256 for b in data[:4096]))
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind in ("external_missing", "external_short"):
        m = onnx.load(str(FIXTURE))
        convert_model_to_external_data(m, all_tensors_to_one_file=True, location=f"{kind}.onnx.data", size_threshold=0)
        onnx.save(m, str(p))
        d = tmp_path / f"{kind}.onnx.data"
        if kind == "external_missing":
            d.unlink()
        else:
            d.write_bytes(d.read_bytes()[:1000])
    return p


HOSTILE = {"truncated": "not a readable ONNX model", "corrupt": "not a readable ONNX model",
           "empty": "is empty", "external_missing": "which is missing", "external_short": "is shorter than"}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_rewrite_hostile_input(tmp_path, capsys, kind):
    src = _hostile(tmp_path, kind)
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    _one_line_exit_2(capsys, ["rewrite", "--quiet", str(src), str(out)], HOSTILE[kind], kind)
    assert list(out.parent.iterdir()) == []  # no output, no temporary file


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["verify", "bench"])
@pytest.mark.parametrize("which", ["original", "rewritten"])
def test_verify_and_bench_hostile_input(tmp_path, capsys, kind, command, which):
    bad = _hostile(tmp_path, kind)
    pair = [str(bad), str(FIXTURE)] if which == "original" else [str(FIXTURE), str(bad)]
    argv = [command, *pair] + (["--quiet"] if command == "verify" else ["--repeat", "1", "--new-tokens", "2"])
    _one_line_exit_2(capsys, argv, HOSTILE[kind], kind)


def _model_without_decoder_inputs(path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_model_without_expected_inputs(tmp_path, capsys, command):
    """A valid model that is no decoder (no input_ids): verify and bench refuse it by name;
    rewrite has nothing to fuse in it and says so (exit 0, the model unchanged)."""
    other = tmp_path / "relu.onnx"
    _model_without_decoder_inputs(other)
    argv = [command, str(FIXTURE), str(other)] + (["--quiet"] if command == "verify" else ["--repeat", "1"])
    _one_line_exit_2(capsys, argv, "no input_ids input")


def test_rewrite_of_a_model_without_expected_inputs_fuses_nothing(tmp_path, capsys):
    other = tmp_path / "relu.onnx"
    _model_without_decoder_inputs(other)
    assert main(["rewrite", "--quiet", str(other), str(tmp_path / "o.onnx")]) == 0
    assert "attention: 0 block(s) fused" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["missing_dir", "parent_is_a_file", "target_is_a_dir"])
def test_rewrite_unwritable_output(tmp_path, capsys, where):
    if where == "missing_dir":
        out = tmp_path / "no" / "such" / "dir" / "o.onnx"
    elif where == "parent_is_a_file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "o.onnx"
    else:
        out = tmp_path / "adir"
        out.mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    _one_line_exit_2(capsys, ["rewrite", "--quiet", str(FIXTURE), str(out)], "cannot write", str(out))
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_failed_save_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    """A save that dies after writing part of the model (disk full) leaves neither the output
    nor its temporary file, and an existing output keeps its old bytes."""
    import onnx_ir as ir

    def half_then_fail(model, path, **kw):
        pathlib.Path(path).write_bytes(b"\x08\x0a" * 1000)
        raise OSError(28, "No space left on device")

    out = tmp_path / "o.onnx"
    out.write_bytes(b"old model")
    monkeypatch.setattr(ir, "save", half_then_fail)
    _one_line_exit_2(capsys, ["rewrite", "--quiet", str(FIXTURE), str(out)], "cannot write", "No space left")
    assert [p.name for p in tmp_path.iterdir()] == ["o.onnx"] and out.read_bytes() == b"old model"
