# SPDX-License-Identifier: MIT
"""GroupedMatmulSwigluQuant on NVIDIA tensor cores against ort_ops.reference (bit-exact codes).

Two kinds of test:
- CPU-only model of the kernel's operand placement (runs in CI): the swizzled shared-memory
  tiles, the 4x4 byte transpose that turns the [K, N] weight layout into mma.sync B registers,
  and the column relabelling the epilogue relies on, checked with ort_ops.fragments' table of
  m16n8k32; plus the bank-conflict claims of the kernel's comments.
- GPU tests (``@pytest.mark.cuda``): the launcher through ctypes on torch tensors, against the
  numpy reference, codes and scales bit for bit (the recipe in ort_ops/ops/_moe.py is exact on
  every target, so no tie tolerance is needed: same policy as the CPU tests, zero mismatches).
  They skip when torch, a GPU or a CUDA build of the library is missing.

Alphabet: M rows, K reduction, N GEMM columns (N/2 outputs), E experts.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import fragments as fr
from ort_ops import reference
from tests.ops.device_errors import assert_reported_both_ways
from tests.tolerances import INT8_EXACT_ATOL

# ---- CPU model of the kernel's placement (mirrors csrc/ops/grouped_matmul_swiglu_quant/cuda.cu) ----

BK = 64
WARPS_N_CHOICES = (2, 4)  # the kernel's configurations: 64 or 128 output columns per tile


def _b_row(warps_n: int) -> int:
    return 64 * warps_n  # gate half + up half, 32 columns per warp each


def _b_smem_offset(kr: int, cc: int, warps_n: int) -> int:
    """Byte offset of 16-byte chunk cc of B-tile row kr (cp.async side of load_stage)."""
    return kr * _b_row(warps_n) + ((cc ^ (((kr >> 2) & 3) << 1)) << 4)


def _b_lane_off(wn: int, lane: int, warps_n: int, q: int) -> int:
    """Byte offset of lane's first B word in half q (0 gate, 1 up): b_lane_off[q] in the kernel."""
    g, t = lane >> 2, lane & 3
    half_chunks = _b_row(warps_n) // 32
    return 4 * t * _b_row(warps_n) + (((q * half_chunks + wn * 2 + (g >> 2)) ^ (t << 1)) << 4) + (g & 3) * 4


def _a_smem_offset(r: int, ch: int) -> int:
    return r * BK + ((ch ^ ((r >> 1) & 3)) << 4)


def _transpose4x4(words: list[bytes]) -> list[bytes]:
    return [bytes(words[r][i] for r in range(4)) for i in range(4)]


