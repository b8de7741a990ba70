# SPDX-License-Identifier: MIT
"""RotaryQuantizeKVCache on NVIDIA GPUs against ort_ops.reference.rotary_quantize_kv_cache: query,
codes and scales bit-exact (the kernel does the reference's float32 operations with _rn intrinsics,
then QuantizeKVCache's device functions).

All ``@pytest.mark.cuda`` (they skip without a GPU, torch or onnxruntime-gpu, or a CUDA build of the
library): the launcher through ctypes on torch tensors (decode and 2048-token prefill, D 32-256,
the device status bits), one-node sessions on ORT's CUDA EP (bad slots and non-finite K/V reported
as DESIGN.md "Bad input on the CUDA EP" says), and capture into a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_ops import reference
from tests.ops.device_errors import assert_reported_both_ways
from tests.ops.test_moe_cuda import _providers_of, cuda_ep_session, torch_cuda  # noqa: F401  (fixtures)
from tests.ops.test_rotary_quantize_kv_cache import CACHE_NAMES, _assert_exact, _inputs

cuda = pytest.mark.cuda

# (Hq, Hkv, D, R/2): GQA and MHA, D 32..256, full and partial rotary widths.
CASES = [(8, 2, 32, 16), (8, 2, 64, 32), (4, 4, 128, 32), (4, 1, 128, 64), (8, 2, 256, 128), (4, 1, 256, 64)]
CASE_IDS = [f"hq{hq}-hkv{hkv}-d{d}-r{2 * half}" for hq, hkv, d, half in CASES]


def _run_launcher(torch, ins, hq, hkv, interleaved):
    """The launcher on device copies of ``ins``, query poisoned with NaN (an unwritten element
    fails); returns ([query, *caches] as numpy, status word)."""
    from ort_ops.testing.attention_launchers import rotary_quantize_kv_cache

    dev = {k: torch.from_numpy(np.ascontiguousarray(v)).cuda() for k, v in ins.items()}
    t, width = ins["qkv"].shape
    d = width // (hq + 2 * hkv)
    poison = torch.full((t, hq, d), float("nan"), dtype=dev["qkv"].dtype, device="cuda")
    query, status = rotary_quantize_kv_cache(*(dev[k] for k in ("qkv", "cos", "sin", "slot_mapping", *CACHE_NAMES)),
                                             num_heads=hq, kv_num_heads=hkv, interleaved=interleaved, query=poison)
    return [query.cpu().numpy(), *(dev[k].cpu().numpy() for k in CACHE_NAMES)], status


@cuda
@pytest.mark.parametrize("t", [1, 37])
@pytest.mark.parametrize("hq,hkv,d,half", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_launcher_bit_exact(torch_cuda, rng, dtype, interleaved, hq, hkv, d, half, t):  # noqa: F811
    ins = _inputs(rng, t, hq, hkv, d, half, dtype=dtype)
    got, status = _run_launcher(torch_cuda, ins, hq, hkv, interleaved)
    assert status == 0
    _assert_exact(got, reference.rotary_quantize_kv_cache(**ins, num_heads=hq, kv_num_heads=hkv,
                                                          interleaved=interleaved))


@cuda
@pytest.mark.parametrize("hq,hkv,d,half", [(8, 2, 128, 64), (4, 1, 256, 64), (8, 2, 32, 16)],
                         ids=["d128", "d256-partial", "d32"])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_launcher_prefill_2048(torch_cuda, rng, dtype, interleaved, hq, hkv, d, half):  # noqa: F811
    """A 2048-token prefill: the slot check runs as its own kernel (T > 64) before the writers."""
    ins = _inputs(rng, 2048, hq, hkv, d, half, n=2048 // 16 + 8, b=16, dtype=dtype, skip=0.05)
    got, status = _run_launcher(torch_cuda, ins, hq, hkv, interleaved)
    assert status == 0
    _assert_exact(got, reference.rotary_quantize_kv_cache(**ins, num_heads=hq, kv_num_heads=hkv,
                                                          interleaved=interleaved))


@cuda
@pytest.mark.parametrize("t", [4, 64, 65, 300])  # the in-kernel check (T <= 64) and the check kernel
def test_launcher_flags_bad_slots_and_non_finite(torch_cuda, rng, t):  # noqa: F811
    """A slot past the cache or a live slot twice: bit 1, and no cache byte of the launch is written
    (query still is). A NaN in a live token's K or V: bit 2, only that vector unwritten. A NaN in Q:
    no bit, the query carries it."""
    hq, hkv, d, half, b = 4, 2, 64, 32, 16
    n = (t + b - 1) // b + 1
    ins = _inputs(rng, t, hq, hkv, d, half, n=n, b=b, skip=0.0)
    ins["slot_mapping"][[t // 2, t - 1]] = -1  # skipped tokens may repeat
    good = ins["slot_mapping"].copy()
    want = reference.rotary_quantize_kv_cache(**ins, num_heads=hq, kv_num_heads=hkv)
    for why, slots in (("past the end", np.where(np.arange(t) == t - 2, n * b, good)),
                       ("repeated", np.where(np.arange(t) == t - 2, good[0], good))):
        got, status = _run_launcher(torch_cuda, dict(ins, slot_mapping=slots), hq, hkv, 0)
        assert status & 1, why
        _assert_exact(got[1:], [ins[k] for k in CACHE_NAMES], CACHE_NAMES)
        _assert_exact(got[:1], want[:1], ("query",))

    bad = dict(ins, qkv=ins["qkv"].copy())
    bad["qkv"][0, (hq + 1) * d + 5] = np.nan          # K of token 0, kv head 1
    bad["qkv"][1, (hq + hkv) * d + 7] = np.inf        # V of token 1, kv head 0
    bad["qkv"][t // 2, (hq + 1) * d] = np.nan         # K of a skipped token: never read
    bad["qkv"][t - 1, 3] = np.nan                     # Q of a skipped token: not an error, still rotated
    got, status = _run_launcher(torch_cuda, bad, hq, hkv, 0)
    assert status == 2
    blk0, off0 = divmod(int(good[0]), b)
    blk1, off1 = divmod(int(good[1]), b)
    # The flagged vectors keep the old cache bytes; every other slot has the reference's.
    expect = [w.copy() for w in want[1:]]
    expect[0][blk0, 1, off0] = ins["key_cache"][blk0, 1, off0]
    expect[2][blk0, 1, off0] = ins["key_scale"][blk0, 1, off0]
    expect[1][blk1, 0, :, off1] = ins["value_cache"][blk1, 0, :, off1]
    expect[3][blk1, 0, off1] = ins["value_scale"][blk1, 0, off1]
    _assert_exact(got[1:], expect, CACHE_NAMES)
    assert np.isnan(got[0][t - 1, 0, 3])


@cuda
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cuda_ep_session(cuda_ep_session, rng, dtype, interleaved):  # noqa: F811
    from ort_ops.ops import rotary_quantize_kv_cache as mod

    attrs = {"num_heads": 8, "kv_num_heads": 2, "interleaved": interleaved}
    for t in (37, 300, 0):  # in-kernel slot check, check kernel, nothing to do
        ins = _inputs(rng, t, 8, 2, 128, 32, n=32, b=16, dtype=dtype)
        sess = cuda_ep_session(ins, schema=mod.SCHEMA, **attrs)
        got = sess.run(None, ins)
        assert _providers_of(sess, "RotaryQuantizeKVCache") == {"CUDAExecutionProvider"}
        _assert_exact(got, reference.rotary_quantize_kv_cache(**ins, **attrs))
    with pytest.raises(Exception, match=r"RotaryQuantizeKVCache: input 'qkv' must have a last dim"):
        sess.run(None, dict(ins, qkv=ins["qkv"][:, :-2].copy()))


@cuda
def test_cuda_ep_reports_bad_slots_and_non_finite(cuda_ep_session, rng):  # noqa: F811
    """Found on the device, reported after the Run or at the node's next Run; a bad slot mapping
    writes nothing of its Run, and the next good Run answers correctly."""
    from ort_ops.ops import rotary_quantize_kv_cache as mod

    attrs = {"num_heads": 4, "kv_num_heads": 2}
    good = _inputs(rng, 9, 4, 2, 64, 32, n=4, b=8, dtype=np.float16, skip=0.0)
    sess = cuda_ep_session(good, schema=mod.SCHEMA, **attrs)
    want = reference.rotary_quantize_kv_cache(**good, **attrs)
    repeated = dict(good, slot_mapping=np.where(np.arange(9) == 4, good["slot_mapping"][0], good["slot_mapping"]))
    got = assert_reported_both_ways(sess, repeated, good,
                                    r"RotaryQuantizeKVCache: input 'slot_mapping' must hold slots < 32 ")
    _assert_exact(got, want)
    nan_v = dict(good, qkv=good["qkv"].copy())
    nan_v["qkv"][5, 6 * 64 + 1] = np.nan
    got = assert_reported_both_ways(sess, nan_v, good, r"RotaryQuantizeKVCache: input 'qkv' must be finite in the K")
    _assert_exact(got, want)


@cuda
def test_cuda_graph_capture(rng):
    """The op runs inside ORT's CUDA graph capture (no host sync, no host-memory input), with the
    caches bound in place on the device; each replay writes that step's new tokens, bit-exact."""
    import onnxruntime as ort

    from ort_ops import build_info
    from ort_ops._lib import session_options
    from ort_ops.ops import rotary_quantize_kv_cache as mod
    from ort_ops.ops._schema import single_op_model

    if "CUDAExecutionProvider" not in ort.get_available_providers() or not build_info()["cuda"]:
        pytest.skip("needs onnxruntime-gpu and a CUDA build of the library")
    attrs = {"num_heads": 8, "kv_num_heads": 2}
    t, n, b = 4, 8, 16
    ins = _inputs(rng, t, 8, 2, 128, 64, n=n, b=b, dtype=np.float16, skip=0.0)
    model = single_op_model(mod.SCHEMA, ins, **attrs)
    sess = ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    vals = {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in ins.items()}
    query = ort.OrtValue.ortvalue_from_shape_and_type((t, 8, 128), np.float16, "cuda", 0)
    binding = sess.io_binding()
    for k, v in vals.items():
        binding.bind_ortvalue_input(k, v)
    binding.bind_ortvalue_output("query", query)
    for k in CACHE_NAMES:
        binding.bind_ortvalue_output(k + "_out", vals[k])
    caches = [ins[k] for k in CACHE_NAMES]
    for step in range(3):  # the first Run captures, the others replay
        new = _inputs(rng, t, 8, 2, 128, 64, n=n, b=b, dtype=np.float16, skip=0.0)
        new["slot_mapping"] = (np.arange(t) + step * t).astype(np.int64)
        for k in ("qkv", "cos", "sin", "slot_mapping"):
            vals[k].update_inplace(new[k])
        want = reference.rotary_quantize_kv_cache(**dict(new, **dict(zip(CACHE_NAMES, caches))), **attrs)
        sess.run_with_iobinding(binding)
        _assert_exact([query.numpy(), *(vals[k].numpy() for k in CACHE_NAMES)], want)
        caches = list(want[1:])
