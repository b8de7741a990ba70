# SPDX-License-Identifier: MIT
"""Direct calls of the library's CUDA launchers on torch tensors (tests and benchmarks only).

The CUDA kernels are registered for ORT's CUDA execution provider; these ctypes wrappers run
the same launchers without onnxruntime-gpu, on raw device pointers and a torch stream, so the
kernels can be checked against ``ort_ops.reference`` and timed against torch peers.

GroupedMatmulSwigluQuant (csrc/ops/grouped_matmul_swiglu_quant/cuda.cuh):
    x int8 [M, K], weight int8 [E, K, N], weight_scale float32 [E, N], x_scale float32 [M],
    group_list int64 [E], optional bias float32 [E, N], activation "swiglu" / "swiglu_oai" (alpha,
    limit) -> y int8 [M, N/2], y_scale float32 [M], y_offset float32 [M];
    plus the device error word (bit 1: invalid group_list, bit 2: non-finite C or S).
GroupedMatmulDequant (same kernel, dequantizing mode): same inputs (bias too) -> y float32 [M, N].
DynamicQuant (csrc/ops/dynamic_quant/cuda.cuh): x float32/float16 [rows, K], smooth float32 [K]
    or None -> y int8 [rows, K], scale float32 [rows], error word (bit 1: non-finite value).
MoeInitRouting / MoeFinalizeRouting (csrc/ops/moe_*_routing/cuda.cuh): as their references.
SwiGLU (csrc/ops/swiglu/cuda.cuh): x float32/float16 [rows, 2I] -> y [rows, I] of x's dtype
    (no error word: non-finite values propagate).
"""

from __future__ import annotations

import ctypes
import functools

from ort_ops._lib import _cdll, build_info, get_library_path

ERR_GROUP_LIST = 1
ERR_NON_FINITE = 2
DQ_ERR_NON_FINITE = 1  # DynamicQuant's error word
INIT_ERR_BAD_EXPERT = 1  # MoeInitRouting's
FINALIZE_ERR_NOT_PERMUTATION = 1  # MoeFinalizeRouting's
# Tile configurations of the GroupedMatmulSwigluQuant kernel (GmsqConfig in cuda.cuh).
GMSQ_CONFIGS = {"auto": -1, "bm16": 0, "bm64": 1, "bm128": 2, "bm16w": 3, "bm32": 4, "stream": 5}
GMSQ_ACTIVATIONS = {"swiglu": 0, "swiglu_oai": 1}  # GmsqParams::activation
STREAM_MAX_SUMS = 1 << 24    # the stream config's limits (cuda_stream.cu kMaxSums, kMaxHalf)
STREAM_MAX_HALF = 24576


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
    except (OSError, ValueError) as e:  # library missing or unreadable: say so
        return f"ort_ops library not loadable: {e}"
    return None