def _smem_b_tile(w_tile: np.ndarray, warps_n: int) -> bytearray:
    """w_tile [64 k, row cols] (gate | up halves) written to shared memory as load_stage does."""
    row = _b_row(warps_n)
    smem = bytearray(BK * row)
    for kr in range(BK):
        for cc in range(row // 16):
            off = _b_smem_offset(kr, cc, warps_n)
            smem[off:off + 16] = w_tile[kr, cc * 16:cc * 16 + 16].tobytes()
    return smem


@pytest.mark.parametrize("warps_n", WARPS_N_CHOICES)
def test_b_tile_swizzle_is_a_bijection(warps_n):
    row = _b_row(warps_n)
    offs = sorted(_b_smem_offset(kr, cc, warps_n) for kr in range(BK) for cc in range(row // 16))
    assert offs == list(range(0, BK * row, 16))
    offs = sorted(_a_smem_offset(r, ch) for r in range(128) for ch in range(4))
    assert offs == list(range(0, 128 * BK, 16))


@pytest.mark.parametrize("warps_n", WARPS_N_CHOICES)
def test_b_operand_placement_feeds_the_mma_the_right_columns(rng, warps_n):
    """Each B register the kernel builds holds, for n8 tile q*4+i and fragment column g, the 4
    consecutive k of physical column q*BNh + wn*32 + 4g + i; and accumulator (lane (g,t), reg j)
    of n tile i is output column wn*32 + 8t + 4(j&1) + i, the epilogue's `c = 4 jj + i`."""
    tgt = fr.TARGETS["nvidia_m16n8k32"]
    brow, bnh = _b_row(warps_n), _b_row(warps_n) // 2
    w_tile = rng.integers(-128, 128, (BK, brow), dtype=np.int8)
    smem = _smem_b_tile(w_tile, warps_n)
    for wn in range(warps_n):
        for kb in range(2):
            # b_logical[nt][(k, col)] as the MMA sees it, from the kernel's loads + transpose
            seen = [{} for _ in range(8)]
            for lane in range(32):
                for q in range(2):
                    for h in range(2):
                        words = []
                        for r in range(4):
                            off = _b_lane_off(wn, lane, warps_n, q) + (kb * 32 + h * 16 + r) * brow
                            words.append(bytes(smem[off:off + 4]))
                        for i, reg in enumerate(_transpose4x4(words)):
                            for byte in range(4):
                                k, col = tgt.b[lane][h][byte]
                                seen[q * 4 + i][(k, col)] = np.int8(np.frombuffer(reg[byte:byte + 1], np.int8)[0])
            for nt in range(8):
                q, i = divmod(nt, 4)
                assert len(seen[nt]) == 32 * 8
                for (k, col), v in seen[nt].items():
                    phys = q * bnh + wn * 32 + 4 * col + i
                    assert v == w_tile[kb * 32 + k, phys], (wn, kb, nt, k, col)
    # D side: logical column 2t + (j & 1) of n tile i is physical 4 * (2t + (j & 1)) + i.
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(4):
            row, col = tgt.d[lane][j]
            assert row == g + 8 * (j >> 1)
            for i in range(4):
                assert 4 * col + i == 8 * t + 4 * (j & 1) + i


def test_a_operand_ldmatrix_rows(rng):
    """ldmatrix.x4 over the swizzled A tile gives the m16n8k32 A fragment of rows mt*16.. ."""
    tgt = fr.TARGETS["nvidia_m16n8k32"]
    bm = 64
    a_tile = rng.integers(-128, 128, (bm, BK), dtype=np.int8)
    smem = bytearray(bm * BK)
    for r in range(bm):
        for ch in range(4):
            off = _a_smem_offset(r, ch)
            smem[off:off + 16] = a_tile[r, ch * 16:ch * 16 + 16].tobytes()
    for m0 in range(0, bm, 16):
        for kb in range(2):
            addr = []
            for lane in range(32):
                r = m0 + (lane & 7) + ((lane >> 3) & 1) * 8
                addr.append(_a_smem_offset(r, kb * 2 + (lane >> 4)))
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for j in range(4):  # matrix j: row g of the 8 rows lanes 8j..8j+7 point at
                    src = addr[8 * j + g]
                    reg = np.frombuffer(bytes(smem[src + 4 * t:src + 4 * t + 4]), np.int8)
                    for byte in range(4):
                        row, k = tgt.a[lane][j][byte]
                        assert reg[byte] == a_tile[m0 + row, kb * 32 + k]


@pytest.mark.parametrize("warps_n", WARPS_N_CHOICES)
def test_shared_memory_reads_are_bank_conflict_free(warps_n):
    # B: for each of the 4 k rows and both halves, the warp's 32 word loads hit 32 distinct banks.
    for wn in range(warps_n):
        for r in range(4):
            for q in range(2):
                banks = {((_b_lane_off(wn, lane, warps_n, q) + r * _b_row(warps_n)) // 4) % 32
                         for lane in range(32)}
                assert len(banks) == 32
    # A: each 8-lane ldmatrix phase reads 8 rows of 16 bytes from 8 disjoint bank quads.
    for m0 in range(0, 128, 16):
        for kb in range(2):
            for phase in range(4):
                quads = {(_a_smem_offset(m0 + (l & 7) + ((l >> 3) & 1) * 8, kb * 2 + (l >> 4)) // 16) % 8
                         for l in range(8 * phase, 8 * phase + 8)}
                assert len(quads) == 8


def test_pack_weight_layout(rng):
    """pack_weight (CPU torch is enough) lays tile c's row k out as [A cols | G cols], zero-padded."""
    torch = pytest.importorskip("torch")
    from ort_ops.testing.moe_launchers import PACKED_COLS, pack_weight

    e, k, n = 2, 32, 2 * 200  # N/2 = 200: two tiles, the second padded from 72 to 128 columns
    w = rng.integers(-128, 128, (e, k, n), dtype=np.int8)
    p = pack_weight(torch.from_numpy(w)).numpy()
    assert p.shape == (e, 2, k, 2 * PACKED_COLS)
    h = n // 2
    for c in range(2):
        cols = np.arange(c * PACKED_COLS, min(h, (c + 1) * PACKED_COLS))
        np.testing.assert_array_equal(p[:, c, :, :len(cols)], w[:, :, cols])
        np.testing.assert_array_equal(p[:, c, :, PACKED_COLS:PACKED_COLS + len(cols)], w[:, :, h + cols])
        assert not p[:, c, :, len(cols):PACKED_COLS].any() and not p[:, c, :, PACKED_COLS + len(cols):].any()


# ---- GPU tests ----

def _cuda_reason():
    from ort_ops.testing.moe_launchers import cuda_unavailable_reason

    return cuda_unavailable_reason()


cuda = pytest.mark.cuda


@pytest.fixture
def torch_cuda():
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    import torch

    return torch


def _problem(rng, m, k, n, counts, *, tail=0):
    """Random INT8 codes and scales sized so C spans the sigmoid's range (|C| up to ~20)."""
    e = len(counts)
    x = rng.integers(-128, 128, (m, k), dtype=np.int8)
    w = rng.integers(-127, 128, (e, k, n), dtype=np.int8)
    # |acc| ~ 127^2 sqrt(K) / 3; scales make C = acc * xs * ws of order 1..20.
    ws = (rng.uniform(0.2, 1.0, (e, n)) / 127).astype(np.float32)
    xs = (rng.uniform(0.2, 1.0, m) * 3 * 20 / (127 * np.sqrt(k))).astype(np.float32)
    gl = np.cumsum(np.asarray(counts, np.int64))
    assert gl[-1] + tail == m if e else True
    return x, w, ws, xs, gl


def _run_cuda(torch, x, w, ws, xs, gl, group_list_type=0, config="auto"):
    from ort_ops.testing.moe_launchers import gmsq

    dev = torch.device("cuda")
    t = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (x, w, ws, xs, gl)]
    y, ys, yo, err = gmsq(*t, group_list_type=group_list_type, config=config)
    return y.cpu().numpy(), ys.cpu().numpy(), yo.cpu().numpy(), err


def _check_gmd_cuda(torch, x, w, ws, xs, gl, config="auto"):
    """GroupedMatmulDequant on the GPU: error word 0, every output written, bit-equal to the
    reference."""
    from ort_ops.testing.moe_launchers import gmd

    dev = torch.device("cuda")
    t = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (x, w, ws, xs, gl)]
    y, err = gmd(*t, config=config)
    assert err == 0
    y = y.cpu().numpy()
    want = reference.grouped_matmul_dequant(x, w, ws, xs, gl)
    assert np.all(np.isfinite(y)), "unwritten (NaN-poisoned) outputs"
    bad = np.argwhere(y != want)
    assert bad.size == 0, f"{len(bad)} of {y.size} differ, first at {bad[:5].tolist()}"


def _assert_exact(got, want):
    y, ys, yo = got
    ry, rys, ryo = want
    assert y.shape == ry.shape and ys.shape == rys.shape
    assert np.all(np.isfinite(ys)), "unwritten (NaN-poisoned) y_scale entries"
    bad = np.argwhere(np.abs(y.astype(np.int32) - ry.astype(np.int32)) > INT8_EXACT_ATOL)
    assert bad.size == 0, (f"{len(bad)} of {y.size} codes differ, first at {bad[:5].tolist()}: "
                           f"{y[tuple(bad[0])]} vs {ry[tuple(bad[0])]}")
    badr = np.flatnonzero(ys != rys)
    assert badr.size == 0, f"{badr.size} scales differ, first rows {badr[:5].tolist()}: {ys[badr[:3]]} vs {rys[badr[:3]]}"
    np.testing.assert_array_equal(yo, ryo)


# (M, K, N, counts, tail): empty and one-row experts, M not a multiple of any tile (16/64/128),
# all rows in one expert, rows past the last group, N/2 not a multiple of the 128-column tile,
# K not a multiple of the 64-deep k step.
CASES = {
    "mixed": (203, 256, 320, [0, 1, 37, 0, 130, 1, 34, 0], 0),
    "one_expert": (300, 128, 256, [300], 0),
    "tail_rows": (150, 96, 160, [3, 0, 50, 1], 96),
    "k80_n96": (77, 80, 96, [20, 20, 37], 0),
    "single_row": (1, 64, 64, [0, 1], 0),
    "many_experts": (517, 128, 96, [int(c) for c in np.random.default_rng(7).integers(0, 17, 64)], 0),
    # Deep K ending in a partial 64-deep k step, tail rows.
    "deep_k": (127, 2000, 256, [30, 0, 45, 1, 44], 7),
    # More row blocks than slot groups: 11 column tiles, so on 132 SMs bm16w runs its 70 row
    # blocks in 3 rounds of 24 slots, bm16 in 6, bm64 in 2.
    "many_rounds": (1120, 256, 2816, [112] * 10, 0),
}


@cuda
@pytest.mark.parametrize("config", ["auto", "bm16", "bm32", "bm64", "bm128", "bm16w", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_gmsq_cuda_matches_reference(torch_cuda, rng, case, config):
    m, k, n, counts, tail = CASES[case]
    if case == "many_experts":
        m = sum(counts) + tail
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts, tail=tail)
    *got, err = _run_cuda(torch_cuda, x, w, ws, xs, gl, config=config)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))
    if tail:
        assert not got[0][m - tail:].any() and not got[1][m - tail:].any()


@cuda
@pytest.mark.parametrize("config", ["auto", "bm16", "bm64", "bm128", "bm16w", "stream"])
@pytest.mark.parametrize("case", ["mixed", "tail_rows", "k80_n96", "many_experts", "deep_k",
                                  "many_rounds"])
def test_gmd_cuda_matches_reference(torch_cuda, rng, case, config):
    """GroupedMatmulDequant (the down projection, same kernel): float32 y bit for bit."""
    m, k, n, counts, tail = CASES[case]
    if case == "many_experts":
        m = sum(counts) + tail
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts, tail=tail)
    _check_gmd_cuda(torch_cuda, x, w, ws, xs, gl, config=config)


@cuda
@pytest.mark.parametrize("config", ["bm16", "bm32", "bm128", "stream"])
def test_gmsq_cuda_counts_and_model_shape(torch_cuda, rng, config):
    """group_list_type 1 (counts) at the benchmark's hidden 2048 / intermediate 1408."""
    counts = [40, 0, 1, 90, 3, 0, 17, 60]
    m = sum(counts) + 5
    x, w, ws, xs, _ = _problem(rng, m, 2048, 2816, counts, tail=5)
    gl = np.asarray(counts, np.int64)
    *got, err = _run_cuda(torch_cuda, x, w, ws, xs, gl, group_list_type=1, config=config)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl, group_list_type=1))


