# SPDX-License-Identifier: MIT
"""GroupedMatmulSwigluQuant's mma.sync kernels on weight_layout 2 ([E, N, K], K-major): the tiled
kernel's K-major path and the K-major weight stream (config "stream", cuda_stream.cu), which
launch_gmsq picks for layout 2 below 32 rows an expert (the wgmma kernel above).

Two kinds of test:
- CPU model of the K-major B tile (runs in CI): the load plan's smem rows, the ldmatrix reads and
  the column relabelling the (unchanged) epilogue relies on, checked with ort_ops.fragments'
  table of m16n8k32, and the bank-conflict claim of the kernel's comment.
- GPU tests: codes and scales bit for bit against ort_ops.reference in every K-major config
  (bm16, bm16w, bm32, bm64, stream) on awkward shapes, and the auto dispatch at 16 / 256 / 4096
  tokens.

Alphabet: M rows, K reduction, N GEMM columns (N/2 outputs), E experts.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import fragments as fr
from ort_ops import reference
from tests.ops import test_moe_cuda as _moe
from tests.ops.test_moe_cuda import CASES, _assert_exact, _problem

BK = 64
WARPS_N_CHOICES = (2, 4)  # 64 (bm16, bm32) or 128 (bm16w, bm64) output columns per tile


def _smem_row(j: int, bnh: int) -> int:
    """Shared-memory row of the B tile's GEMM column j (gate half 0..bnh-1, up half bnh..2bnh-1):
    physical column c of a warp's 32 sits in row (c % 4) * 8 + c // 4."""
    q, jh = divmod(j, bnh)
    w, c = divmod(jh, 32)
    return q * bnh + w * 32 + (c % 4) * 8 + c // 4


