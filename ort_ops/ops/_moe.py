# SPDX-License-Identifier: MIT
"""Pieces the MoE op references share: group_list decoding, the grouped int32 GEMM, the
dequantization order and the SwiGLU activation, each as an exact float32 recipe.

Alphabet: M rows (token-slot pairs after routing), K reduction dim, N output columns, E experts.

Every kernel (CPU scalar/AVX2/VNNI, CUDA) reproduces these float32 operations in this order,
without fused multiply-adds, so INT8 codes match the reference bit for bit:

    acc  = sum_k int32(x[m, k]) * int32(W[e, k, n])        exact int32 (K <= MAX_K)
    C    = (float32(acc) * x_scale[m]) * weight_scale[e, n]  two float32 multiplies, this order
                                                            (float32(acc): round to nearest even)
    SwiGLU on A = C[:, :N/2] (the Swish input) and G = C[:, N/2:] (the gate multiplier):
        e = exp_f32(-A)          the polynomial below, not libm's expf
        d = 1 + e
        s = A / d                IEEE float32 division (Swish(A) = A * sigmoid(A))
        S = s * G

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


def grouped_dequant_matmul(op: str, x, weight, weight_scale, x_scale, group_list,
                           group_list_type: int) -> tuple[np.ndarray, np.ndarray]:
    """Validates the GroupedMatmul* inputs and returns (C float32 [M, N], valid bool [M]).

    C[m] = (float32(x[m] . W_e) * x_scale[m]) * weight_scale[e] for rows of a group; rows at
    or past the last group end are not valid (the ops write zeros there).
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
            valid[start:end] = True
        start = max(start, end)
    return c, valid
