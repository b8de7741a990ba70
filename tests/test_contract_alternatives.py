# SPDX-License-Identifier: MIT
"""benchmarks/contract_alternatives.py's alternatives (issue 21, item 3) on tiny random inputs.

Each expected value comes from outside the code under test: the contract's numpy references
(``ort_ops.reference``), or a direct float64 loop written here from DESIGN.md's rules.
  - P.V groups: the script's path at 32 equals the reference bit for bit; at 16 it equals a float64
    loop over groups of 16; and where every 32-group's two halves hold the same W (mirrored keys)
    16 and 32 give the same codes, so its 16-group output equals the reference's.
  - SwiGLU output scales: per-I-column groups (one group) equal the contract chain bit for bit;
    per-32 columns equal a float64 loop over tokens, slots and column groups.
No trained model and no torch needed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import contract_alternatives as ca
from ort_ops import reference as R
from ort_ops.ops._quant import quantize_expert_weights, quantize_rows
from ort_ops.ops.paged_attention_int8 import PV_LEVELS, build_paged_cache, gather_sequence

CACHE = ("key_cache", "value_cache", "key_scale", "value_scale", "block_tables", "seq_lens")


def _attn_case(rng, lens=(75, 130), q_lens=(5, 1), hq=4, hkv=2, d=64, b=16):
    lens = np.asarray(lens)
    cuk = np.concatenate([[0], np.cumsum(lens)])
    k = (rng.standard_normal((cuk[-1], hkv, d)) * 1.5).astype(np.float32)
    v = rng.standard_normal((cuk[-1], hkv, d)).astype(np.float32)
    cache = build_paged_cache(k, v, cuk, b, rng)
    q = (rng.standard_normal((int(np.sum(q_lens)), hq, d)) * 2.0).astype(np.float32)
    cuq = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, cache, cuq


def _brute_groups(q, cache, cuq, pv_quant, group):
    """float64 loop per sequence, head, query and group of ``group`` absolute key positions:
    s = (Qq . Kq) sQ sK / sqrt(D), P = softmax over keys <= the query's position, W = P sV,
    codes = min(rint(W L / max_g W), L), O = sum_g max_g W / L * sum codes Vq. Also the largest
    code step max_g W / L (a float32 / float64 tie moves a code by one: at most step * 127)."""
    t, hq, d = q.shape
    hkv = cache["key_cache"].shape[1]
    levels = PV_LEVELS[pv_quant]
    out = np.zeros((t, hq, d))
    step = 0.0
    for s, length in enumerate(cache["seq_lens"].astype(int)):
        kq, sk, vq, sv = gather_sequence(*(cache[n] for n in CACHE[:4]), cache["block_tables"][s], length)
        n = cuq[s + 1] - cuq[s]
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(n):
                qq, sq = quantize_rows(q[cuq[s] + i, h])
                pos = length - n + i
                sc = np.array([float(qq.astype(np.int64) @ kq[j, kh].astype(np.int64)) * float(sq) * float(sk[j, kh])
                               for j in range(pos + 1)]) / math.sqrt(d)
                p = np.exp(sc - sc.max())
                w = p / p.sum() * sv[:pos + 1, kh].astype(np.float64)
                for g0 in range(0, pos + 1, group):
                    wg = w[g0:g0 + group]
                    gmax = wg.max()
                    codes = np.minimum(np.rint(wg * levels / gmax), levels)
                    out[cuq[s] + i, h] += gmax / levels * (codes @ vq[g0:g0 + len(wg), kh].astype(np.float64))
                    step = max(step, gmax / levels)
    return out, step


@pytest.mark.parametrize("pv_quant", ["s8", "u8"])
def test_own_path_at_32_equals_the_reference(rng, pv_quant):
    q, cache, cuq = _attn_case(rng)
    ref = R.paged_attention_int8(q, *(cache[n] for n in CACHE), cuq, qk_quant="s8", pv_quant=pv_quant)
    got = ca.paged_attention_groups(q, cache, cuq, pv_quant, 32)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("pv_quant", ["s8", "u8"])
def test_16_token_groups_equal_a_float64_loop(rng, pv_quant):
    q, cache, cuq = _attn_case(rng)
    got = ca.paged_attention_groups(q, cache, cuq, pv_quant, 16)
    want, step = _brute_groups(q, cache, cuq, pv_quant, 16)
    # float32 exp / sums against float64: equal to float32 rounding, except that a W at a rounding
    # tie may take the neighbouring code (one code step times |Vq| <= 127).
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=step * 127 + 1e-6)
    assert np.abs(got - want).mean() < 1e-4 * np.abs(want).mean()
    # Not vacuous: groups of 16 do change the result against the contract's 32.
    ref32 = R.paged_attention_int8(q, *(cache[n] for n in CACHE), cuq, qk_quant="s8", pv_quant=pv_quant)
    assert not np.array_equal(got, ref32)


@pytest.mark.parametrize("pv_quant", ["s8", "u8"])
def test_16_token_groups_equal_the_reference_where_halves_mirror(rng, pv_quant):
    """Keys 16..31 of every 32-group repeat keys 0..15 (same codes and scales), values are the same
    channels reversed (same per-token scale): every W of a half equals one of the other half, so
    the max W of each 16-group is that of its 32-group and all codes are the contract's."""
    hkv, d, length = 1, 64, 96
    k16 = rng.standard_normal((length // 32, 16, hkv, d)).astype(np.float32) * 1.5
    v16 = rng.standard_normal((length // 32, 16, hkv, d)).astype(np.float32)
    k = np.concatenate([k16, k16], axis=1).reshape(length, hkv, d)
    v = np.concatenate([v16, v16[..., ::-1]], axis=1).reshape(length, hkv, d)
    cache = build_paged_cache(k, v, np.array([0, length]), 16, rng)
    q = rng.standard_normal((1, 2, d)).astype(np.float32) * 2.0    # decode: the query sees all 96 keys
    cuq = np.array([0, 1], np.int32)
    ref = R.paged_attention_int8(q, *(cache[n] for n in CACHE), cuq, qk_quant="s8", pv_quant=pv_quant)
    got = ca.paged_attention_groups(q, cache, cuq, pv_quant, 16)
    # Same codes; only the sum of two 16-group terms against one 32-group term rounds differently.
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def _moe_case(rng, t=24, h=64, inter=128, e=4, k=2):
    x = rng.standard_normal((t, h)).astype(np.float32)
    w_gate_up = (rng.standard_normal((e, h, 2 * inter)) / math.sqrt(h)).astype(np.float32)
    w_down = (rng.standard_normal((e, inter, h)) / math.sqrt(inter)).astype(np.float32)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int64)
    wts = rng.dirichlet(np.ones(k), t).astype(np.float32)
    return x, ids, wts, w_gate_up, w_down


def test_one_column_group_equals_the_contract_chain(rng):
    x, ids, wts, gu, dn = _moe_case(rng)
    q = ca.expert_weights(gu, dn)
    assert np.array_equal(ca.moe_columns(x, ids, wts, q, 128), ca.moe_contract(x, ids, wts, q))
    # and moe_contract is the references' chain, written out here once more
    gq, gs, dq, ds = q
    xq, xs = R.dynamic_quant(x)
    sx, s2f, gl, sxs = R.moe_init_routing(xq, ids.astype(np.int32), 4, x_scale=xs)
    y, ys, _ = R.grouped_matmul_swiglu_quant(sx, gq, gs, sxs, gl)
    want = R.moe_finalize_routing(R.grouped_matmul_dequant(y, dq, ds, ys, gl), s2f, wts)
    assert np.array_equal(ca.moe_contract(x, ids, wts, q), want)


def test_32_column_groups_equal_a_float64_loop(rng):
    x, ids, wts, gu, dn = _moe_case(rng)
    cols = 32
    got = ca.moe_columns(x, ids, wts, ca.expert_weights(gu, dn), cols)
    gq, gs = quantize_expert_weights(gu)
    dq, ds = quantize_expert_weights(dn)
    inter = dn.shape[1]
    want = np.zeros(x.shape)
    flip = 0.0
    for t in range(x.shape[0]):
        xq, xs = quantize_rows(x[t])
        for j in range(ids.shape[1]):
            e = ids[t, j]
            c = (xq.astype(np.float64) @ gq[e].astype(np.float64)) * float(xs) * gs[e].astype(np.float64)
            a, g = c[:inter], c[inter:]
            s = a / (1 + np.exp(-a)) * g
            y = np.zeros(dn.shape[2])
            for g0 in range(0, inter, cols):
                amax = np.abs(s[g0:g0 + cols]).max()
                codes = np.clip(np.rint(s[g0:g0 + cols] * 127 / amax), -127, 127)
                y += amax / 127 * (codes @ dq[e, g0:g0 + cols].astype(np.float64)) * ds[e].astype(np.float64)
                flip = max(flip, amax / 127 * float(np.abs(dq[e, g0:g0 + cols] * ds[e]).max()))
            want[t] += float(wts[t, j]) * y
    # float32 recipe against float64: a code at a rounding tie may move by one (flip per slot).
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2 * flip + 1e-6)
    assert np.abs(got - want).mean() < 1e-4 * np.abs(want).mean()
    assert not np.array_equal(got, ca.moe_columns(x, ids, wts, ca.expert_weights(gu, dn), 128))


def test_error_accumulator_and_part():
    e = ca.Err()
    e.add(np.array([1.0, 2.0]), np.array([1.0, 1.0]))
    e.add(np.array([0.0]), np.array([1.0]))
    assert e.rel == pytest.approx(math.sqrt(2 / 3)) and e.amax == 1.0
    assert ca.part(5.0, 3.0) == pytest.approx(4.0) and ca.part(1.0, 2.0) == 0.0