@cuda
@pytest.mark.parametrize("config", ["auto", "bm16w"])
@pytest.mark.parametrize("experts,topk", [(8, 2), (64, 8)])
def test_gmsq_cuda_decode_shapes(torch_cuda, rng, experts, topk, config):
    """The benchmark's decode rows (16 tokens, hidden 2048, intermediate 1408, uniform top-k
    routing), auto (8 experts: bm16w, one round of row blocks; 64 experts: the stream kernel,
    ~616 tiles split evenly over every SM) and bm16w forced (several rounds at 64 experts); the
    dequant mode too."""
    t, k, n = 16, 2048, 2816
    ids = np.argsort(rng.random((t, experts)), axis=1)[:, :topk]
    counts = np.bincount(ids.ravel(), minlength=experts)
    m = int(counts.sum())
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts)
    *got, err = _run_cuda(torch_cuda, x, w, ws, xs, gl, config=config)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))
    _check_gmd_cuda(torch_cuda, x, w, ws, xs, gl, config=config)


@cuda
@pytest.mark.parametrize("experts,topk,tokens,stream", [(8, 2, 16, True), (64, 8, 16, True),
                                                        (64, 8, 32, True), (8, 2, 64, False),
                                                        (64, 8, 64, False), (1, 1, 4, True)])
def test_gmsq_cuda_auto_picks_the_stream_kernel_at_decode(torch_cuda, rng, experts, topk, tokens,
                                                         stream):
    """Auto dispatch on the contract's layout: the stream kernel pair up to 4 rows an expert on
    average, the tiled kernel above; named by the torch profiler."""
    from benchmarks.bench_moe_cuda import routing
    from ort_ops.testing.moe_launchers import GmsqRunner
    from tests.ops.test_moe_kmajor_cuda import _kernel_names

    counts = routing(rng, tokens, experts, topk)
    m = int(counts.sum())
    x, w, ws, xs, gl = _problem(rng, m, 256, 2816, list(counts))
    dev = torch_cuda.device("cuda")
    r = GmsqRunner(*[torch_cuda.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (x, w, ws, xs, gl)])
    r.poison()
    names = _kernel_names(torch_cuda, r.launch)
    assert r.error_word() == 0
    _assert_exact((r.y.cpu().numpy(), r.y_scale.cpu().numpy(), r.y_offset.cpu().numpy()),
                  reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))
    if not names:
        pytest.skip("codes exact, but the profiler recorded no CUDA kernels (CUPTI unavailable)")
    gmsq = [s for s in names if "gmsq" in s]
    want = ["gmsq_stream_kernel", "gmsq_stream_epilogue"] if stream else ["gmsq_kernel"]
    assert len(gmsq) == len(want) and all(w_ in g for w_, g in zip(want, gmsq)), names


@cuda
@pytest.mark.parametrize("config", ["auto", "stream"])
@pytest.mark.parametrize("k", [16, 2000])
def test_gmsq_cuda_stream_at_the_expert_limit(torch_cuda, rng, config, k):
    """kGmsqMaxExperts (1024) experts, 200 of them with 2-4 rows: the stream kernel's tile map at
    its largest (8 KB of shared memory: fewer CTAs an SM); auto picks it too (>= 400 rows,
    0.4-0.8 an expert).
    K = 16 is one partial 64-deep step, K = 2000 ends in one. Both modes, bit for bit."""
    e = 1024
    counts = np.zeros(e, np.int64)
    counts[rng.choice(e, 200, replace=False)] = rng.integers(2, 5, 200)
    m = int(counts.sum()) + 3
    x, w, ws, xs, gl = _problem(rng, m, k, 64, list(counts), tail=3)
    *got, err = _run_cuda(torch_cuda, x, w, ws, xs, gl, config=config)
    assert err == 0
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))
    _check_gmd_cuda(torch_cuda, x, w, ws, xs, gl, config=config)