@functools.cache
def _gmsq_fns():
    lib = _cdll(get_library_path())
    fn = lib.ort_ops_gmsq_cuda
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 9 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_int]
                   + [ctypes.c_float] * 2 + [ctypes.c_void_p])
    ws = lib.ort_ops_gmsq_cuda_workspace_bytes
    ws.restype = ctypes.c_size_t
    ws.argtypes = [ctypes.c_int64] * 3
    gmd = lib.ort_ops_gmd_cuda
    gmd.restype = ctypes.c_int
    gmd.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2
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
        layout: the weight layout passed to the launcher; None: 1 when ``n`` is given, else 0.
            2 is ``pack_weight_kmajor(w)``, [E, N, K] (swiglu only): config bm128 is the Hopper
            wgmma kernel, the others the mma.sync kernel's K-major path; auto picks by M / E.
        bias: torch CUDA float32 [E, N] or None.
        activation, alpha, limit: GroupedMatmulSwigluQuant's attributes (a key of
            GMSQ_ACTIVATIONS; alpha and limit are read by "swiglu_oai" only).
    """

    def __init__(self, x, weight, weight_scale, x_scale, group_list, group_list_type: int = 0,
                 config: str = "auto", dequant: bool = False, n: int | None = None,
                 layout: int | None = None, bias=None, activation: str = "swiglu", alpha: float = 1.702,
                 limit: float = 7.0):
        import torch

        self.fn, ws_bytes, self.gmd_fn = _gmsq_fns()
        self.dequant = dequant
        self.inputs = [t.contiguous() for t in (x, weight, weight_scale, x_scale, group_list)]
        self.bias = bias.contiguous() if bias is not None else None
        self.activation = GMSQ_ACTIVATIONS[activation]
        self.alpha, self.limit = float(alpha), float(limit)
        m, k = x.shape
        self.layout = layout if layout is not None else int(n is not None)
        if self.layout == 2:
            e, n, _ = weight.shape
        elif self.layout == 1:
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
        self.workspace = torch.empty((max(16, ws_bytes(m, n, e)),), dtype=torch.uint8, device=dev)

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
        bias = ctypes.c_void_p(self.bias.data_ptr() if self.bias is not None else None)
        if self.dequant:
            rc = self.gmd_fn(x.data_ptr(), w.data_ptr(), wsc.data_ptr(), xs.data_ptr(),
                             gl.data_ptr(), self.y.data_ptr(), self.workspace.data_ptr(), m, k, n,
                             e, self.group_list_type, self.config, self.layout, bias,
                             ctypes.c_void_p(s.cuda_stream))
        else:
            rc = self.fn(x.data_ptr(), w.data_ptr(), wsc.data_ptr(), xs.data_ptr(), gl.data_ptr(),
                         self.y.data_ptr(), self.y_scale.data_ptr(), self.y_offset.data_ptr(),
                         self.workspace.data_ptr(), m, k, n, e, self.group_list_type, self.config,
                         self.layout, bias, self.activation, self.alpha, self.limit,
                         ctypes.c_void_p(s.cuda_stream))
        if rc != 0:
            op = "GroupedMatmulDequant" if self.dequant else "GroupedMatmulSwigluQuant"
            why = ""
            if rc == 1 and self.config == GMSQ_CONFIGS["stream"] and (m * n > STREAM_MAX_SUMS or n // 2 > STREAM_MAX_HALF):
                why = (f": the stream config holds M * N int32 sums (at most 2^24, here {m} x {n})"
                       f" and N/2 <= {STREAM_MAX_HALF}; auto never picks it there")
            raise RuntimeError(f"{op} (CUDA): launch failed with cudaError_t {rc}"
                               f" ({torch.cuda.get_device_name()}){why}")

    def error_word(self) -> int:
        """The kernel's device error word (synchronizes)."""
        return int(self.workspace[:4].view(dtype=__import__("torch").int32).item())


def gmsq(x, weight, weight_scale, x_scale, group_list, group_list_type: int = 0,
         config: str = "auto", layout: int | None = None, bias=None, activation: str = "swiglu",
         alpha: float = 1.702, limit: float = 7.0):
    """Runs GroupedMatmulSwigluQuant once on poisoned outputs; returns (y, y_scale, y_offset, err).
    ``layout`` 2 takes ``weight`` as [E, N, K] (``pack_weight_kmajor``)."""
    r = GmsqRunner(x, weight, weight_scale, x_scale, group_list, group_list_type, config, layout=layout,
                   bias=bias, activation=activation, alpha=alpha, limit=limit)
    r.poison()
    r.launch()
    err = r.error_word()
    return r.y, r.y_scale, r.y_offset, err


def gmd(x, weight, weight_scale, x_scale, group_list, group_list_type: int = 0,
        config: str = "auto", bias=None):
    """Runs GroupedMatmulDequant once on a NaN-poisoned output; returns (y float32 [M, N], err)."""
    r = GmsqRunner(x, weight, weight_scale, x_scale, group_list, group_list_type, config,
                   dequant=True, bias=bias)
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


def pack_weight_kmajor(weight):
    """[E, K, N] int8 -> [E, N, K] (cuda_wgmma.cuh, weight_layout 2): the K-major B operand that
    8-bit wgmma needs; the kernel's TMA loads swizzle it, so no tile packing is needed."""
    return weight.transpose(1, 2).contiguous()


