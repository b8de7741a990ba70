# SPDX-License-Identifier: MIT
"""Fragment model of the INT8 matrix instructions the attention kernels use, as data per target.

A matrix instruction computes D[m, n] += sum_k A[m, k] * B[k, n] over registers spread across the
lanes of a warp (NVIDIA) or wave (gfx936). Which lane holds which element is the instruction's
*fragment layout*; a kernel that puts token t of a P.V tile into some lane's register byte
thereby decides which MMA (and which k slot of it) consumes t. DESIGN.md requires each W scale
group (32 consecutive key positions) to be exactly the K set of the MMA that consumes it; this
module checks that from the tables below, so a port to another target adds a table, not a rewrite.

Alphabet: M/N/K the instruction's shape; lane l; reg r (32-bit register of the operand); byte b
(0..3 within the register, INT8 elements); g = l // 4, t = l % 4 on NVIDIA.

Targets (``TARGETS``):
    "nvidia_m16n8k32": ``mma.sync.aligned.m16n8k32.row.col.s32.{s8,u8}.s8.s32`` (sm_80+), 32 lanes.
        A 16x32 row-major, 4 regs: r0 = (g, 4t+b), r1 = (g+8, 4t+b), r2 = (g, 16+4t+b),
        r3 = (g+8, 16+4t+b). B 32x8 col-major, 2 regs: r0 = (4t+b, g), r1 = (16+4t+b, g).
        D 16x8 s32, 4 regs: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
    "gfx936_16x16x32": the seed's ``v_mmac_i32_16x16x32_i8``, 64 lanes. Modelled with the CDNA-style
        layout that produces the interleave seed 000 measured: lane l holds row/column l % 16 and
        k 8 * (l // 16) + (0..7) in 2 regs of A and of B; D 4 regs: (4 * (l // 16) + r, l % 16).

Placements (how a kernel lays a 64-token P.V tile into fragments; ``Placement``):
    ``nvidia_pv_placement()``: the CUDA kernel's (csrc/ops/paged_attention_int8/cuda.cu). Lane
        (g, t) reads 16 consecutive tokens 16t..16t+15 of V column g with one 16-byte read of the
        stage buffer (which cp.async fills from the token-innermost cache in 16-byte pieces;
        regs x0..x3), then swaps x2,x3 with lane t^2's x0,x1 (``__shfl_xor_sync(.., 2)``), so
        that MMA 0 holds tokens 0..31 and MMA 1 tokens 32..63. The A side (W codes from shared
        memory) reads, for MMA i and lane t, the 8 tokens starting at
        ``32 i + PV_TOKEN_BASE[t]``, PV_TOKEN_BASE = (0, 16, 8, 24).
    ``nvidia_pv_placement_naive()``: the same 16-byte loads without the swap (x0,x1 -> MMA 0,
        x2,x3 -> MMA 1): MMA 0 then holds {0-7, 16-23, 32-39, 48-55}, the seed's interleave.
    ``gfx936_pv_placement()``: the seed's kernel: lane l loads tokens 16 (l // 16) .. +15 of column
        l % 16, the first 8 into MMA 0, the next 8 into MMA 1.

``check_scale_groups(target, placement, groups)`` returns the list of problems (empty: the groups
are the K sets); the seed's bug is ``groups = CONSECUTIVE_GROUPS`` with the gfx936 placement.
``emit_header()`` writes the constants the CUDA kernel includes (``fragment_map.h``); the tests
check that the header and this table agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

Slot = tuple[int, int]  # (row, k) for A, (k, col) for B, (row, col) for D


@dataclasses.dataclass(frozen=True)
class MmaTarget:
    """One integer matrix instruction's fragment layout, as data.

    ``a[lane][reg][byte] = (row, k)``, ``b[lane][reg][byte] = (k, col)``, ``d[lane][reg] = (row, col)``.
    """

    name: str
    instruction: str
    m: int
    n: int
    k: int
    lanes: int
    a: tuple[tuple[tuple[Slot, ...], ...], ...]
    b: tuple[tuple[tuple[Slot, ...], ...], ...]
    d: tuple[tuple[Slot, ...], ...]


def _nvidia_m16n8k32() -> MmaTarget:
    a, b, d = [], [], []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a.append(tuple(tuple((row, kb + 4 * t + byte) for byte in range(4))
                       for row, kb in ((g, 0), (g + 8, 0), (g, 16), (g + 8, 16))))
        b.append(tuple(tuple((kb + 4 * t + byte, g) for byte in range(4)) for kb in (0, 16)))
        d.append(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)))
    return MmaTarget("nvidia_m16n8k32", "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32",
                     16, 8, 32, 32, tuple(a), tuple(b), tuple(d))


def _gfx936_16x16x32() -> MmaTarget:
    a, b, d = [], [], []
    for lane in range(64):
        i, blk = lane % 16, lane // 16
        a.append(tuple(tuple((i, 8 * blk + 4 * r + byte) for byte in range(4)) for r in range(2)))
        b.append(tuple(tuple((8 * blk + 4 * r + byte, i) for byte in range(4)) for r in range(2)))
        d.append(tuple((4 * blk + r, i) for r in range(4)))
    return MmaTarget("gfx936_16x16x32", "v_mmac_i32_16x16x32_i8", 16, 16, 32, 64,
                     tuple(a), tuple(b), tuple(d))


TARGETS: dict[str, MmaTarget] = {t.name: t for t in (_nvidia_m16n8k32(), _gfx936_16x16x32())}

TILE_TOKENS = 64  # one P.V tile: two MMAs of K = 32
GROUP = 32        # DESIGN.md's W scale group: key positions [32g, 32g + 32)
CONSECUTIVE_GROUPS = (frozenset(range(32)), frozenset(range(32, 64)))

# The CUDA kernel's A-side token base per lane quad index t (see the module docstring).
PV_TOKEN_BASE = (0, 16, 8, 24)
PV_SWAP_XOR = 2  # lane t swaps half of its 16-byte load with lane t ^ 2


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a kernel puts each token of a 64-token P.V tile.

    ``b[(mma, lane, reg, byte)] = token`` (the V byte of that token, for the lane's B column) and
    ``a[(mma, lane, reg, byte)] = token`` (the W code of that token, for the lane's A row).
    """

    name: str
    target: str
    b: Mapping[tuple[int, int, int, int], int]
    a: Mapping[tuple[int, int, int, int], int]
    num_mma: int = 2


