# SPDX-License-Identifier: MIT
"""Pieces the MoE op references share: group_list decoding, the grouped int32 GEMM, the
dequantization order and the SwiGLU activation, each as an exact float32 recipe.

Alphabet: M rows (token-slot pairs after routing), K reduction dim, N output columns, E experts.

Every kernel (CPU scalar/AVX2/VNNI, CUDA) reproduces these float32 operations in this order,
without fused multiply-adds, so INT8 codes match the reference bit for bit:

    acc  = sum_k int32(x[m, k]) * int32(W[e, k, n])        exact int32 (K <= MAX_K)
    C    = (float32(acc) * x_scale[m]) * weight_scale[e, n]  two float32 multiplies, this order
                                                            (float32(acc): round to nearest even)
    C    = C + bias[e, n]                                   only with the optional bias input
    activation "swiglu" (the default) on A = C[:, :N/2] (the Swish input) and G = C[:, N/2:]
    (the gate multiplier):
        e = exp_f32(-A)          the polynomial below, not libm's expf
        d = 1 + e
        s = A / d                IEEE float32 division (Swish(A) = A * sigmoid(A))
        S = s * G
    activation "swiglu_oai" (gpt-oss's clamped SwiGLU; attributes alpha, limit):
        a = min(A, limit)        the Swish input clamped above only
        g = min(max(G, -limit), limit)
        e = exp_f32(-(alpha * a))
        d = 1 + e
        s = a / d
        S = (g + 1) * s

``exp_f32`` is defined by basic float32 operations so every target computes the same bits
(libm, numpy's SIMD exp and CUDA's __expf all differ in the last bit):

    t = min(max(v, -87), 88)                 keeps 2^n and the result normal and finite
    n = rint(t * LOG2E)                      round half to even; n in [-126, 127]
    r = (t - n * LN2_HI) - n * LN2_LO        Cody-Waite; n * LN2_HI is exact (LN2_HI has 9 bits)
    p = P0; p = p * r + P1; ... ; p = p * r + P5      (multiply, then add: no FMA)
    y = ((p * (r * r)) + r) + 1
    exp_f32(v) = y * 2^n                     exact (2^n is a power of two, the result is normal)

The constants are Cephes' expf minimax coefficients (max error ~1 ulp on [-ln2/2, ln2/2]).
NaN never reaches exp_f32: kernels and references refuse a non-finite C first.
"""

from __future__ import annotations

import numpy as np

# int32 accumulation is exact when K * 128 * 128 < 2^31 (codes may even hold -128).
MAX_K = 131071

