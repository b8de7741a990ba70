# SPDX-License-Identifier: MIT
"""The fragment model (ort_ops/fragments.py): each W scale group the CUDA kernel computes is the K
set of the MMA that consumes it, and the seed's bug (scales over logical tokens 0-31 / 32-63 on
an interleaved fragment) is caught. CPU only."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ort_ops import fragments as fr


def test_nvidia_layout_covers_each_element_once():
    tgt = fr.TARGETS["nvidia_m16n8k32"]
    a = [s for lane in tgt.a for reg in lane for s in reg]
    b = [s for lane in tgt.b for reg in lane for s in reg]
    d = [s for lane in tgt.d for s in lane]
    assert sorted(a) == [(m, k) for m in range(16) for k in range(32)]
    assert sorted(b) == [(k, n) for k in range(32) for n in range(8)]
    assert sorted(d) == [(m, n) for m in range(16) for n in range(8)]


def test_gfx936_layout_covers_each_element_once():
    tgt = fr.TARGETS["gfx936_16x16x32"]
    assert sorted(s for lane in tgt.a for reg in lane for s in reg) == [(m, k) for m in range(16) for k in range(32)]
    assert sorted(s for lane in tgt.b for reg in lane for s in reg) == [(k, n) for k in range(32) for n in range(16)]
    assert sorted(s for lane in tgt.d for s in lane) == [(m, n) for m in range(16) for n in range(16)]


def test_cuda_kernel_groups_are_the_mma_k_sets():
    pl = fr.nvidia_pv_placement()
    assert fr.consumed_tokens(pl) == [frozenset(range(32)), frozenset(range(32, 64))]
    assert fr.check_scale_groups(pl, fr.CONSECUTIVE_GROUPS) == []


def test_warp_decode_kernel_groups_are_the_mma_k_sets():
    """decode_warp_kernel: each 32-key stage is one MMA and one W scale group; the Q.K column
    permutation leaves lane (g, t) with keys 8t..8t+7, exactly what its 8-byte V read covers."""
    pl = fr.nvidia_pv_placement_warp_decode()
    assert fr.consumed_tokens(pl) == [frozenset(range(32)), frozenset(range(32, 64))]
    assert fr.check_scale_groups(pl, fr.CONSECUTIVE_GROUPS) == []
    # Without the permutation (column n of n-tile j = key 8j + n) lane t would hold keys
    # 2t, 2t+1, 8+2t, ..: its codes no longer match the V bytes it reads, and the model says so.
    a = {}
    for i, lane, reg, byte in pl.a:
        t = lane % 4
        k = 4 * (reg >= 2) + byte  # the lane's k-th accumulator: n-tile k // 2, column 2t + k % 2
        a[(i, lane, reg, byte)] = 32 * i + 8 * (k // 2) + 2 * t + k % 2
    wrong = fr.Placement("warp_decode_unpermuted", pl.target, pl.b, a)
    assert fr.check_scale_groups(wrong) != []


def test_seed_bug_is_caught_on_gfx936():
    """The seed's first kernel: scales over logical 0-31 / 32-63 applied to the interleaved gfx936
    fragment. The check must fail; the seed's fix (groups = what each MMA owns) must pass."""
    pl = fr.gfx936_pv_placement()
    owned = fr.consumed_tokens(pl)
    assert owned[0] == frozenset([*range(8), *range(16, 24), *range(32, 40), *range(48, 56)])
    assert owned[1] == frozenset([*range(8, 16), *range(24, 32), *range(40, 48), *range(56, 64)])
    problems = fr.check_scale_groups(pl, fr.CONSECUTIVE_GROUPS)
    assert len(problems) == 2 and "MMA 0 consumes tokens {0-7,16-23,32-39,48-55}" in problems[0]
    assert fr.check_scale_groups(pl, tuple(owned)) == []


def test_naive_nvidia_16_byte_loads_reproduce_the_seed_interleave():
    """Feeding a lane's 16-byte V load straight into the m16n8k32 B fragment is the seed's bug on
    NVIDIA: that is why the kernel swaps halves between lanes t and t^2."""
    problems = fr.check_scale_groups(fr.nvidia_pv_placement_naive(), fr.CONSECUTIVE_GROUPS)
    assert len(problems) == 2


def _quantized_pv(w, v, ksets, groups, levels=127):
    """W.V over one 64-token tile as an MMA-based kernel computes it: per MMA i, codes from the max
    over groups[i], int32 sum over the tokens MMA i consumes, times that scale."""
    out = np.zeros(v.shape[1], np.float64)
    for kset, grp in zip(ksets, groups):
        gmax = max(w[sorted(grp)])
        toks = sorted(kset)
        codes = np.minimum(np.rint(w[toks] * (levels / gmax)), levels)
        out += (gmax / levels) * (codes @ v[toks].astype(np.float64))
    return out


def test_wrong_groups_change_the_numbers(rng):
    """The model's verdict matches arithmetic: with large W on tokens 8-15 (MMA 1 on gfx936), the
    seed's consecutive groups scale MMA 1 by the max over 32-63, which is far smaller, so its
    codes clip at L and W.V is badly wrong; the owned groups stay within quantization error."""
    w = rng.uniform(0.0, 1e-3, 64)
    w[8:16] = rng.uniform(0.5, 1.0, 8)
    v = rng.integers(-127, 128, (64, 16))
    exact = w @ v
    owned = fr.consumed_tokens(fr.gfx936_pv_placement())
    good = _quantized_pv(w, v, owned, owned)
    bad = _quantized_pv(w, v, owned, fr.CONSECUTIVE_GROUPS)
    bound = sum(max(w[sorted(k)]) / 127 * 0.5 * np.abs(v[sorted(k)]).sum(axis=0) for k in owned)
    assert np.all(np.abs(good - exact) <= bound + 1e-9)
    assert np.abs(bad - exact).max() > 100 * np.abs(good - exact).max()


def test_header_matches_the_model():
    """The CUDA kernel includes fragment_map.h; its constants must be what the model derives."""
    text = (Path(__file__).resolve().parents[1] / "csrc/ops/paged_attention_int8/fragment_map.h").read_text()
    assert text == fr.header_text(), "regenerate with `python -m ort_ops.fragments --emit-header`"
    base = re.search(r"kPvTokenBase\[4\] = \{([^}]*)\}", text).group(1)
    assert tuple(int(x) for x in base.split(",")) == fr.PV_TOKEN_BASE
    assert f"kPvSwapXor = {fr.PV_SWAP_XOR};" in text


@pytest.mark.parametrize("target", sorted(fr.TARGETS))
def test_k_slots_are_filled_consistently_or_refused(target):
    """A placement whose A and B disagree on a k slot is refused (never silently scored)."""
    pl = fr.nvidia_pv_placement() if target.startswith("nvidia") else fr.gfx936_pv_placement()
    a = dict(pl.a)
    key = next(iter(a))
    a[key] = (a[key] + 1) % 64
    broken = fr.Placement("broken", pl.target, pl.b, a)
    with pytest.raises(ValueError, match="A of MMA"):
        fr.k_slot_tokens(broken)
    assert fr.check_scale_groups(broken) != []
