# SPDX-License-Identifier: MIT
"""The CUDA launch arithmetic without a GPU: PagedAttentionInt8's split count for other GPUs'
limits (SM count, shared memory per SM), through ort_ops_cuda_paged_attention_int8_plan.

The expected counts are worked by hand from the wave model in cuda.cu's tile_shape: with P
partitions of 256 keys and `base` CTAs per split (sequences x kv heads), each split count ns
whose partitions divide evenly costs ceil(base * ns / (SMs * CTAs per SM)) waves of
(keys per CTA + 128); the cheapest wins, fewer splits on ties. The decode kernel's CTA for
D 128 takes 72,000 bytes of shared memory (+1 KB reserved): 2 fit on an H200 (228 KB, the model
caps decode at 2) or an A100 (164 KB), 1 on an L4 (100 KB).
"""

from __future__ import annotations

import ctypes

import pytest

from ort_ops import build_info, get_library_path

H200, A100, L4 = (132, 233472), (108, 167936), (58, 102400)


def _plan(batch, context, sms, smem, *, hq=32, hkv=8, d=128, block=64):
    if not build_info()["cuda"]:
        pytest.skip("the ort_ops library was built without CUDA")
    fn = ctypes.CDLL(get_library_path()).ort_ops_cuda_paged_attention_int8_plan
    fn.restype = ctypes.c_int
    m = context // block
    # dims: T, S, Hq, Hkv, D, B, M, N, max_q_len, max_context, decode_with_cu
    dims = (ctypes.c_int * 11)(batch, batch, hq, hkv, d, block, m, batch * m, 1, context, 0)
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


def test_unsupported_dims_and_limits_are_refused():
    assert _plan(1, 4096, 132, 233472, d=96) == -1
    assert _plan(1, 4096, 0, 233472) == -1