LOG2E = np.float32(1.44269504088896341)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
EXP_LO = np.float32(-87.0)
EXP_HI = np.float32(88.0)
EXP_POLY = tuple(np.float32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
ONE = np.float32(1.0)


def exp_f32(v: np.ndarray) -> np.ndarray:
    """The contract's float32 exp (module docstring); v must be finite float32."""
    v = np.asarray(v, np.float32)
    t = np.minimum(np.maximum(v, EXP_LO), EXP_HI)
    n = np.rint(t * LOG2E).astype(np.float32)
    r = (t - n * LN2_HI).astype(np.float32)
    r = (r - n * LN2_LO).astype(np.float32)
    p = np.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = (p * r).astype(np.float32)
        p = (p + c).astype(np.float32)
    z = (r * r).astype(np.float32)
    y = (p * z).astype(np.float32)
    y = (y + r).astype(np.float32)
    y = (y + ONE).astype(np.float32)
    return np.ldexp(y, n.astype(np.int32)).astype(np.float32)


def swiglu_f32(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """S = Swish(a) * g = (a / (1 + exp_f32(-a))) * g in float32, the contract's order."""
    a = np.asarray(a, np.float32)
    g = np.asarray(g, np.float32)
    e = exp_f32(-a)
    d = (ONE + e).astype(np.float32)
    s = (a / d).astype(np.float32)
    return (s * g).astype(np.float32)


ACTIVATIONS = ("swiglu", "swiglu_oai")
OAI_ALPHA = 1.702   # gpt-oss's defaults (attributes alpha, limit of "swiglu_oai")
OAI_LIMIT = 7.0


def swiglu_oai_f32(a: np.ndarray, g: np.ndarray, alpha: float = OAI_ALPHA, limit: float = OAI_LIMIT) -> np.ndarray:
    """gpt-oss's clamped SwiGLU in float32, the contract's order (module docstring):
    S = (min(max(g, -limit), limit) + 1) * (a' / (1 + exp_f32(-(alpha * a')))), a' = min(a, limit)."""
    al = np.float32(alpha)
    lim = np.float32(limit)
    a = np.minimum(np.asarray(a, np.float32), lim)
    g = np.minimum(np.maximum(np.asarray(g, np.float32), -lim), lim)
    e = exp_f32(-(al * a).astype(np.float32))
    d = (ONE + e).astype(np.float32)
    s = (a / d).astype(np.float32)
    return ((g + ONE).astype(np.float32) * s).astype(np.float32)


def activation_f32(a: np.ndarray, g: np.ndarray, activation: str = "swiglu", alpha: float = OAI_ALPHA,
                   limit: float = OAI_LIMIT) -> np.ndarray:
    """S of GroupedMatmulSwigluQuant's ``activation`` (checked by ``check_activation``)."""
    if activation == "swiglu_oai":
        return swiglu_oai_f32(a, g, alpha, limit)
    return swiglu_f32(a, g)


def activation_float(c: np.ndarray, activation: str = "swiglu", alpha: float = OAI_ALPHA,
                     limit: float = OAI_LIMIT) -> np.ndarray:
    """h [.., I] from c [.., 2I] = [A | G] in c's float type (no float32 recipe: the float
    model's yardstick): "swiglu" silu(A) * G; "swiglu_oai" (clip(G, -limit, limit) + 1) *
    a * sigmoid(alpha * a) with a = min(A, limit)."""
    i = c.shape[-1] // 2
    a, g = c[..., :i], c[..., i:]
    if activation == "swiglu":
        return a / (1.0 + np.exp(-a)) * g
    if activation == "swiglu_oai":
        a = np.minimum(a, limit)
        g = np.clip(g, -limit, limit)
        return (g + 1.0) * (a / (1.0 + np.exp(-alpha * a)))
    raise ValueError(f"moe: activation must be one of {ACTIVATIONS}, got '{activation}'")


def moe_experts_float(x: np.ndarray, topk_ids: np.ndarray, topk_w: np.ndarray, w_gate_up: np.ndarray,
                      w_down: np.ndarray, gate_up_bias: np.ndarray | None = None,
                      down_bias: np.ndarray | None = None, activation: str = "swiglu", alpha: float = OAI_ALPHA,
                      limit: float = OAI_LIMIT) -> np.ndarray:
    """The routed experts of a float MoE layer in float64, what the INT8 chain approximates:
    x [T, H], topk_ids / topk_w [T, K], w_gate_up [E, H, 2I] (columns [0, I) the activation's
    A, [I, 2I) its G), w_down [E, I, H], optional biases [E, 2I] and [E, H] added after each
    projection -> float64 [T, H] = sum_j topk_w[t, j] * expert_{topk_ids[t, j]}(x[t])."""
    x64 = np.asarray(x, np.float64)
    ids = np.asarray(topk_ids)
    wts = np.asarray(topk_w, np.float64)
    out = np.zeros_like(x64)
    for e in range(w_gate_up.shape[0]):
        t, j = np.nonzero(ids == e)
        if not t.size:
            continue
        c = x64[t] @ np.asarray(w_gate_up[e], np.float64)
        if gate_up_bias is not None:
            c = c + np.asarray(gate_up_bias[e], np.float64)
        y = activation_float(c, activation, alpha, limit) @ np.asarray(w_down[e], np.float64)
        if down_bias is not None:
            y = y + np.asarray(down_bias[e], np.float64)
        np.add.at(out, t, wts[t, j, None] * y)
    return out


def check_activation(op: str, activation, alpha, limit) -> None:
    """Raises the kernels' ValueError for an unknown ``activation`` or a bad ``alpha`` / ``limit``
    (float32 values: finite, limit > 0)."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{op}: attribute 'activation' must be 'swiglu' or 'swiglu_oai', got '{activation}'")
    with np.errstate(over="ignore"):
        al, lim = np.float32(alpha), np.float32(limit)
    if not np.isfinite(al):
        raise ValueError(f"{op}: attribute 'alpha' must be finite, got {float(al)}")
    if not (np.isfinite(lim) and lim > 0):
        raise ValueError(f"{op}: attribute 'limit' must be finite and > 0, got {float(lim)}")


def check_bias(op: str, bias, num_experts: int, n: int) -> np.ndarray | None:
    """The optional input ``bias`` float32 [E, N]: None when absent; ValueError (the kernels'
    message) for another dtype or shape or a NaN / Inf value."""
    if bias is None:
        return None
    b = np.asarray(bias)
    if b.dtype != np.float32:
        raise ValueError(f"{op}: input 'bias' must be float32, got {b.dtype}")
    if b.shape != (num_experts, n):
        raise ValueError(f"{op}: input 'bias' must have shape {[num_experts, n]}, got {list(b.shape)}")
    bad = ~np.isfinite(b)
    if bad.any():
        e, c = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{op}: input 'bias' must be finite, got NaN or Inf at expert {e}, column {c}")
    return b


def group_ends(op: str, group_list: np.ndarray, group_list_type: int, num_experts: int,
               m: int) -> np.ndarray:
    """End row (exclusive) of each expert's group, validated as the kernels validate it.

    Args:
        op: op name for error messages.
        group_list: int64 [E]; cumulative end rows (type 0) or per-expert row counts (type 1).
        group_list_type: 0 or 1.
        num_experts: E from the weight's first dim.
        m: rows of x.

    Raises:
        ValueError: "<op>: input 'group_list' must ..." for a wrong dtype, shape, a negative
        count, a decreasing list or an end past M.
    """
    gl = np.asarray(group_list)
    if gl.dtype != np.int64:
        raise ValueError(f"{op}: input 'group_list' must be int64, got {gl.dtype}")
    if gl.shape != (num_experts,):
        raise ValueError(f"{op}: input 'group_list' must have shape [{num_experts}], got {list(gl.shape)}")
    if group_list_type not in (0, 1):
        raise ValueError(f"{op}: attribute 'group_list_type' must be 0 (cumulative) or 1 (counts), got {group_list_type}")
    if group_list_type == 1:
        if np.any(gl < 0):
            i = int(np.argmax(gl < 0))
            raise ValueError(f"{op}: input 'group_list' must hold counts >= 0, got {int(gl[i])} at index {i}")
        ends = np.cumsum(gl, dtype=np.int64)
        if num_experts and ends[-1] > m:
            raise ValueError(f"{op}: input 'group_list' counts must sum to <= {m} (rows of 'x'), got {int(ends[-1])}")
        return ends
    prev = 0
    for i, v in enumerate(gl.tolist()):
        if v < prev:
            raise ValueError(f"{op}: input 'group_list' must be non-decreasing and >= 0, got {v} at index {i} after {prev}")
        prev = v
    if num_experts and prev > m:
        raise ValueError(f"{op}: input 'group_list' must end at <= {m} (rows of 'x'), got {prev}")
    return gl.astype(np.int64)


def check_int8(op: str, name: str, a: np.ndarray, rank: int) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.int8:
        raise ValueError(f"{op}: input '{name}' must be int8, got {a.dtype}")
    if a.ndim != rank:
        raise ValueError(f"{op}: input '{name}' must have rank {rank}, got rank {a.ndim}")
    return a


def check_float(op: str, name: str, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype not in (np.float32, np.float16):
        raise ValueError(f"{op}: input '{name}' must be float32 or float16, got {a.dtype}")
    if a.shape != tuple(shape):
        raise ValueError(f"{op}: input '{name}' must have shape {list(shape)}, got {list(a.shape)}")
    return a.astype(np.float32)


# GroupedMatmulSwigluQuant / GroupedMatmulDequant's attribute weight_layout (DESIGN.md "MoE"; the
# kernels' csrc/ops/grouped_matmul_swiglu_quant/weight_layout.h): how each expert's [K, N] is stored.
EKN = "EKN"        # [E, K, N], the contract's order and the default
ENK = "ENK"        # [E, N, K], each expert transposed (K-major)
EN16K4 = "EN16K4"  # [E, ceil(N/16), K/4, 16, 4], AMX B tiles
WEIGHT_LAYOUTS = (EKN, ENK, EN16K4)


def pack_en16k4(weight_ekn_: np.ndarray, op: str = "GroupedMatmulSwigluQuant") -> np.ndarray:
    """[E, K, N] -> "EN16K4" [E, ceil(N/16), K/4, 16, 4]: out[e, n // 16, k // 4, n % 16, k % 4] =
    W_e[k, n], zeros for n >= N (K % 4 == 0). Every 1 KB run is one AMX B tile (16 k quads of 16
    columns), the layout the CPU's AMX panels read without packing."""
    w = np.asarray(weight_ekn_)
    e, k, n = w.shape
    if k % 4:
        raise ValueError(f"{op}: weight_layout 'EN16K4' needs K (dim 1 of 'x') to be a multiple of 4, got {k}")
    nt = (n + 15) // 16
    p = np.zeros((e, k, nt * 16), w.dtype)
    p[:, :, :n] = w
    return np.ascontiguousarray(p.reshape(e, k // 4, 4, nt, 16).transpose(0, 3, 1, 4, 2))


def weight_ekn(op: str, x, weight, weight_layout: str = EKN, weight_scale=None, even_n: bool = False):
    """``weight`` of GroupedMatmulSwigluQuant / GroupedMatmulDequant in the contract's [E, K, N]
    order: checks the attribute ``weight_layout`` and, for "ENK", that the weight is [E, N, K]
    with K of ``x`` (and N even when ``even_n``), then transposes it (a view); for "EN16K4", that
    it is [E, ceil(N/16), K/4, 16, 4] (N of ``weight_scale`` [E, N]), then unpacks it. Messages
    as the kernels' (csrc/ops/grouped_matmul_swiglu_quant/weight_layout.h, shared by both ops)."""
    if not isinstance(weight_layout, str) or weight_layout not in WEIGHT_LAYOUTS:
        got = f"'{weight_layout}'" if isinstance(weight_layout, str) and weight_layout else "a non-string value"
        raise ValueError(f"{op}: attribute 'weight_layout' must be 'EKN' (weight [E, K, N]), 'ENK' "
                         f"(weight [E, N, K]) or 'EN16K4' (weight [E, N/16, K/4, 16, 4]), got {got}")
    if weight_layout == EKN:
        return weight
    x = check_int8(op, "x", x, 2)
    if weight_layout == EN16K4:
        weight = np.asarray(weight)
        if weight.dtype != np.int8:
            raise ValueError(f"{op}: input 'weight' must be int8, got {weight.dtype}")
        k = x.shape[1]
        if k % 4:
            raise ValueError(f"{op}: weight_layout 'EN16K4' needs K (dim 1 of 'x') to be a multiple of 4, got {k}")
        ws = None if weight_scale is None else np.asarray(weight_scale)
        n = ws.shape[1] if ws is not None and ws.ndim == 2 else (weight.shape[1] * 16 if weight.ndim == 5 else 0)
        nt = (n + 15) // 16
        if weight.ndim != 5 or weight.shape[1:] != (nt, k // 4, 16, 4):
            raise ValueError(f"{op}: input 'weight' must be [E, ceil(N/16), K/4, 16, 4] = [E, {nt}, {k // 4}, 16, 4] "
                             f"for weight_layout 'EN16K4' (K of 'x', N of 'weight_scale'), got {list(weight.shape)}")
        e = weight.shape[0]
        return weight.transpose(0, 2, 4, 1, 3).reshape(e, k, nt * 16)[:, :, :n]
    weight = check_int8(op, "weight", weight, 3)
    k = x.shape[1]
    if weight.shape[2] != k:
        raise ValueError(f"{op}: input 'weight' must be [E, N, K] = [E, N, {k}] for weight_layout 'ENK' "
                         f"(K of 'x'), got {list(weight.shape)}")
    if even_n and weight.shape[1] % 2:
        raise ValueError(f"{op}: input 'weight' must have an even N (dim 1 for weight_layout 'ENK'), "
                         f"got {weight.shape[1]}")
    return weight.transpose(0, 2, 1)


def grouped_dequant_matmul(op: str, x, weight, weight_scale, x_scale, group_list,
                           group_list_type: int, bias=None) -> tuple[np.ndarray, np.ndarray]:
    """Validates the GroupedMatmul* inputs and returns (C float32 [M, N], valid bool [M]).

    C[m] = (float32(x[m] . W_e) * x_scale[m]) * weight_scale[e] (+ bias[e], one float32 add,
    when the optional bias [E, N] is given) for rows of a group; rows at or past the last group
    end are not valid (the ops write zeros there, no bias).
    """
    x = check_int8(op, "x", x, 2)
    weight = check_int8(op, "weight", weight, 3)
    m, k = x.shape
    e_count, wk, n = weight.shape
    if wk != k:
        raise ValueError(f"{op}: input 'weight' must have shape [E, {k}, N] (K of 'x'), got {list(weight.shape)}")
    if k > MAX_K:
        raise ValueError(f"{op}: K must be <= {MAX_K} so the int32 accumulator cannot overflow, got {k}")
    ws = check_float(op, "weight_scale", weight_scale, (e_count, n))
    xs = check_float(op, "x_scale", x_scale, (m,))
    b = check_bias(op, bias, e_count, n)
    ends = group_ends(op, group_list, group_list_type, e_count, m)
    c = np.zeros((m, n), np.float32)
    valid = np.zeros(m, bool)
    start = 0
    for e in range(e_count):
        end = int(ends[e])
        if end > start:
            # float64 GEMM of integers is exact here: every partial sum is an integer < 2^31.
            acc = (x[start:end].astype(np.float64) @ weight[e].astype(np.float64)).astype(np.int64)
            assert np.all(np.abs(acc) < 2**31)
            ce = (acc.astype(np.int32).astype(np.float32) * xs[start:end, None]).astype(np.float32)
            c[start:end] = (ce * ws[e][None, :]).astype(np.float32)
            if b is not None:
                c[start:end] = (c[start:end] + b[e][None, :]).astype(np.float32)
            valid[start:end] = True
        start = max(start, end)
    return c, valid
