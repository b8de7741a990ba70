# SPDX-License-Identifier: MIT
"""GroupedMatmulSwigluQuant's Hopper wgmma kernels (weight_layout 2, [E, N, K]) against
ort_ops.reference: codes and scales bit for bit, error word, zeros past the last group.

The kernels (csrc/ops/grouped_matmul_swiglu_quant/cuda_wgmma.cu) exist for compute capability 9.x
only (sm_90a); these tests skip without a GPU, without a CUDA build, or on another GPU.

Alphabet: M rows, K reduction, N GEMM columns (N/2 outputs), E experts.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from tests.ops.test_moe_cuda import _assert_exact, _problem


def test_pack_weight_kmajor_layout(rng):
    """pack_weight_kmajor (CPU torch is enough) is the per-expert transpose [E, K, N] -> [E, N, K]."""
    torch = pytest.importorskip("torch")
    from ort_ops.testing.moe_launchers import pack_weight_kmajor

    w = rng.integers(-128, 128, (3, 48, 80), dtype=np.int8)
    p = pack_weight_kmajor(torch.from_numpy(w)).numpy()
    assert p.shape == (3, 80, 48) and p.flags.c_contiguous
    np.testing.assert_array_equal(p, w.transpose(0, 2, 1))


@pytest.fixture
def torch_sm90():
    from ort_ops.testing.moe_launchers import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason:
        pytest.skip(reason)
    import torch

    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip(f"the wgmma kernel needs compute capability 9.x (sm_90a); this GPU is {major}.{minor}")
    return torch


def _run_wgmma(torch, x, w, ws, xs, gl, group_list_type=0):
    """Launch with weight_layout 2, config bm128 (the wgmma kernel at any M; auto picks the mma.sync
    K-major path at small M: test_moe_kmajor_cuda.py) on NaN/0x55-poisoned outputs."""
    from ort_ops.testing.moe_launchers import GmsqRunner, pack_weight_kmajor

    dev = torch.device("cuda")
    t = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (x, w, ws, xs, gl)]
    t[1] = pack_weight_kmajor(t[1])
    r = GmsqRunner(*t, group_list_type=group_list_type, config="bm128", layout=2)
    r.poison()
    r.launch()
    err = r.error_word()
    return (r.y.cpu().numpy(), r.y_scale.cpu().numpy(), r.y_offset.cpu().numpy()), err


# (M, K, N, counts, tail): empty and one-row experts, M not a multiple of the 128-row tile, all
# rows in one expert, rows past the last group, N/2 not a multiple of the 128-column tile, K
# below, at and not a multiple of the 128-deep k step, the model's K = 2048 / N = 2816.
CASES = {
    "mixed": (203, 256, 320, [0, 1, 37, 0, 130, 1, 34, 0], 0),
    "one_expert": (300, 128, 256, [300], 0),
    "tail_rows": (150, 96, 160, [3, 0, 50, 1], 96),
    "k80_n96": (77, 80, 96, [20, 20, 37], 0),
    "k208_n2816": (260, 208, 2816, [129, 0, 131], 0),
    "single_row": (1, 64, 64, [0, 1], 0),
    "many_experts": (517, 128, 96, [int(c) for c in np.random.default_rng(7).integers(0, 17, 64)], 0),
    "k2048_n2816": (1000, 2048, 2816, [300, 0, 1, 421, 270], 8),
    "k16_n32": (40, 16, 32, [17, 23], 0),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
def test_gmsq_wgmma_matches_reference(torch_sm90, rng, case):
    m, k, n, counts, tail = CASES[case]
    if case == "many_experts":
        m = sum(counts) + tail
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts, tail=tail)
    got, err = _run_wgmma(torch_sm90, x, w, ws, xs, gl)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))
    if tail:
        assert not got[0][m - tail:].any() and not got[1][m - tail:].any()


@pytest.mark.cuda
def test_gmsq_wgmma_counts_type(torch_sm90, rng):
    """group_list_type 1 (counts) with empty experts and tail rows."""
    counts = [40, 0, 1, 90, 3, 0, 17, 60]
    m = sum(counts) + 5
    x, w, ws, xs, _ = _problem(rng, m, 256, 512, counts, tail=5)
    gl = np.asarray(counts, np.int64)
    got, err = _run_wgmma(torch_sm90, x, w, ws, xs, gl, group_list_type=1)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl, group_list_type=1))


@pytest.mark.cuda
def test_gmsq_wgmma_prefill_4096_tokens(torch_sm90, rng):
    """The benchmark's prefill shape once: 4096 tokens, 8 experts top-2 (M = 8192), K 2048, N 2816."""
    from benchmarks.bench_moe_cuda import routing

    counts = routing(rng, 4096, 8, 2)
    m = int(counts.sum())
    x, w, ws, xs, gl = _problem(rng, m, 2048, 2816, list(counts))
    got, err = _run_wgmma(torch_sm90, x, w, ws, xs, gl)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))


