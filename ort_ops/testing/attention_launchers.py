# SPDX-License-Identifier: MIT
"""ctypes access to the CUDA launchers (tests and benchmarks drive the kernels without
onnxruntime-gpu). Tensors are torch CUDA tensors; layouts and dtypes as in DESIGN.md.

Alphabet: T query tokens, S sequences, Hq / Hkv heads, D head dim, N blocks, B block size,
M max blocks per sequence.

The launchers report bad input through a status word (bits of ``PA_STATUS`` / ``QKV_STATUS``)
instead of reading out of bounds; ``status()`` synchronizes and returns it.
"""

from __future__ import annotations

import ctypes
import functools
import math

from ort_ops._lib import _cdll, build_info, get_library_path

PV_QUANT = {"none": 0, "s8": 1, "u8": 2}
PA_STATUS = {1: "block_tables entry out of range", 2: "seq_lens out of range", 4: "cu_seqlens_q invalid",
             8: "query not finite", 16: "decode_with_cu: a sequence has not exactly one query row",
             32: "head_sink not finite"}
QKV_STATUS = {1: "slot_mapping entry out of range", 2: "key/value not finite"}  # RotaryQuantizeKVCache's too


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot run here (None when they can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        if not build_info()["cuda"]:
            return "the ort_ops library was built without CUDA (ORT_OPS_USE_CUDA=OFF)"
    except (OSError, FileNotFoundError) as e:
        return f"ort_ops library not loadable: {e}"
    return None


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = _cdll(get_library_path())
    vp, ip = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
    f = lib.ort_ops_cuda_paged_attention_int8
    f.restype = ctypes.c_int
    f.argtypes = [vp, ctypes.c_int, vp, vp, vp, vp, vp, vp, vp, vp, ip, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                  ctypes.c_int, ctypes.c_float, vp, vp, vp, vp, ctypes.c_char_p, ctypes.c_int]
    f = lib.ort_ops_cuda_paged_attention_int8_workspace
    f.restype = ctypes.c_longlong
    f.argtypes = [ip, ctypes.c_int, ctypes.c_int, ip]
    f = lib.ort_ops_cuda_quantize_kv_cache
    f.restype = ctypes.c_int
    f.argtypes = [vp, vp, ctypes.c_int, vp, vp, vp, vp, vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_longlong, vp, vp]
    f = lib.ort_ops_cuda_rotary_quantize_kv_cache
    f.restype = ctypes.c_int
    f.argtypes = [vp, vp, vp, ctypes.c_int, vp, vp, vp, vp, vp, vp] + [ctypes.c_int] * 7 + [ctypes.c_longlong, vp, vp]
    return lib


def _ptr(t) -> int | None:
    return None if t is None else t.data_ptr()


class PagedAttention:
    """One configured PagedAttentionInt8 launch: workspace and status allocated once, so that
    ``__call__`` only launches (no synchronization; benchmarks time it in a loop). Tensors are
    torch CUDA tensors in the op's input order (head_sink: float32 [Hq] or None); ``window`` and
    ``softcap`` are the op's attributes (0: off)."""

    def __init__(self, query, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens,
                 cu_seqlens_q=None, head_sink=None, *, scale=None, pv_quant="s8", partition_size=256, num_splits=0,
                 max_q_len=None, max_context=None, out=None, decode_with_cu=False, window=0, softcap=0.0):
        import torch

        t, hq, d = query.shape
        n, hkv, b, _ = key_cache.shape
        s, m = block_tables.shape
        if max_q_len is None:
            max_q_len = 1 if cu_seqlens_q is None or decode_with_cu else t
        if max_context is None:
            max_context = m * b
        # dims: T, S, Hq, Hkv, D, B, M, N, max_q_len, max_context, decode_with_cu, window (cuda_capi.cu)
        self.dims = (ctypes.c_int * 12)(t, s, hq, hkv, d, b, m, n, max_q_len, max_context, int(decode_with_cu),
                                        int(window))
        self.args = (query, key_cache, value_cache, key_scale, value_scale, block_tables, seq_lens, cu_seqlens_q)
        self.softcap, self.head_sink = float(softcap), head_sink  # head_sink: float32 [Hq] on the device
        self.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        self.pv = PV_QUANT[pv_quant]
        self.partition_size, self.num_splits = partition_size, num_splits
        nsplit = ctypes.c_int(0)
        ws = _lib().ort_ops_cuda_paged_attention_int8_workspace(self.dims, partition_size, num_splits,
                                                                ctypes.byref(nsplit))
        self.nsplit = nsplit.value
        dev = query.device
        self.workspace = torch.empty(max(int(ws), 16), dtype=torch.uint8, device=dev)
        self.status_word = torch.zeros(1, dtype=torch.int32, device=dev)
        self.out = out if out is not None else torch.empty_like(query)
        self.msg = ctypes.create_string_buffer(256)

    def __call__(self, stream=None):
        import torch

        q, kc, vc, ks, vs, bt, sl, cu = self.args
        st = stream if stream is not None else torch.cuda.current_stream().cuda_stream
        rc = _lib().ort_ops_cuda_paged_attention_int8(
            _ptr(q), int(q.dtype == torch.float16), _ptr(kc), _ptr(vc), _ptr(ks), _ptr(vs), _ptr(bt), _ptr(sl),
            _ptr(cu), _ptr(self.out), self.dims, self.scale, self.pv, self.partition_size, self.num_splits,
            self.softcap, _ptr(self.head_sink), _ptr(self.workspace), _ptr(self.status_word), st, self.msg, len(self.msg))
        if rc == -1:
            raise ValueError(f"PagedAttentionInt8: {self.msg.value.decode()}")
        if rc != 0:
            raise RuntimeError(f"PagedAttentionInt8: CUDA error {rc}")
        return self.out

    def status(self) -> int:
        import torch

        torch.cuda.synchronize()
        return int(self.status_word.item())


def paged_attention_int8(*args, **kwargs):
    """Runs PagedAttentionInt8 once; returns (output tensor, status word)."""
    pa = PagedAttention(*args, **kwargs)
    pa.status_word.zero_()
    out = pa()
    return out, pa.status()


def quantize_kv_cache(key, value, slot_mapping, key_cache, value_cache, key_scale, value_scale):
    """QuantizeKVCache in place on the four cache tensors; returns the status word."""
    import torch

    t, hkv, d = key.shape
    n, _, b, _ = key_cache.shape
    status = torch.zeros(8, dtype=torch.int32, device=key.device)  # the word, then the check's scratch
    rc = _lib().ort_ops_cuda_quantize_kv_cache(
        _ptr(key), _ptr(value), int(key.dtype == torch.float16), _ptr(slot_mapping), _ptr(key_cache),
        _ptr(value_cache), _ptr(key_scale), _ptr(value_scale), t, hkv, d, b, n * b, _ptr(status),
        torch.cuda.current_stream().cuda_stream)
    if rc != 0:
        raise RuntimeError(f"QuantizeKVCache: CUDA error {rc}")
    torch.cuda.synchronize()
    return int(status[0].item())


def rotary_quantize_kv_cache(qkv, cos, sin, slot_mapping, key_cache, value_cache, key_scale, value_scale, *,
                             num_heads, kv_num_heads, interleaved=0, query=None):
    """RotaryQuantizeKVCache: the four caches updated in place; returns (query [T, Hq, D] of qkv's
    dtype, status word). ``query`` may be given (e.g. NaN-poisoned) to be written into."""
    import torch

    t, width = qkv.shape
    d = width // (num_heads + 2 * kv_num_heads)
    n, _, b, _ = key_cache.shape
    if query is None:
        query = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    status = torch.zeros(8, dtype=torch.int32, device=qkv.device)  # the word, then the check's scratch
    rc = _lib().ort_ops_cuda_rotary_quantize_kv_cache(
        _ptr(qkv), _ptr(cos), _ptr(sin), int(qkv.dtype == torch.float16), _ptr(query), _ptr(slot_mapping),
        _ptr(key_cache), _ptr(value_cache), _ptr(key_scale), _ptr(value_scale), t, num_heads, kv_num_heads, d,
        cos.shape[1], int(interleaved), b, n * b, _ptr(status), torch.cuda.current_stream().cuda_stream)
    if rc != 0:
        raise RuntimeError(f"RotaryQuantizeKVCache: CUDA error {rc}")
    torch.cuda.synchronize()
    return query, int(status[0].item())