def _nvidia_a_side(base_of: dict[tuple[int, int], int]) -> dict:
    """A-side placement: for MMA i, lane (g, t), A reg r holds k slots whose tokens are the ones
    B holds at the same k slots; ``base_of[(i, t)]`` is the first of the lane's 8 tokens."""
    a = {}
    for i in range(2):
        for lane in range(32):
            t = lane % 4
            base = base_of[(i, t)]
            # A r0/r1 (rows g, g+8) share k slots 4t.. with B r0; A r2/r3 share 16+4t.. with B r1.
            for reg, off in ((0, 0), (1, 0), (2, 4), (3, 4)):
                for byte in range(4):
                    a[(i, lane, reg, byte)] = base + off + byte
    return a


def nvidia_pv_placement() -> Placement:
    """The CUDA kernel's placement: 16-byte loads plus the lane t <-> t^2 half swap."""
    b = {}
    base_of = {}
    for lane in range(32):
        t = lane % 4
        partner = t ^ PV_SWAP_XOR
        # Lane t's load: x_j = tokens 16t + 4j .. +3. Lanes t < 2 keep x0,x1 for MMA 0 and receive
        # the partner's x0,x1 for MMA 1; lanes t >= 2 receive the partner's x2,x3 for MMA 0 and
        # keep their own x2,x3 for MMA 1 (the CUDA code does this with one select and one shuffle
        # per register).
        own = [[16 * t + 4 * j + byte for byte in range(4)] for j in range(4)]
        theirs = [[16 * partner + 4 * j + byte for byte in range(4)] for j in range(4)]
        if t < 2:
            mma0, mma1 = own[0:2], theirs[0:2]
        else:
            mma0, mma1 = theirs[2:4], own[2:4]
        for i, regs in ((0, mma0), (1, mma1)):
            for reg in range(2):
                for byte in range(4):
                    b[(i, lane, reg, byte)] = regs[reg][byte]
            base_of[(i, t)] = regs[0][0]
    return Placement("nvidia_swap", "nvidia_m16n8k32", b, _nvidia_a_side(base_of))