@pytest.mark.cuda
def test_gmsq_wgmma_is_deterministic(torch_sm90, rng):
    """Same inputs twice (different interleavings of the cross-CTA row max): same bits."""
    x, w, ws, xs, gl = _problem(rng, 700, 256, 2 * 640, [100, 250, 0, 350])
    first, _ = _run_wgmma(torch_sm90, x, w, ws, xs, gl)
    second, _ = _run_wgmma(torch_sm90, x, w, ws, xs, gl)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.cuda
def test_gmsq_wgmma_edge_values(torch_sm90, rng):
    """All-zero rows (scale 0, codes 0), a saturated row, a zero x_scale."""
    x, w, ws, xs, gl = _problem(rng, 40, 64, 64, [40])
    x[0] = 0
    x[1] = 127
    xs[2] = 0.0
    got, err = _run_wgmma(torch_sm90, x, w, ws, xs, gl)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))
    assert got[1][0] == 0 and not got[0][0].any() and got[1][2] == 0


@pytest.mark.cuda
def test_gmsq_wgmma_division_ranges(torch_sm90, rng):
    """Gate values outside the branch-free division's range (C < -44, |C| > 2^32, 0 < |C| < 2^-32)
    take the exact division: rows whose x_scale is scaled up or down by large factors."""
    x, w, ws, xs, gl = _problem(rng, 200, 256, 512, [90, 110])
    xs[::7] *= 50.0      # |C| up to ~1000: many C < -44 (1 + exp(-C) above 2^64)
    xs[3::7] *= 1e-12    # |C| ~ 1e-11: below 2^-32
    xs[5] = 2.0e9        # |C| above 2^32
    got, err = _run_wgmma(torch_sm90, x, w, ws, xs, gl)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))


@pytest.mark.cuda
def test_gmsq_wgmma_wide_outputs(torch_sm90, rng):
    """N/2 one 64-column tile past what the ping-pong kernel's grid holds (64 x SM count, each
    row block's column tiles co-resident): the launcher takes the cooperative 128-column kernel
    instead; bit-exact, empty expert included."""
    sms = torch_sm90.cuda.get_device_properties(0).multi_processor_count
    half = 64 * (sms + 1)  # <= 128 x SM count: the cooperative kernel's limit
    x, w, ws, xs, gl = _problem(rng, 150, 32, 2 * half, [60, 0, 90])
    got, err = _run_wgmma(torch_sm90, x, w, ws, xs, gl)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))


@pytest.mark.cuda
def test_gmsq_wgmma_reports_errors(torch_sm90, rng):
    from ort_ops.testing.moe_launchers import ERR_GROUP_LIST, ERR_NON_FINITE

    x, w, ws, xs, _ = _problem(rng, 50, 64, 64, [50])
    for gl in ([30, 10, 50], [10, 20, 500], [-5, 10, 20]):
        _, err = _run_wgmma(torch_sm90, x, w[[0, 0, 0]], ws[[0, 0, 0]], xs, np.asarray(gl, np.int64))
        assert err & ERR_GROUP_LIST, gl
    xs[3] = np.inf
    _, err = _run_wgmma(torch_sm90, x, w[[0]], ws[[0]], xs, np.asarray([50], np.int64))
    assert err & ERR_NON_FINITE