def _col_of_row(sr: int, bnh: int) -> int:
    """The load plan's inverse (kernel: hcol = ... (pr & 7) * 4 + (pr >> 3))."""
    pr = sr % 32
    return (sr // bnh) * bnh + (sr % bnh) // 32 * 32 + (pr & 7) * 4 + (pr >> 3)


def _smem_offset(sr: int, ch: int) -> int:
    return sr * BK + ((ch ^ ((sr >> 1) & 3)) << 4)


def _lane_off(wn: int, lane: int) -> int:
    """kb_off in the kernel (ldmatrix row address of `lane` for n8 tiles 0/1, k step half 0)."""
    sr = wn * 32 + (lane >> 4) * 8 + (lane & 7)
    return sr * BK + ((((lane >> 3) & 1) ^ ((sr >> 1) & 3)) << 4)


@pytest.mark.parametrize("warps_n", WARPS_N_CHOICES)
def test_kmajor_tile_rows_and_swizzle_are_bijections(warps_n):
    bnh = 32 * warps_n
    assert sorted(_col_of_row(sr, bnh) for sr in range(2 * bnh)) == list(range(2 * bnh))
    assert all(_smem_row(_col_of_row(sr, bnh), bnh) == sr for sr in range(2 * bnh))
    offs = sorted(_smem_offset(sr, ch) for sr in range(2 * bnh) for ch in range(4))
    assert offs == list(range(0, 2 * bnh * BK, 16))


@pytest.mark.parametrize("warps_n", WARPS_N_CHOICES)
def test_kmajor_ldmatrix_feeds_the_mma_the_layout0_columns(rng, warps_n):
    """ldmatrix.x4 number q2 at (kb_off ^ 32 kb) + (16 (q2 & 1) + bnh (q2 >> 1)) rows gives the B
    registers of n8 tiles 2 q2, 2 q2 + 1 whose fragment column g is physical column
    half * bnh + wn * 32 + 4 g + i (tile nt = 4 half + i): layout 0's relabelling, so the epilogue's
    column mapping is unchanged."""
    tgt = fr.TARGETS["nvidia_m16n8k32"]
    bnh = 32 * warps_n
    w_nk = rng.integers(-128, 128, (2 * bnh, BK), dtype=np.int8)  # B tile, [column][k]
    smem = bytearray(2 * bnh * BK)
    for sr in range(2 * bnh):  # load_stage: smem row sr <- global column _col_of_row(sr)
        for ch in range(4):
            off = _smem_offset(sr, ch)
            smem[off:off + 16] = w_nk[_col_of_row(sr, bnh), ch * 16:ch * 16 + 16].tobytes()
    for wn in range(warps_n):
        for kb in range(2):
            for q2 in range(4):
                addr = [(_lane_off(wn, lane) ^ (kb << 5)) + ((q2 & 1) * 16 + (q2 >> 1) * bnh) * BK
                        for lane in range(32)]
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for mi in range(4):  # r[mi] = b[2 q2 + mi // 2][mi % 2]
                        src = addr[8 * mi + g]
                        reg = np.frombuffer(bytes(smem[src + 4 * t:src + 4 * t + 4]), np.int8)
                        nt, h = 2 * q2 + mi // 2, mi % 2
                        half, i = divmod(nt, 4)
                        for byte in range(4):
                            k, col = tgt.b[lane][h][byte]
                            phys = half * bnh + wn * 32 + 4 * col + i
                            assert reg[byte] == w_nk[phys, kb * 32 + k], (wn, kb, q2, lane, mi)


@pytest.mark.parametrize("warps_n", WARPS_N_CHOICES)
def test_kmajor_ldmatrix_is_bank_conflict_free(warps_n):
    bnh = 32 * warps_n
    for wn in range(warps_n):
        for kb in range(2):
            for q2 in range(4):
                for phase in range(4):
                    quads = {(((_lane_off(wn, l) ^ (kb << 5)) + ((q2 & 1) * 16 + (q2 >> 1) * bnh) * BK) // 16) % 8
                             for l in range(8 * phase, 8 * phase + 8)}
                    assert len(quads) == 8


def test_kmajor_stream_fragments_take_every_k_once(rng):
    """gmsq_stream_km_kernel's register fragments (cuda_stream.cu): lane (g, t) loads 16 bytes
    k = 16 t .. 16 t + 15 of B column g and of A rows g, g + 8 for one 64-deep k step; MMA h takes
    its words 2 h, 2 h + 1 (A as {row g, row g + 8, row g, row g + 8}). Through the m16n8k32 table,
    each MMA's logical (row, k) and (k, column) slots must hold one physical k, the same one in A
    and in B, every physical k of the step once over the two MMAs, so that the two int32 sums are
    the step's exact product."""
    tgt = fr.TARGETS["nvidia_m16n8k32"]
    x = rng.integers(-128, 128, (16, 64), dtype=np.int64)
    w_nk = rng.integers(-128, 128, (8, 64), dtype=np.int64)  # B, [column][k]
    taken = np.zeros((8, 64), np.int64)
    total = np.zeros((16, 8), np.int64)
    for h in range(2):
        a_phys, b_phys = {}, {}  # logical slot -> physical k
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            words = [16 * t + 4 * i for i in range(4)]  # first physical k of each loaded word
            a_regs = [(g, words[2 * h]), (g + 8, words[2 * h]), (g, words[2 * h + 1]), (g + 8, words[2 * h + 1])]
            for reg, (row, k0) in enumerate(a_regs):
                for byte in range(4):
                    lrow, lk = tgt.a[lane][reg][byte]
                    assert lrow == row
                    a_phys[(lrow, lk)] = k0 + byte
            for reg in range(2):
                for byte in range(4):
                    lk, col = tgt.b[lane][reg][byte]
                    assert col == g
                    b_phys[(lk, col)] = words[2 * h + reg] + byte
        assert len(a_phys) == 16 * 32 and len(b_phys) == 32 * 8
        for (lk, col), pk in b_phys.items():
            taken[col, pk] += 1
            for row in range(16):
                assert a_phys[(row, lk)] == pk  # the same relabelling in A and in B
                total[row, col] += x[row, pk] * w_nk[col, pk]
    assert (taken == 1).all()
    np.testing.assert_array_equal(total, x @ w_nk.T)


# ---- GPU ----

KM_CONFIGS = ["bm16", "bm16w", "bm32", "bm64", "stream"]
torch_cuda = _moe.torch_cuda  # the fixture: skips without torch, a GPU or a CUDA build


def _run_km(torch, x, w, ws, xs, gl, config, group_list_type=0):
    """weight_layout 2 on NaN/0x55-poisoned outputs: (y, y_scale, y_offset), err."""
    from ort_ops.testing.moe_launchers import GmsqRunner, pack_weight_kmajor

    dev = torch.device("cuda")
    t = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (x, w, ws, xs, gl)]
    t[1] = pack_weight_kmajor(t[1])
    r = GmsqRunner(*t, group_list_type=group_list_type, config=config, layout=2)
    r.poison()
    r.launch()
    err = r.error_word()
    return (r.y.cpu().numpy(), r.y_scale.cpu().numpy(), r.y_offset.cpu().numpy()), err


# test_moe_cuda's cases (empty / one-row experts, M not a tile multiple, all rows in one expert,
# tail rows, K = 80 and K = 2000 partial k steps, N/2 below one tile, several rounds of row blocks)
# plus the smallest N (one 16-column half) and the model's N at K 2048 with uneven experts.
KM_CASES = dict(CASES)
KM_CASES["k16_n32"] = (40, 16, 32, [17, 23], 0)
KM_CASES["k2048_n2816"] = (200, 2048, 2816, [30, 0, 1, 121, 40], 8)


@pytest.mark.cuda
@pytest.mark.parametrize("config", KM_CONFIGS)
@pytest.mark.parametrize("case", list(KM_CASES))
def test_gmsq_kmajor_matches_reference(torch_cuda, rng, case, config):
    m, k, n, counts, tail = KM_CASES[case]
    if case == "many_experts":
        m = sum(counts) + tail
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts, tail=tail)
    got, err = _run_km(torch_cuda, x, w, ws, xs, gl, config)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))
    if tail:
        assert not got[0][m - tail:].any() and not got[1][m - tail:].any()