@cuda
def test_gmsq_cuda_stream_refuses_shapes_past_its_workspace(torch_cuda, rng):
    """M * N > 2^24 int32 sums: the forced stream config fails the launch (no workspace was sized
    for it), and auto keeps the tiled kernel there."""
    from ort_ops.testing.moe_launchers import gmsq

    m, n = 8192, 2816
    x, w, ws, xs, gl = _problem(rng, m, 64, n, [m])
    dev = torch_cuda.device("cuda")
    t = [torch_cuda.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (x, w, ws, xs, gl)]
    with pytest.raises(RuntimeError, match=r"launch failed .*the stream config holds M \* N int32 sums"):
        gmsq(*t, config="stream")


@cuda
@pytest.mark.parametrize("dequant", [False, True])
@pytest.mark.parametrize("config", ["bm16w", "bm64", "bm128"])
@pytest.mark.parametrize("case", ["tail_rows", "deep_k"])
def test_cuda_packed_weight_layout(torch_cuda, rng, config, dequant, case):
    """The packed B layout (one contiguous weight run per CTA) gives the same bits."""
    from ort_ops.testing.moe_launchers import GmsqRunner, pack_weight

    # tail_rows: N/2 = 80, a padded, partial 128-column tile.
    m, k, n, counts, tail = CASES[case]
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts, tail=tail)
    dev = torch_cuda.device("cuda")
    t = [torch_cuda.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (x, w, ws, xs, gl)]
    t[1] = pack_weight(t[1])
    r = GmsqRunner(*t, config=config, dequant=dequant, n=n)
    r.poison()
    r.launch()
    assert r.error_word() == 0
    if dequant:
        np.testing.assert_array_equal(r.y.cpu().numpy(), reference.grouped_matmul_dequant(x, w, ws, xs, gl))
    else:
        _assert_exact((r.y.cpu().numpy(), r.y_scale.cpu().numpy(), r.y_offset.cpu().numpy()),
                      reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))


@cuda
@pytest.mark.parametrize("config", ["bm64", "stream"])
def test_gmsq_cuda_is_deterministic_and_race_free(torch_cuda, rng, config):
    """Same inputs twice (different interleavings of the cross-CTA row max or of the stream's
    partial sums): same bits."""
    x, w, ws, xs, gl = _problem(rng, 700, 256, 2 * 640, [100, 250, 0, 350])
    first = _run_cuda(torch_cuda, x, w, ws, xs, gl, config=config)
    second = _run_cuda(torch_cuda, x, w, ws, xs, gl, config=config)
    for a, b in zip(first[:3], second[:3]):
        np.testing.assert_array_equal(a, b)


@cuda
@pytest.mark.parametrize("config", ["auto", "stream"])
def test_gmsq_cuda_edge_values(torch_cuda, rng, config):
    """All-zero rows (scale 0, codes 0), a row where one column dominates, saturated codes."""
    x, w, ws, xs, gl = _problem(rng, 40, 64, 64, [40])
    x[0] = 0
    x[1] = 127
    xs[2] = 0.0
    *got, err = _run_cuda(torch_cuda, x, w, ws, xs, gl, config=config)
    assert err == 0
    want = reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl)
    _assert_exact(got, want)
    assert got[1][0] == 0 and not got[0][0].any() and got[1][2] == 0


@cuda
@pytest.mark.parametrize("config", ["auto", "stream"])
def test_gmsq_cuda_reports_bad_group_list_without_faulting(torch_cuda, rng, config):
    from ort_ops.testing.moe_launchers import ERR_GROUP_LIST

    x, w, ws, xs, _ = _problem(rng, 50, 64, 64, [50])
    for gl in ([30, 10, 50], [10, 20, 500], [-5, 10, 20]):
        *_, err = _run_cuda(torch_cuda, x, w[[0, 0, 0]], ws[[0, 0, 0]], xs, np.asarray(gl, np.int64),
                            config=config)
        assert err & ERR_GROUP_LIST, gl
    *_, err = _run_cuda(torch_cuda, x, w[[0, 0]], ws[[0, 0]], xs, np.asarray([30, 0], np.int64),
                        group_list_type=1, config=config)
    assert err == 0  # also: the word a failed launch left is cleared by the next one
    *_, err = _run_cuda(torch_cuda, x, w[[0, 0]], ws[[0, 0]], xs, np.asarray([30, -1], np.int64),
                        group_list_type=1, config=config)
    assert err & ERR_GROUP_LIST


@cuda
@pytest.mark.parametrize("config", ["auto", "stream"])
def test_gmsq_cuda_reports_non_finite(torch_cuda, rng, config):
    from ort_ops.testing.moe_launchers import ERR_NON_FINITE

    x, w, ws, xs, gl = _problem(rng, 20, 64, 64, [20])
    xs[3] = np.inf
    *_, err = _run_cuda(torch_cuda, x, w, ws, xs, gl, config=config)
    assert err & ERR_NON_FINITE
    with pytest.raises(ValueError, match="not finite"):
        reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl)


@cuda
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (4, 5, 129), (5, 16384), (300, 2048)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("smooth", [False, True])
def test_dynamic_quant_cuda_matches_reference(torch_cuda, rng, shape, dtype, smooth):
    from ort_ops.testing.moe_launchers import dynamic_quant

    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(dtype)
    x.reshape(-1, shape[-1])[0] = 0  # an all-zero row: scale 0, codes 0
    sm = rng.uniform(0.5, 2.0, shape[-1]).astype(np.float32) if smooth else None
    dev = torch_cuda.device("cuda")
    y, sc, err = dynamic_quant(torch_cuda.from_numpy(x).to(dev),
                               torch_cuda.from_numpy(sm).to(dev) if smooth else None)
    assert err == 0
    ry, rs = reference.dynamic_quant(x, sm)
    np.testing.assert_array_equal(y.cpu().numpy(), ry)
    np.testing.assert_array_equal(sc.cpu().numpy(), rs)