def nvidia_pv_placement_naive() -> Placement:
    """16-byte loads fed straight into the fragments (x0,x1 -> MMA 0, x2,x3 -> MMA 1)."""
    b = {}
    base_of = {}
    for lane in range(32):
        t = lane % 4
        own = [[16 * t + 4 * j + byte for byte in range(4)] for j in range(4)]
        for i, regs in ((0, own[0:2]), (1, own[2:4])):
            for reg in range(2):
                for byte in range(4):
                    b[(i, lane, reg, byte)] = regs[reg][byte]
            base_of[(i, t)] = regs[0][0]
    return Placement("nvidia_naive", "nvidia_m16n8k32", b, _nvidia_a_side(base_of))


def nvidia_qk_decode_keys(target: MmaTarget | None = None) -> dict[tuple[int, int], int]:
    """Warp-decode kernel (decode_warp_kernel in cuda.cu), Q.K side: column n of n-tile j
    (j = 0..3 over a 32-key stage) is key 8 (n // 2) + 2j + n % 2. Returns (lane, j * 2 + e) ->
    key for the lane's row-g accumulators D r0 / r1 (e = 0 / 1) of n-tile j, read off the
    target's D table: lane (g, t) ends up with keys 8t .. 8t+7, the A slots it feeds to P.V."""
    tgt = target or TARGETS["nvidia_m16n8k32"]
    out = {}
    for lane in range(32):
        for j in range(4):
            for e in range(2):
                _row, col = tgt.d[lane][e]
                out[(lane, 2 * j + e)] = 8 * (col // 2) + 2 * j + col % 2
    return out


def nvidia_pv_placement_warp_decode() -> Placement:
    """The warp-decode kernel's P.V: a 32-key stage is one MMA (the tile's MMA i is stage i);
    lane (g, t) reads V row g of keys 8t .. 8t+7 with one 8-byte read (B r0 = keys 8t..8t+3,
    r1 = 8t+4..8t+7) and its A slots are the codes of its own Q.K keys (nvidia_qk_decode_keys)."""
    qk = nvidia_qk_decode_keys()
    b, base_of = {}, {}
    for i in range(2):
        for lane in range(32):
            t = lane % 4
            keys = [qk[(lane, k)] for k in range(8)]
            if keys != list(range(8 * t, 8 * t + 8)):
                raise ValueError(f"warp decode: lane {lane} holds keys {keys}, not {8 * t}..{8 * t + 7}")
            for reg in range(2):
                for byte in range(4):
                    b[(i, lane, reg, byte)] = 32 * i + 8 * t + 4 * reg + byte
            base_of[(i, t)] = 32 * i + 8 * t
    return Placement("nvidia_warp_decode", "nvidia_m16n8k32", b, _nvidia_a_side(base_of))


def gfx936_pv_placement() -> Placement:
    """The seed's gfx936 kernel: lane l takes 16 tokens 16 (l // 16).. of column l % 16 with one
    16-byte load; the first 8 go to MMA 0, the next 8 to MMA 1 (A reads the same tokens)."""
    b, a = {}, {}
    for lane in range(64):
        blk = lane // 16
        for i in range(2):
            for reg in range(2):
                for byte in range(4):
                    tok = 16 * blk + 8 * i + 4 * reg + byte
                    b[(i, lane, reg, byte)] = tok
                    a[(i, lane, reg, byte)] = tok
    return Placement("gfx936_seed", "gfx936_16x16x32", b, a)


def k_slot_tokens(placement: Placement) -> list[dict[int, int]]:
    """For each MMA, k slot -> token, checked consistent over every B column and A row.

    Raises:
        ValueError: a k slot holds different tokens in two lanes, in A and B, or is unfilled.
    """
    tgt = TARGETS[placement.target]
    out: list[dict[int, int]] = [{} for _ in range(placement.num_mma)]
    for (i, lane, reg, byte), tok in placement.b.items():
        k, _col = tgt.b[lane][reg][byte]
        prev = out[i].setdefault(k, tok)
        if prev != tok:
            raise ValueError(f"{placement.name}: B of MMA {i} holds tokens {prev} and {tok} at k = {k}")
    for (i, lane, reg, byte), tok in placement.a.items():
        _row, k = tgt.a[lane][reg][byte]
        if out[i].get(k) != tok:
            raise ValueError(f"{placement.name}: A of MMA {i} holds token {tok} at k = {k}, "
                             f"B holds {out[i].get(k)}")
    for i, slots in enumerate(out):
        if sorted(slots) != list(range(tgt.k)):
            raise ValueError(f"{placement.name}: MMA {i} fills k slots {sorted(slots)}, not 0..{tgt.k - 1}")
    return out


def consumed_tokens(placement: Placement) -> list[frozenset[int]]:
    """The set of tokens each MMA of the tile consumes (its K set)."""
    return [frozenset(slots.values()) for slots in k_slot_tokens(placement)]


def check_scale_groups(placement: Placement, groups=CONSECUTIVE_GROUPS) -> list[str]:
    """Problems with applying scale group ``groups[i]`` to MMA i (empty list: every group is
    exactly its MMA's K set, so each MMA's int32 sum is scaled by the max over its own tokens)."""
    problems = []
    try:
        ksets = consumed_tokens(placement)
    except ValueError as e:
        return [str(e)]
    for i, (kset, grp) in enumerate(zip(ksets, groups)):
        if kset != grp:
            problems.append(f"{placement.name}: MMA {i} consumes tokens {_ranges(kset)} but its scale "
                            f"group covers {_ranges(grp)}")
    return problems


def _ranges(tokens) -> str:
    s = sorted(tokens)
    out, start = [], None
    for j, x in enumerate(s):
        if start is None:
            start = x
        if j + 1 == len(s) or s[j + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return "{" + ",".join(out) + "}"


HEADER_PATH = Path(__file__).resolve().parent.parent / "csrc/ops/paged_attention_int8/fragment_map.h"


def header_text() -> str:
    """The C++ header with the CUDA kernel's P.V placement constants, derived from this model."""
    pl = nvidia_pv_placement()
    ksets = consumed_tokens(pl)
    assert check_scale_groups(pl) == [], check_scale_groups(pl)
    bases = []
    for t in range(4):
        bases.append(pl.a[(0, t, 0, 0)])  # lane t (g = 0), MMA 0, A r0 byte 0
    assert tuple(bases) == PV_TOKEN_BASE, bases
    assert ksets[1] == frozenset(x + 32 for x in ksets[0])
    return (
        "// SPDX-License-Identifier: MIT\n"
        "// generated by `python -m ort_ops.fragments --emit-header` (ort_ops/fragments.py), do not edit.\n"
        "// P.V fragment placement of the CUDA PagedAttentionInt8 kernel for mma.sync m16n8k32: lane\n"
        "// (g, t) loads V tokens 16t..16t+15 of column g (one 16-byte load, regs x0..x3), swaps\n"
        "// x2,x3 <-> lane t^2's x0,x1, and then MMA i consumes tokens 32i..32i+31 (one W scale group\n"
        "// each; tests/test_fragments.py proves it). A (W codes) for MMA i, lane t reads the 8 tokens\n"
        "// at 32i + kPvTokenBase[t]: A r0/r1 the first 4, A r2/r3 the next 4.\n"
        "#pragma once\n\n"
        "namespace ort_ops {\nnamespace pa_fragment {\n"
        f"constexpr int kTileTokens = {TILE_TOKENS};\n"
        f"constexpr int kGroupTokens = {GROUP};\n"
        f"constexpr int kPvSwapXor = {PV_SWAP_XOR};\n"
        "constexpr int kPvTokenBase[4] = {" + ", ".join(str(x) for x in PV_TOKEN_BASE) + "};\n"
        "}  // namespace pa_fragment\n}  // namespace ort_ops\n"
    )


def emit_header(path: Path = HEADER_PATH) -> Path:
    path.write_text(header_text())
    return path


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--emit-header"]:
        print(emit_header())
    else:
        for pl in (nvidia_pv_placement(), nvidia_pv_placement_naive(), gfx936_pv_placement()):
            print(pl.name, [_ranges(s) for s in consumed_tokens(pl)], check_scale_groups(pl) or "ok")
