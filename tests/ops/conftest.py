# SPDX-License-Identifier: MIT
"""Fixtures of the op tests. ``gemm_isa``: the grouped-GEMM kernel variants the MoE tests run,
tests/conftest.py's CPU ISAs with AVX-512 VNNI split in two: "avx512vnni" (ORT_OPS_CPU_AMX=0,
the VPDPBUSD tiles) and "amx" (the same ISA cap with AMX tiles, where the CPU and OS offer them)."""

from __future__ import annotations

import pytest

from tests.conftest import available_isas

GEMM_ISAS = ["scalar", "avx2", "avxvnni", "avx512vnni", "amx"]


def amx_available() -> bool:
    """AMX-INT8 as Linux reports it (the library also needs the OS to grant the tile state)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512vnni" in available_isas() and {"amx_tile", "amx_int8"} <= set(flags.split())


def use_gemm_isa(monkeypatch, isa: str) -> None:
    """Caps the kernel variant of sessions created from now on; skips if the CPU lacks it."""
    if isa == "amx":
        if not amx_available():
            pytest.skip("CPU lacks AMX-INT8")
        monkeypatch.setenv("ORT_OPS_CPU_ISA", "avx512vnni")
        monkeypatch.delenv("ORT_OPS_CPU_AMX", raising=False)
        return
    if isa not in available_isas():
        pytest.skip(f"CPU lacks {isa}")
    monkeypatch.setenv("ORT_OPS_CPU_ISA", isa)
    monkeypatch.setenv("ORT_OPS_CPU_AMX", "0")


@pytest.fixture(params=GEMM_ISAS)
def gemm_isa(request, monkeypatch):
    use_gemm_isa(monkeypatch, request.param)
    return request.param