@cuda
def test_dynamic_quant_cuda_ties_and_non_finite(torch_cuda):
    from ort_ops.testing.moe_launchers import DQ_ERR_NON_FINITE, dynamic_quant

    ties = np.array([127.0, 0.5, 1.5, 2.5, -2.5, 126.5, -126.5], np.float32)[None, :]
    y, sc, err = dynamic_quant(torch_cuda.from_numpy(ties).cuda())
    assert err == 0 and sc.item() == 1.0
    np.testing.assert_array_equal(y.cpu().numpy()[0], [127, 0, 2, 2, -2, 126, -126])
    bad = np.ones((3, 40), np.float32)
    bad[1, 7] = np.inf
    *_, err = dynamic_quant(torch_cuda.from_numpy(bad).cuda())
    assert err & DQ_ERR_NON_FINITE


@cuda
@pytest.mark.parametrize("m,k,h,e", [(1, 1, 8, 1), (16, 2, 64, 8), (37, 8, 33, 64), (300, 8, 128, 64),
                                     (0, 2, 16, 4), (1000, 2, 2048, 8)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_moe_init_routing_cuda_matches_reference(torch_cuda, rng, m, k, h, e, dtype):
    from ort_ops.testing.moe_launchers import moe_init_routing

    x = rng.standard_normal((m, h)).astype(dtype)
    ids = np.array([rng.permutation(e)[:k] if k <= e else rng.integers(0, e, k) for _ in range(m)],
                   np.int32).reshape(m, k)
    sx, s2f, gl, err = moe_init_routing(torch_cuda.from_numpy(x).cuda(), torch_cuda.from_numpy(ids).cuda(), e)
    assert err == 0
    rsx, rs2f, rgl = reference.moe_init_routing(x, ids, e)
    np.testing.assert_array_equal(s2f.cpu().numpy(), rs2f)
    np.testing.assert_array_equal(gl.cpu().numpy(), rgl)
    np.testing.assert_array_equal(sx.cpu().numpy(), rsx)


@cuda
def test_moe_init_routing_cuda_flags_bad_ids(torch_cuda, rng):
    from ort_ops.testing.moe_launchers import INIT_ERR_BAD_EXPERT, moe_init_routing

    x = rng.standard_normal((4, 16)).astype(np.float32)
    ids = np.array([[0, 1], [2, 8], [3, -1], [1, 0]], np.int32)
    *_, err = moe_init_routing(torch_cuda.from_numpy(x).cuda(), torch_cuda.from_numpy(ids).cuda(), 8)
    assert err & INIT_ERR_BAD_EXPERT


@cuda
@pytest.mark.parametrize("m,k,h", [(1, 1, 8), (16, 2, 64), (37, 8, 33), (0, 2, 16), (500, 8, 2048)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_moe_finalize_routing_cuda_matches_reference(torch_cuda, rng, m, k, h, dtype, with_residual):
    from ort_ops.testing.moe_launchers import moe_finalize_routing

    eo = rng.standard_normal((m * k, h)).astype(dtype)
    s2f = rng.permutation(m * k).astype(np.int32)
    tw = rng.uniform(0, 1, (m, k)).astype(dtype)
    res = rng.standard_normal((m, h)).astype(dtype) if with_residual else None
    t = lambda a: torch_cuda.from_numpy(a).cuda() if a is not None else None
    out, err = moe_finalize_routing(t(eo), t(s2f), t(tw), t(res))
    assert err == 0
    np.testing.assert_array_equal(out.cpu().numpy(), reference.moe_finalize_routing(eo, s2f, tw, res))


@cuda
def test_moe_finalize_routing_cuda_flags_non_permutation(torch_cuda, rng):
    from ort_ops.testing.moe_launchers import FINALIZE_ERR_NOT_PERMUTATION, moe_finalize_routing

    eo = torch_cuda.ones((6, 4), device="cuda")
    tw = torch_cuda.ones((3, 2), device="cuda")
    for bad in ([0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 4, 6], [-1, 1, 2, 3, 4, 5]):
        _, err = moe_finalize_routing(eo, torch_cuda.tensor(bad, dtype=torch_cuda.int32, device="cuda"), tw)
        assert err & FINALIZE_ERR_NOT_PERMUTATION, bad


@cuda
def test_moe_chain_on_gpu_matches_reference_chain(torch_cuda, rng):
    """InitRouting -> DynamicQuant -> GMSQ -> GMD -> FinalizeRouting, all on the GPU with no host
    round trip in between, against the same chain of numpy references: bit for bit."""
    from ort_ops.testing.moe_launchers import dynamic_quant, gmd, gmsq, moe_finalize_routing, moe_init_routing

    m, hid, inter, e, k = 50, 256, 160, 8, 2
    x = rng.standard_normal((m, hid)).astype(np.float32)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    tw = rng.uniform(0, 1, (m, k)).astype(np.float32)
    w1 = rng.integers(-127, 128, (e, hid, 2 * inter), dtype=np.int8)
    s1 = (rng.uniform(0.2, 1, (e, 2 * inter)) / 127).astype(np.float32)
    w2 = rng.integers(-127, 128, (e, inter, hid), dtype=np.int8)
    s2 = (rng.uniform(0.2, 1, (e, hid)) / 127).astype(np.float32)
    c = lambda a: torch_cuda.from_numpy(a).cuda()
    sx, s2f, gl, err0 = moe_init_routing(c(x), c(ids), e)
    xq, xs, err1 = dynamic_quant(sx)
    h1, h1s, _, err2 = gmsq(xq, c(w1), c(s1), xs, gl)
    y2, err3 = gmd(h1, c(w2), c(s2), h1s, gl)
    out, err4 = moe_finalize_routing(y2, s2f, c(tw))
    assert (err0, err1, err2, err3, err4) == (0, 0, 0, 0, 0)
    rsx, rs2f, rgl = reference.moe_init_routing(x, ids, e)
    rxq, rxs = reference.dynamic_quant(rsx)
    rh1, rh1s, _ = reference.grouped_matmul_swiglu_quant(rxq, w1, s1, rxs, rgl)
    ry2 = reference.grouped_matmul_dequant(rh1, w2, s2, rh1s, rgl)
    np.testing.assert_array_equal(out.cpu().numpy(), reference.moe_finalize_routing(ry2, rs2f, tw))


# ---- through a real onnxruntime-gpu session (CUDA EP) ----

@pytest.fixture
def cuda_ep_session():
    """A factory of one-node GroupedMatmulSwigluQuant sessions on the CUDA EP, with profiling on
    so the test can prove the node ran there (skips without onnxruntime-gpu or a CUDA build)."""
    import onnxruntime as ort

    from ort_ops import build_info
    from ort_ops._lib import session_options
    from ort_ops.ops import grouped_matmul_swiglu_quant as gmsq_mod
    from ort_ops.ops._schema import single_op_model

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu not installed)")
    if not build_info()["cuda"]:
        pytest.skip("the ort_ops library was built without CUDA")

    def make(inputs, schema=gmsq_mod.SCHEMA, **attrs):
        model = single_op_model(schema, inputs, dynamic_shapes=True, **attrs)
        so = session_options()
        so.enable_profiling = True
        return ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CUDAExecutionProvider", "CPUExecutionProvider"])

    return make


def _providers_of(sess, op_type):
    import json

    with open(sess.end_profiling()) as f:
        events = json.load(f)
    return {e["args"].get("provider") for e in events
            if e.get("cat") == "Node" and e["args"].get("op_name") == op_type}


@cuda
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("decode", [False, True])
def test_gmsq_cuda_ep_session(cuda_ep_session, rng, scale_dtype, decode):
    # decode: <= 16 rows an expert, so auto runs the stream kernel pair; else the tiled kernel.
    m, k, n, counts = ((40, 256, 320, [3, 0, 5, 1, 16, 2, 0, 9]) if decode
                       else (211, 256, 320, [0, 1, 100, 0, 90]))
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts, tail=4 if decode else 20)
    ws, xs = ws.astype(scale_dtype), xs.astype(scale_dtype)
    feeds = {"x": x, "weight": w, "weight_scale": ws, "x_scale": xs, "group_list": gl}
    sess = cuda_ep_session(feeds)
    got = sess.run(None, feeds)
    assert _providers_of(sess, "GroupedMatmulSwigluQuant") == {"CUDAExecutionProvider"}
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl))


