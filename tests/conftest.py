# SPDX-License-Identifier: MIT
"""Shared fixtures: fresh random data per test, the CPU ISA variants to exercise, GPU skips."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Hypothesis profiles of the property tests (tests/property/). "ci", the default: derandomized (a
# fixed seed per test, no example database), so every CI run tries the same few hundred cases per
# op. "long" (`pytest tests/property --hypothesis-profile=long`): ten thousand random cases per
# test, for a soak run whose figures go in the notes. No deadline: a case's time depends on its
# shapes and on the machine, and timing is not what these tests check.
_HYPOTHESIS_COMMON = dict(deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=200, derandomize=True, database=None, **_HYPOTHESIS_COMMON)
settings.register_profile("long", max_examples=10_000, **_HYPOTHESIS_COMMON)
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--long-runs", action="store_true", default=False,
                     help="run the long-run tests at full length (tests/test_long_runs.py: 10,000 paged "
                          "runtime steps instead of 1,000)")


def pytest_report_header(config):
    try:
        import ort_ops

        info = ort_ops.build_info()
        return [f"ort_ops library: {ort_ops.get_library_path()}", f"ort_ops build: {info}"]
    except Exception as e:  # the tests themselves report the failure
        return [f"ort_ops library: not loadable ({e})"]


@pytest.fixture
def rng(request):
    """Fresh random data each run (seed printed on failure through the test id and this seed)."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


def available_isas() -> list[str]:
    import ort_ops

    order = ["scalar", "avx2", "avxvnni", "avx512vnni"]
    best = ort_ops.build_info()["best_cpu_isa"]
    return order[: order.index(best) + 1]


@pytest.fixture(params=["scalar", "avx2", "avxvnni", "avx512vnni"])
def cpu_isa(request, monkeypatch):
    """Runs the test once per CPU kernel variant this machine supports (ORT_OPS_CPU_ISA caps the
    choice when the session is created); unsupported variants skip with the reason."""
    if request.param not in available_isas():
        pytest.skip(f"CPU lacks {request.param}")
    monkeypatch.setenv("ORT_OPS_CPU_ISA", request.param)
    return request.param


def use_isa(monkeypatch, isa: str) -> None:
    """Caps the kernel variant of sessions created from now on; skips if the CPU lacks it."""
    if isa not in available_isas():
        pytest.skip(f"CPU lacks {isa}")
    monkeypatch.setenv("ORT_OPS_CPU_ISA", isa)
