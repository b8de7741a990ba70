# SPDX-License-Identifier: MIT
"""Direct calls of the library's CUDA launchers on torch tensors (tests and benchmarks only).

The CUDA kernels are registered for ORT's CUDA execution provider; these ctypes wrappers run
the same launchers without onnxruntime-gpu, on raw device pointers and a torch stream, so the
kernels can be checked against ``ort_ops.reference`` and timed against torch peers.

GroupedMatmulSwigluQuant (csrc/ops/grouped_matmul_swiglu_quant/cuda.cuh):
    x int8 [M, K], weight int8 [E, K, N], weight_scale float32 [E, N], x_scale float32 [M],
    group_list int64 [E] -> y int8 [M, N/2], y_scale float32 [M], y_offset float32 [M];
    plus the device error word (bit 1: invalid group_list, bit 2: non-finite C or S).
GroupedMatmulDequant (same kernel, dequantizing mode): same inputs -> y float32 [M, N].
"""

from __future__ import annotations

import ctypes
import functools

from ort_ops._lib import _cdll, build_info, get_library_path

ERR_GROUP_LIST = 1
ERR_NON_FINITE = 2
# Tile configurations of the GroupedMatmulSwigluQuant kernel (GmsqConfig in cuda.cuh).
GMSQ_CONFIGS = {"auto": -1, "bm16": 0, "bm64": 1, "bm128": 2, "bm16w": 3, "bm32": 4}


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA launchers cannot run here (None when they can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    try:
        if not build_info()["cuda"]:
            return "the ort_ops library was built without CUDA (ORT_OPS_USE_CUDA=OFF)"
    except Exception as e:  # library missing: say so
        return f"ort_ops library not loadable: {e}"
    return None


@functools.lru_cache(maxsize=None)
def _gmsq_fns():
    lib = _cdll(get_library_path())
    fn = lib.ort_ops_gmsq_cuda
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    ws = lib.ort_ops_gmsq_cuda_workspace_bytes
    ws.restype = ctypes.c_size_t
    ws.argtypes = [ctypes.c_int64, ctypes.c_int64]
    gmd = lib.ort_ops_gmd_cuda
    gmd.restype = ctypes.c_int
    gmd.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    return fn, ws, gmd


class GmsqRunner:
    """Preallocated outputs and workspace for one problem shape; ``launch()`` only enqueues.

    Args:
        x, weight, weight_scale, x_scale, group_list: torch CUDA tensors (contiguous, dtypes of
            the module docstring).
        group_list_type: 0 cumulative ends, 1 counts.
        config: a key of GMSQ_CONFIGS.
        dequant: run GroupedMatmulDequant (y float32 [M, N]) instead.
        packed: ``weight`` is ``pack_weight(w)`` (layout 1 of cuda.cuh) rather than [E, K, N];
            the shapes (K, N) come from ``n`` then.
    """

    def __init__(self, x, weight, weight_scale, x_scale, group_list, group_list_type: int = 0,
                 config: str = "auto", dequant: bool = False, n: int | None = None):
        import torch

        self.fn, ws_bytes, self.gmd_fn = _gmsq_fns()
        self.dequant = dequant
        self.inputs = [t.contiguous() for t in (x, weight, weight_scale, x_scale, group_list)]
        m, k = x.shape
        self.packed = n is not None
        if self.packed:
            e = weight.shape[0]
        else:
            e, _, n = weight.shape
        dev = x.device
        self.shape = (m, k, n, e)
        self.group_list_type = group_list_type
        self.config = GMSQ_CONFIGS[config]
        self.y = (torch.empty((m, n), dtype=torch.float32, device=dev) if dequant
                  else torch.empty((m, n // 2), dtype=torch.int8, device=dev))
        self.y_scale = torch.empty((m,), dtype=torch.float32, device=dev)
        self.y_offset = torch.empty((m,), dtype=torch.float32, device=dev)
        self.workspace = torch.empty((max(16, ws_bytes(m, e)),), dtype=torch.uint8, device=dev)

    def poison(self) -> None:
        """Fills the outputs with values the kernel never writes, to catch unwritten elements."""
        self.y.fill_(float("nan") if self.dequant else 0x55)
        self.y_scale.fill_(float("nan"))
        self.y_offset.fill_(float("nan"))

    def launch(self, stream=None) -> None:
        import torch

        s = stream if stream is not None else torch.cuda.current_stream()
        x, w, wsc, xs, gl = self.inputs
        m, k, n, e = self.shape
        if self.dequant:
            rc = self.gmd_fn(x.data_ptr(), w.data_ptr(), wsc.data_ptr(), xs.data_ptr(),
                             gl.data_ptr(), self.y.data_ptr(), self.workspace.data_ptr(), m, k, n,
                             e, self.group_list_type, self.config, int(self.packed),
                             ctypes.c_void_p(s.cuda_stream))
        else:
            rc = self.fn(x.data_ptr(), w.data_ptr(), wsc.data_ptr(), xs.data_ptr(), gl.data_ptr(),
                         self.y.data_ptr(), self.y_scale.data_ptr(), self.y_offset.data_ptr(),
                         self.workspace.data_ptr(), m, k, n, e, self.group_list_type, self.config,
                         int(self.packed), ctypes.c_void_p(s.cuda_stream))
        if rc != 0:
            op = "GroupedMatmulDequant" if self.dequant else "GroupedMatmulSwigluQuant"
            raise RuntimeError(f"{op} (CUDA): launch failed with cudaError_t {rc}"
                               f" ({torch.cuda.get_device_name()})")

    def error_word(self) -> int:
        """The kernel's device error word (synchronizes)."""
        return int(self.workspace[:4].view(dtype=__import__("torch").int32).item())


def gmsq(x, weight, weight_scale, x_scale, group_list, group_list_type: int = 0,
         config: str = "auto"):
    """Runs GroupedMatmulSwigluQuant once on poisoned outputs; returns (y, y_scale, y_offset, err)."""
    r = GmsqRunner(x, weight, weight_scale, x_scale, group_list, group_list_type, config)
    r.poison()
    r.launch()
    err = r.error_word()
    return r.y, r.y_scale, r.y_offset, err


def gmd(x, weight, weight_scale, x_scale, group_list, group_list_type: int = 0,
        config: str = "auto"):
    """Runs GroupedMatmulDequant once on a NaN-poisoned output; returns (y float32 [M, N], err)."""
    r = GmsqRunner(x, weight, weight_scale, x_scale, group_list, group_list_type, config,
                   dequant=True)
    r.poison()
    r.launch()
    err = r.error_word()
    return r.y, err


PACKED_COLS = 128  # kGmsqPackedCols: output columns per tile of the packed layout


def pack_weight(weight):
    """[E, K, N] int8 -> the kernel's packed layout [E, C, K, 256], C = ceil(N/2 / 128): row k of
    tile c holds W[k, 128c:128c+128] then W[k, N/2+128c : N/2+128c+128], zero-padded past N/2,
    so each CTA streams one contiguous run of its expert's weights (cuda.cuh, weight_layout 1)."""
    import torch

    e, k, n = weight.shape
    h = n // 2
    c = -(-h // PACKED_COLS)
    pad = c * PACKED_COLS - h
    a = torch.nn.functional.pad(weight[:, :, :h], (0, pad)).view(e, k, c, PACKED_COLS)
    g = torch.nn.functional.pad(weight[:, :, h:], (0, pad)).view(e, k, c, PACKED_COLS)
    return torch.cat([a, g], dim=3).permute(0, 2, 1, 3).contiguous()