@cuda
@pytest.mark.parametrize("decode", [False, True])
def test_gmd_cuda_ep_session(cuda_ep_session, rng, decode):
    from ort_ops.ops import grouped_matmul_dequant as gmd_mod

    m, k, n, counts = ((30, 128, 256, [10, 0, 1, 12]) if decode
                       else (150, 128, 256, [10, 0, 1, 120]))
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts, tail=7 if decode else 19)
    feeds = {"x": x, "weight": w, "weight_scale": ws, "x_scale": xs, "group_list": gl}
    sess = cuda_ep_session(feeds, schema=gmd_mod.SCHEMA, group_list_type=0)
    (y,) = sess.run(None, feeds)
    assert _providers_of(sess, "GroupedMatmulDequant") == {"CUDAExecutionProvider"}
    np.testing.assert_array_equal(y, reference.grouped_matmul_dequant(x, w, ws, xs, gl))


@cuda
def test_dynamic_quant_cuda_ep_session(cuda_ep_session, rng):
    from ort_ops.ops import dynamic_quant as dq_mod

    x = (rng.standard_normal((37, 300)) * 3).astype(np.float16)
    sm = rng.uniform(0.5, 2.0, 300).astype(np.float16)
    feeds = {"x": x, "smooth_scale": sm}
    sess = cuda_ep_session(feeds, schema=dq_mod.SCHEMA)
    y, sc = sess.run(None, feeds)
    assert _providers_of(sess, "DynamicQuant") == {"CUDAExecutionProvider"}
    ry, rs = reference.dynamic_quant(x, sm)
    np.testing.assert_array_equal(y, ry)
    np.testing.assert_array_equal(sc, rs)
    bad = dict(feeds, x=x.copy())
    bad["x"][5, 5] = np.inf
    y, sc = assert_reported_both_ways(sess, bad, feeds, r"DynamicQuant: input 'x' \(times 'smooth_scale'")
    np.testing.assert_array_equal(y, ry)
    np.testing.assert_array_equal(sc, rs)


@cuda
def test_routing_cuda_ep_sessions(cuda_ep_session, rng):
    from ort_ops.ops import moe_finalize_routing as fin_mod
    from ort_ops.ops import moe_init_routing as init_mod

    m, h, e, k = 40, 64, 8, 2
    x = rng.standard_normal((m, h)).astype(np.float16)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(m)]).astype(np.int32)
    feeds = {"x": x, "expert_ids": ids}
    sess = cuda_ep_session(feeds, schema=init_mod.SCHEMA, num_experts=e)
    got = sess.run(None, feeds)
    assert _providers_of(sess, "MoeInitRouting") == {"CUDAExecutionProvider"}
    for a, b in zip(got, reference.moe_init_routing(x, ids, e)):
        np.testing.assert_array_equal(a, b)
    bad = dict(feeds, expert_ids=ids.copy())
    bad["expert_ids"][3, 1] = e
    got = assert_reported_both_ways(sess, bad, feeds, r"MoeInitRouting: input 'expert_ids' must be in \[0, 8\)")
    for a, b in zip(got, reference.moe_init_routing(x, ids, e)):
        np.testing.assert_array_equal(a, b)
    # The lean chain's form: int8 token rows (odd H: the byte-wise gather) and their scales.
    for hh in (h, 37):
        tq = rng.integers(-127, 128, (m, hh), dtype=np.int8)
        ts = rng.uniform(0.01, 1.0, m).astype(np.float32)
        qfeeds = {"x": tq, "expert_ids": ids, "x_scale": ts}
        got = cuda_ep_session(qfeeds, schema=init_mod.SCHEMA, num_experts=e).run(None, qfeeds)
        want = reference.moe_init_routing(tq, ids, e, ts)
        assert len(got) == 4
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)

    eo = rng.standard_normal((m * k, h)).astype(np.float32)
    s2f = rng.permutation(m * k).astype(np.int32)
    tw = rng.uniform(0, 1, (m, k)).astype(np.float32)
    res = rng.standard_normal((m, h)).astype(np.float16)
    feeds = {"expert_out": eo, "sorted_to_flat": s2f, "topk_weights": tw, "residual": res}
    sess = cuda_ep_session(feeds, schema=fin_mod.SCHEMA)
    (out,) = sess.run(None, feeds)
    assert _providers_of(sess, "MoeFinalizeRouting") == {"CUDAExecutionProvider"}
    np.testing.assert_array_equal(out, reference.moe_finalize_routing(eo, s2f, tw, res))
    # The 4-column path (H % 4 == 0) with float16 expert rows, and the per-element path (odd H).
    for hh, eo_dtype in ((64, np.float16), (37, np.float32)):
        f2 = {"expert_out": rng.standard_normal((m * k, hh)).astype(eo_dtype), "sorted_to_flat": s2f,
              "topk_weights": tw, "residual": rng.standard_normal((m, hh)).astype(np.float32)}
        (o2,) = cuda_ep_session(f2, schema=fin_mod.SCHEMA).run(None, f2)
        np.testing.assert_array_equal(o2, reference.moe_finalize_routing(*f2.values()))
    bad = dict(feeds, sorted_to_flat=np.zeros(m * k, np.int32))
    (out,) = assert_reported_both_ways(sess, bad, feeds,
                                       r"MoeFinalizeRouting: input 'sorted_to_flat' must be a permutation of \[0, 80\)")
    np.testing.assert_array_equal(out, reference.moe_finalize_routing(eo, s2f, tw, res))


