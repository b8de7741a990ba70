# SPDX-License-Identifier: MIT
"""The library loads into the stock onnxruntime wheel, reports its build, and the CLI works."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

import ort_ops
from ort_ops import cli
from ort_ops.ops import dynamic_quant
from ort_ops.ops._schema import single_op_model


def test_library_path_and_build_info():
    path = ort_ops.get_library_path()
    assert os.path.isfile(path)
    info = ort_ops.build_info()
    assert info["version"]
    assert info["ort_api_version"] >= 18
    assert info["min_ort_version"] == f"1.{info['ort_api_version']}"
    assert isinstance(info["cuda"], bool)
    assert set(info["cpu_isa"]) == {"avx2", "avxvnni", "avx512vnni"}
    assert info["best_cpu_isa"] in {"scalar", "avx2", "avxvnni", "avx512vnni"}


def test_only_the_c_entry_points_are_exported():
    out = subprocess.run(["nm", "-D", "--defined-only", ort_ops.get_library_path()],
                         capture_output=True, text=True, check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    ours = {n for n in names if not n.startswith("_")}
    assert {"RegisterCustomOps", "ort_ops_build_info", "ort_ops_selected_cpu_isa"} <= ours
    assert all(n.startswith(("RegisterCustomOps", "ort_ops_")) for n in ours), sorted(ours)


def test_does_not_link_onnxruntime():
    out = subprocess.run(["ldd", ort_ops.get_library_path()], capture_output=True, text=True).stdout
    assert "onnxruntime" not in out


def test_missing_library_lists_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("ORT_OPS_LIBRARY", str(tmp_path / "nope.so"))
    with pytest.raises(FileNotFoundError, match=r"tried .*nope\.so.*pip install"):
        ort_ops.get_library_path()


def test_session_options_registers_the_domain(rng):
    x = rng.standard_normal((3, 8)).astype(np.float32)
    model = single_op_model(dynamic_quant.SCHEMA, {"x": x})
    with pytest.raises(Exception, match="DynamicQuant"):  # stock session: unknown op
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    so = ort_ops.session_options(intra_op_threads=1)
    assert so.intra_op_num_threads == 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    y, s = sess.run(None, {"x": x})
    assert y.dtype == np.int8 and s.shape == (3,)


def test_cpu_isa_cap(monkeypatch):
    monkeypatch.setenv("ORT_OPS_CPU_ISA", "scalar")
    assert ort_ops._lib.selected_cpu_isa() == "scalar"
    monkeypatch.setenv("ORT_OPS_CPU_ISA", "bogus")
    assert ort_ops._lib.selected_cpu_isa() == "invalid ORT_OPS_CPU_ISA"
    monkeypatch.delenv("ORT_OPS_CPU_ISA")
    assert ort_ops._lib.selected_cpu_isa() == ort_ops.build_info()["best_cpu_isa"]


def test_cli_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "library" in out and "onnxruntime" in out and "CPU kernels" in out and "CUDA" in out
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["library_path"] == ort_ops.get_library_path()
    assert data["onnxruntime_version"] == ort.__version__


def test_cli_help_and_console_entry():
    r = subprocess.run([sys.executable, "-m", "ort_ops.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "info" in r.stdout


def test_cli_error_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ORT_OPS_LIBRARY", str(tmp_path / "missing.so"))
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ort-ops: ") and "\n" not in err


@pytest.mark.cuda
def test_cuda_selftest_runs_an_int8_mma():
    """On a GPU: the toolchain proof kernel (u8 x s8 m16n8k32, all 255 x all 127) gives
    32 * 255 * 127 = 1,036,320 exactly."""
    if not ort_ops.build_info()["cuda"]:
        pytest.skip("library built without CUDA")
    lib = ctypes.CDLL(ort_ops.get_library_path())
    out = ctypes.c_int(0)
    err = lib.ort_ops_cuda_selftest(0, ctypes.byref(out))
    if err == 100 or err == 35:  # cudaErrorNoDevice / cudaErrorInsufficientDriver
        pytest.skip(f"no usable CUDA device (cudaError {err})")
    assert err == 0
    assert out.value == 32 * 255 * 127