def dynamic_quant(x, smooth=None):
    """DynamicQuant on the GPU: x float32/float16 [..., K] (torch CUDA), smooth float32 [K] or
    None. Returns (y int8 [..., K], scale float32 [...], err) on NaN-poisoned outputs."""
    import torch

    lib = _cdll(get_library_path())
    fn = lib.ort_ops_dynamic_quant_cuda
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    x = x.contiguous()
    k = x.shape[-1]
    rows = x.numel() // k if k else int(torch.tensor(x.shape[:-1]).prod())
    y = torch.full(x.shape, 0x55, dtype=torch.int8, device=x.device)
    scale = torch.full(x.shape[:-1], float("nan"), dtype=torch.float32, device=x.device)
    err = torch.zeros(4, dtype=torch.int32, device=x.device)
    rc = fn(x.data_ptr(), int(x.dtype == torch.float16),
            smooth.contiguous().data_ptr() if smooth is not None else None, y.data_ptr(),
            scale.data_ptr(), err.data_ptr(), rows, k,
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if rc != 0:
        raise RuntimeError(f"DynamicQuant (CUDA): launch failed with cudaError_t {rc}")
    return y, scale, int(err[0].item())


def swiglu(x):
    """SwiGLU on the GPU: x float32/float16 [..., 2I] (torch CUDA, possibly a view whose storage
    offset breaks 16-byte alignment: the launcher then takes its scalar path). Returns y [..., I]
    of x's dtype, written over a NaN-filled buffer."""
    import torch

    lib = _cdll(get_library_path())
    fn = lib.ort_ops_swiglu_cuda
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1] if x.shape[-1] else int(torch.tensor(x.shape[:-1]).prod())
    y = torch.full((*x.shape[:-1], n), float("nan"), dtype=x.dtype, device=x.device)
    rc = fn(x.data_ptr(), int(x.dtype == torch.float16), y.data_ptr(), rows, n, _stream())
    if rc != 0:
        raise RuntimeError(f"SwiGLU (CUDA): launch failed with cudaError_t {rc}")
    return y


def _stream():
    import torch

    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def moe_init_routing(x, expert_ids, num_experts: int):
    """MoeInitRouting on the GPU (torch CUDA tensors): x float32/float16 [M, H], expert_ids int32
    [M, K]. Returns (sorted_x [M*K, H], sorted_to_flat int32 [M*K], group_list int64 [E], err)."""
    import torch

    lib = _cdll(get_library_path())
    ws_fn = lib.ort_ops_moe_init_cuda_workspace_bytes
    ws_fn.restype = ctypes.c_size_t
    ws_fn.argtypes = [ctypes.c_int64, ctypes.c_int64]
    fn = lib.ort_ops_moe_init_cuda
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
    x, expert_ids = x.contiguous(), expert_ids.contiguous()
    m, h = x.shape
    k = expert_ids.shape[1]
    sorted_x = torch.full((m * k, h), float("nan"), dtype=x.dtype, device=x.device)
    s2f = torch.full((m * k,), -7, dtype=torch.int32, device=x.device)
    gl = torch.full((num_experts,), -7, dtype=torch.int64, device=x.device)
    ws = torch.empty(ws_fn(m * k, num_experts), dtype=torch.uint8, device=x.device)
    rc = fn(x.data_ptr(), x.element_size(), expert_ids.data_ptr(), sorted_x.data_ptr(), s2f.data_ptr(),
            gl.data_ptr(), ws.data_ptr(), m, k, h, num_experts, _stream())
    if rc != 0:
        raise RuntimeError(f"MoeInitRouting (CUDA): launch failed with cudaError_t {rc}")
    return sorted_x, s2f, gl, int(ws[:4].view(torch.int32).item())


def moe_finalize_routing(expert_out, sorted_to_flat, topk_weights, residual=None):
    """MoeFinalizeRouting on the GPU (torch CUDA tensors). Returns (out float32 [M, H], err)."""
    import torch

    lib = _cdll(get_library_path())
    ws_fn = lib.ort_ops_moe_finalize_cuda_workspace_bytes
    ws_fn.restype = ctypes.c_size_t
    ws_fn.argtypes = [ctypes.c_int64]
    fn = lib.ort_ops_moe_finalize_cuda
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    m, k = topk_weights.shape
    h = expert_out.shape[1]
    eo, s2f, tw = expert_out.contiguous(), sorted_to_flat.contiguous(), topk_weights.contiguous()
    res = residual.contiguous() if residual is not None else None
    out = torch.full((m, h), float("nan"), dtype=torch.float32, device=eo.device)
    ws = torch.empty(ws_fn(m * k), dtype=torch.uint8, device=eo.device)
    half = torch.float16
    rc = fn(eo.data_ptr(), int(eo.dtype == half), s2f.data_ptr(), tw.data_ptr(), int(tw.dtype == half),
            res.data_ptr() if res is not None else None, int(res is not None and res.dtype == half),
            out.data_ptr(), ws.data_ptr(), m, k, h, _stream())
    if rc != 0:
        raise RuntimeError(f"MoeFinalizeRouting (CUDA): launch failed with cudaError_t {rc}")
    return out, int(ws[:4].view(torch.int32).item())