@cuda
@pytest.mark.parametrize("rows", [40, 20])  # 20 rows on 2 experts: auto runs the stream kernel
def test_gmsq_cuda_ep_session_errors(cuda_ep_session, rng, rows):
    x, w, ws, xs, _ = _problem(rng, rows, 64, 64, [rows])
    w2, ws2 = w[[0, 0]], ws[[0, 0]]
    good = {"x": x, "weight": w2, "weight_scale": ws2, "x_scale": xs,
            "group_list": np.asarray([10, rows], np.int64)}
    sess = cuda_ep_session(good)
    want = reference.grouped_matmul_swiglu_quant(**good)
    bad = dict(good, group_list=np.asarray([30, 10], np.int64))
    _assert_exact(assert_reported_both_ways(
        sess, bad, good, rf"GroupedMatmulSwigluQuant: input 'group_list' must be non-decreasing .*<= {rows}"), want)
    bad = dict(good, x_scale=xs.copy())
    bad["x_scale"][3] = np.inf
    _assert_exact(assert_reported_both_ways(sess, bad, good, r"GroupedMatmulSwigluQuant: .*not finite"), want)


# ---- the optional bias and the "swiglu_oai" activation (gpt-oss) on every CUDA path ----

OAI = [{}, {"activation": "swiglu_oai"}, {"activation": "swiglu_oai", "alpha": 1.0, "limit": 3.0}]
OAI_IDS = ["swiglu", "oai", "oai-a1-l3"]


def _problem_wide(rng, m, k, n, counts, *, tail=0, bias=True):
    """_problem with C about 3x larger (|C| up to ~60: far past the clamp limit 7) and a bias in
    [-8, 8] [E, N] (or None)."""
    x, w, ws, xs, gl = _problem(rng, m, k, n, counts, tail=tail)
    xs = (xs * 3).astype(np.float32)
    b = rng.uniform(-8, 8, (len(counts), n)).astype(np.float32) if bias else None
    return x, w, ws, xs, gl, b


def _to_dev(torch, *arrays):
    dev = torch.device("cuda")
    return [None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in arrays]


@cuda
@pytest.mark.parametrize("act", OAI, ids=OAI_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("config", ["auto", "bm16", "bm32", "bm64", "bm128", "bm16w", "stream"])
@pytest.mark.parametrize("case", ["mixed", "tail_rows", "single_row", "deep_k"])
def test_gmsq_cuda_bias_activation(torch_cuda, rng, case, config, bias, act):
    """Layout [E, K, N], every mma.sync config and the stream pair: bit for bit with bias and
    swiglu_oai (C far past the clamp on both sides)."""
    from ort_ops.testing.moe_launchers import gmsq

    m, k, n, counts, tail = CASES[case]
    x, w, ws, xs, gl, b = _problem_wide(rng, m, k, n, counts, tail=tail, bias=bias)
    want = reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl, b, **act)
    t = _to_dev(torch_cuda, x, w, ws, xs, gl, b)
    y, ys, yo, err = gmsq(*t[:5], config=config, bias=t[5], **act)
    assert err == 0
    _assert_exact((y.cpu().numpy(), ys.cpu().numpy(), yo.cpu().numpy()), want)


@cuda
@pytest.mark.parametrize("act", OAI, ids=OAI_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("config", ["auto", "bm16", "bm32", "bm64", "bm128", "bm16w", "stream"])
@pytest.mark.parametrize("case", ["mixed", "tail_rows", "deep_k"])
def test_gmsq_cuda_kmajor_bias_activation(torch_cuda, rng, case, config, bias, act):
    """Layout [E, N, K]: bm128 is the Hopper wgmma kernel (its fast-division epilogue and exact
    second pass), the others the mma.sync K-major path and the K-major stream."""
    from ort_ops.testing.moe_launchers import gmsq, pack_weight_kmajor

    m, k, n, counts, tail = CASES[case]
    x, w, ws, xs, gl, b = _problem_wide(rng, m, k, n, counts, tail=tail, bias=bias)
    want = reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl, b, **act)
    t = _to_dev(torch_cuda, x, w, ws, xs, gl, b)
    y, ys, yo, err = gmsq(t[0], pack_weight_kmajor(t[1]), *t[2:5], config=config, layout=2, bias=t[5], **act)
    assert err == 0
    _assert_exact((y.cpu().numpy(), ys.cpu().numpy(), yo.cpu().numpy()), want)