@pytest.mark.cuda
@pytest.mark.parametrize("config", ["bm16", "bm64", "stream"])
def test_gmsq_kmajor_counts_and_errors(torch_cuda, rng, config):
    """group_list_type 1, a bad group_list (error word, no fault), a non-finite x_scale."""
    from ort_ops.testing.moe_launchers import ERR_GROUP_LIST, ERR_NON_FINITE

    counts = [40, 0, 1, 90, 3, 0, 17, 60]
    m = sum(counts) + 5
    x, w, ws, xs, _ = _problem(rng, m, 256, 512, counts, tail=5)
    gl = np.asarray(counts, np.int64)
    got, err = _run_km(torch_cuda, x, w, ws, xs, gl, config, group_list_type=1)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl, group_list_type=1))
    x, w, ws, xs, _ = _problem(rng, 50, 64, 64, [50])
    _, err = _run_km(torch_cuda, x, w[[0, 0, 0]], ws[[0, 0, 0]], xs, np.asarray([30, 10, 50], np.int64), config)
    assert err & ERR_GROUP_LIST
    xs[3] = np.inf
    _, err = _run_km(torch_cuda, x, w[[0]], ws[[0]], xs, np.asarray([50], np.int64), config)
    assert err & ERR_NON_FINITE


def _kernel_names(torch, fn):
    """Names of the CUDA kernels fn() launches (torch profiler / CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.cuda
@pytest.mark.parametrize("experts,topk,tokens", [(8, 2, 16), (64, 8, 16), (8, 2, 256), (64, 8, 256),
                                                 (8, 2, 4096)])
def test_gmsq_layout2_auto_dispatch(torch_cuda, rng, experts, topk, tokens):
    """Layout 2, auto config, the benchmark's shapes (hidden 2048, intermediate 1408): the K-major
    weight stream pair up to 4 rows an expert on average, the mma.sync K-major kernel below 32,
    the ping-pong wgmma kernel from 32 on (N/2 = 1408 needs 22 of its 64-column tiles, fewer than
    the SMs); bit-exact either way (at 4096 tokens against the reference on the first two
    experts' rows: rows are independent)."""
    from benchmarks.bench_moe_cuda import routing
    from ort_ops.testing.moe_launchers import GmsqRunner, pack_weight_kmajor

    torch = torch_cuda
    counts = routing(rng, tokens, experts, topk)
    m = int(counts.sum())
    x, w, ws, xs, gl = _problem(rng, m, 2048, 2816, list(counts))
    dev = torch.device("cuda")
    t = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (x, w, ws, xs, gl)]
    r = GmsqRunner(t[0], pack_weight_kmajor(t[1]), *t[2:], config="auto", layout=2)
    r.poison()
    names = _kernel_names(torch, r.launch)
    assert r.error_word() == 0
    y, ys, yo = r.y.cpu().numpy(), r.y_scale.cpu().numpy(), r.y_offset.cpu().numpy()
    rows = m if m <= 2048 else int(gl[1])
    e = experts if m <= 2048 else 2
    want = reference.grouped_matmul_swiglu_quant(x[:rows], w[:e], ws[:e], xs[:rows], gl[:e])
    _assert_exact((y[:rows], ys[:rows], yo[:rows]), want)
    if not names:
        pytest.skip("codes exact, but the profiler recorded no CUDA kernels (CUPTI unavailable)")
    gmsq = [s for s in names if "gmsq" in s]
    if m <= 4 * experts:
        assert len(gmsq) == 2 and "gmsq_stream_km_kernel" in gmsq[0] and "gmsq_stream_epilogue" in gmsq[1], names
    else:  # gmsq_kernel<...> or gmsq_wgmma_pp_kernel
        assert len(gmsq) == 1 and ("gmsq_wgmma_pp_kernel" in gmsq[0]) == (m // experts >= 32), names
