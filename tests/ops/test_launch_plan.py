# SPDX-License-Identifier: MIT
"""The CUDA launch arithmetic without a GPU: PagedAttentionInt8's split count for other GPUs'
limits (SM count, shared memory per SM), through ort_ops_cuda_paged_attention_int8_plan.

The expected counts are worked by hand from the wave model in cuda.cu's tile_shape: with P
partitions of 256 keys and `base` CTAs per split (sequences x kv heads), each split count ns
whose partitions divide evenly costs ceil(base * ns / (SMs * CTAs per SM)) waves of
(keys per CTA + 128); the cheapest wins, fewer splits on ties. The decode kernel's CTA for
D 128 takes 72,000 bytes of shared memory (+1 KB reserved): 2 fit on an H200 (228 KB, the model
caps decode at 2) or an A100 (164 KB), 1 on an L4 (100 KB). For D 32 it takes 34,112 bytes: 2
(the cap) fit on all three. The general kernel's CTA for D 32 with 16 rows (4 warps) takes 30,848
bytes, and its launch bound allows 2 a SM: 2 on all three.
"""

from __future__ import annotations

import ctypes

import pytest

from ort_ops import build_info, get_library_path

H200, A100, L4 = (132, 233472), (108, 167936), (58, 102400)


def _plan(batch, context, sms, smem, *, hq=32, hkv=8, d=128, block=64, window=0):
    if not build_info()["cuda"]:
        pytest.skip("the ort_ops library was built without CUDA")
    fn = ctypes.CDLL(get_library_path()).ort_ops_cuda_paged_attention_int8_plan
    fn.restype = ctypes.c_int
    m = context // block
    # dims: T, S, Hq, Hkv, D, B, M, N, max_q_len, max_context, decode_with_cu, window
    dims = (ctypes.c_int * 12)(batch, batch, hq, hkv, d, block, m, batch * m, 1, context, 0, window)
    return fn(dims, 256, sms, smem)


@pytest.mark.parametrize("gpu,batch,want", [
    (H200, 1, 16),   # 8 CTAs a split: all 16 partitions as splits fit in one wave
    (A100, 1, 16),
    (L4, 1, 6),      # 58 CTAs a wave: 6 splits of 768 keys are one wave (48 CTAs); 8 would take two
    (H200, 32, 1),   # 256 CTAs fit one wave of 264 unsplit
    (A100, 32, 4),   # 216 a wave: 4 splits in 5 waves of 1024 keys beat 1 split in 2 of 4096
    (L4, 32, 2),
], ids=["h200-b1", "a100-b1", "l4-b1", "h200-b32", "a100-b32", "l4-b32"])
def test_decode_split_count_for_other_gpus(gpu, batch, want):
    assert _plan(batch, 4096, *gpu) == want


@pytest.mark.parametrize("gpu,batch,hkv,want", [
    # Decode kernel (G 4): as D 128 where 2 CTAs a SM fit both; on an L4, 2 fit instead of 1.
    (H200, 1, 8, 16),
    (H200, 32, 8, 1),
    (L4, 1, 8, 8),   # 116 a wave: 8 splits of 512 keys are one wave (64 CTAs); 16 would take two
    (L4, 32, 8, 4),  # 256 CTAs a split: 4 splits in 9 waves of 1024 keys beat 2 in 5 of 2048
    # General kernel (G 16, 2 CTAs a split at batch 1, 64 at batch 32).
    (H200, 1, 2, 16),
    (H200, 32, 2, 4),  # 264 a wave: 4 splits in one wave of 1024 keys
    (A100, 32, 2, 3),  # 216 a wave: 3 splits in one wave of 1536 keys beat 4 in two of 1024
    (L4, 32, 2, 8),    # 116 a wave: 8 splits in 5 waves of 512 keys
], ids=["h200-b1", "h200-b32", "l4-b1", "l4-b32", "general-h200-b1", "general-h200-b32",
        "general-a100-b32", "general-l4-b32"])
def test_head_dim_32_split_count(gpu, batch, hkv, want):
    """D 32 (32 q heads): the decode kernel at 8 kv heads, the general kernel at 2 (G 16)."""
    assert _plan(batch, 4096, *gpu, hkv=hkv, d=32) == want


def test_unsupported_dims_and_limits_are_refused():
    assert _plan(1, 4096, 132, 233472, d=96) == -1
    assert _plan(1, 4096, 132, 233472, d=16) == -1
    assert _plan(1, 4096, 0, 233472) == -1


@pytest.mark.parametrize("gpu,window,want", [
    (H200, 4096, 16),  # a window as long as the context: as without one
    (H200, 1000, 5),   # span 1000 + 63 keys: 5 partitions, all splits in one wave
    (H200, 200, 2),    # span 263: 2 partitions
    (L4, 1000, 5),     # 8 CTAs a split, 58 a wave: 5 splits of one partition are one wave (40 CTAs)
], ids=["h200-w4096", "h200-w1000", "h200-w200", "l4-w1000"])
def test_decode_with_a_window_splits_its_span(gpu, window, want):
    """Decode with a window splits the window's span (+ 63 keys of alignment), not the context:
    the partitions before the window get no CTAs (batch 1, 4096 keys)."""
    assert _plan(1, 4096, *gpu, window=window) == want