@cuda
@pytest.mark.parametrize("config", ["auto", "bm16", "bm64", "bm128", "bm16w", "stream"])
@pytest.mark.parametrize("case", ["mixed", "tail_rows", "many_experts", "deep_k"])
def test_gmd_cuda_bias(torch_cuda, rng, case, config):
    from ort_ops.testing.moe_launchers import gmd

    m, k, n, counts, tail = CASES[case]
    if case == "many_experts":
        m = sum(counts) + tail
    x, w, ws, xs, gl, b = _problem_wide(rng, m, k, n, counts, tail=tail)
    t = _to_dev(torch_cuda, x, w, ws, xs, gl, b)
    y, err = gmd(*t[:5], config=config, bias=t[5])
    assert err == 0
    y = y.cpu().numpy()
    want = reference.grouped_matmul_dequant(x, w, ws, xs, gl, b)
    assert np.all(np.isfinite(y)), "unwritten (NaN-poisoned) outputs"
    bad = np.argwhere(y != want)
    assert bad.size == 0, f"{len(bad)} of {y.size} differ, first at {bad[:5].tolist()}"
    if tail:
        assert not y[m - tail:].any(), "rows past the last group end must stay zero (no bias)"


@cuda
@pytest.mark.parametrize("dequant", [False, True])
@pytest.mark.parametrize("config", ["bm16w", "bm64", "bm128"])
def test_cuda_packed_weight_layout_bias_oai(torch_cuda, rng, config, dequant):
    from ort_ops.testing.moe_launchers import GmsqRunner, pack_weight

    m, k, n, counts, tail = CASES["tail_rows"]
    x, w, ws, xs, gl, b = _problem_wide(rng, m, k, n, counts, tail=tail)
    t = _to_dev(torch_cuda, x, w, ws, xs, gl, b)
    r = GmsqRunner(t[0], pack_weight(t[1]), *t[2:5], config=config, dequant=dequant, n=n, bias=t[5],
                   activation="swiglu_oai")
    r.poison()
    r.launch()
    assert r.error_word() == 0
    if dequant:
        np.testing.assert_array_equal(r.y.cpu().numpy(), reference.grouped_matmul_dequant(x, w, ws, xs, gl, b))
    else:
        _assert_exact((r.y.cpu().numpy(), r.y_scale.cpu().numpy(), r.y_offset.cpu().numpy()),
                      reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl, b, activation="swiglu_oai"))


@cuda
@pytest.mark.parametrize("layout", [0, 2])
@pytest.mark.parametrize("config", ["auto", "bm128", "stream"])
def test_gmsq_cuda_oai_reports_non_finite_c(torch_cuda, rng, config, layout):
    """swiglu_oai clamps the gate (min(Inf, limit) is limit): an Inf C must still be reported, as
    must a NaN bias (the device does not check the bias's values)."""
    from ort_ops.testing.moe_launchers import ERR_NON_FINITE, gmsq, pack_weight_kmajor

    x, w, ws, xs, gl, b = _problem_wide(rng, 40, 64, 64, [40])
    for bad in ("x_scale", "bias"):
        xs2, b2 = xs.copy(), b.copy()
        if bad == "x_scale":
            xs2[3] = np.inf
        else:
            b2[0, 5] = np.nan
        t = _to_dev(torch_cuda, x, w, ws, xs2, gl, b2)
        wt = pack_weight_kmajor(t[1]) if layout == 2 else t[1]
        *_, err = gmsq(t[0], wt, *t[2:5], config=config, layout=layout, bias=t[5], activation="swiglu_oai")
        assert err & ERR_NON_FINITE, bad


@cuda
@pytest.mark.parametrize("decode", [False, True])
def test_gmsq_gmd_cuda_ep_session_bias_oai(cuda_ep_session, rng, decode):
    """Through onnxruntime's CUDA EP: the bias input and the activation attributes reach the
    kernels (and both ops ran there)."""
    from ort_ops.ops import grouped_matmul_dequant as gmd_mod

    m, k, n, counts = ((40, 256, 320, [3, 0, 5, 1, 16, 2, 0, 9]) if decode
                       else (211, 256, 320, [0, 1, 100, 0, 90]))
    x, w, ws, xs, gl, b = _problem_wide(rng, m, k, n, counts, tail=4 if decode else 20)
    feeds = {"x": x, "weight": w, "weight_scale": ws, "x_scale": xs, "group_list": gl, "bias": b}
    act = {"activation": "swiglu_oai", "alpha": 1.5, "limit": 6.0}
    sess = cuda_ep_session(feeds, **act)
    got = sess.run(None, feeds)
    assert _providers_of(sess, "GroupedMatmulSwigluQuant") == {"CUDAExecutionProvider"}
    _assert_exact(got, reference.grouped_matmul_swiglu_quant(x, w, ws, xs, gl, b, **act))
    sess = cuda_ep_session(feeds, schema=gmd_mod.SCHEMA)
    (y,) = sess.run(None, feeds)
    assert _providers_of(sess, "GroupedMatmulDequant") == {"CUDAExecutionProvider"}
    np.testing.assert_array_equal(y, reference.grouped_matmul_dequant(x, w, ws, xs, gl, b))


@cuda
def test_cuda_ep_refuses_bad_bias_and_activation(cuda_ep_session, rng):
    """Host-known refusals fail the Run (bias dtype / shape) or the session (attributes) with the
    CPU's messages."""
    x, w, ws, xs, gl, b = _problem_wide(rng, 20, 64, 64, [20])
    feeds = {"x": x, "weight": w, "weight_scale": ws, "x_scale": xs, "group_list": gl, "bias": b[:, :-1].copy()}
    with pytest.raises(Exception, match="GroupedMatmulSwigluQuant: input 'bias' must have shape"):
        cuda_ep_session(feeds).run(None, feeds)
    feeds["bias"] = b.astype(np.float16)
    with pytest.raises(Exception, match="GroupedMatmulSwigluQuant: input 'bias' must be float32, got float16"):
        cuda_ep_session(feeds).run(None, feeds)
    feeds["bias"] = b
    with pytest.raises(Exception, match="attribute 'activation' must be 'swiglu' or 'swiglu_oai', got 'gelu'"):
        cuda_ep_session(feeds, activation="gelu").run(None, feeds)
    with pytest.raises(Exception, match="attribute 'limit' must be finite and > 0"):
        cuda_ep_session(feeds, activation="swiglu_oai", limit=0.0).run(None, feeds)
