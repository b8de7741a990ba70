# SPDX-License-Identifier: MIT
"""The whole INT8 MoE chain as one ONNX model on the CPU EP (ort_ops.testing.moe_layer):
bit-exact against the chain of numpy references, and within MOE_CHAIN_VS_FLOAT_REL_L2 of the
float64 MoE layer. Also the router-in-graph form (Softmax/TopK like com.microsoft.MoE)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from ort_ops._lib import session_options
from ort_ops.testing import moe_layer as ml
from tests.tolerances import MOE_CHAIN_VS_FLOAT_REL_L2, MOE_CHAIN_VS_W8A8_REL_L2, MOE_W8A8_ISSUE_SHAPE_REL_L2

# hidden, intermediate, experts, top-k, tokens, shared-expert intermediate
CONFIGS = [(512, 384, 8, 2, 64, 0), (512, 384, 8, 2, 33, 256), (256, 192, 16, 4, 17, 0), (128, 96, 4, 1, 1, 64)]


def _session(model):
    so = session_options()
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "H{}-I{}-E{}-k{}-T{}-shared{}".format(*c))
def test_chain_matches_references_and_float_layer(rng, gemm_isa, cfg):
    h, i, e, k, t, shared = cfg
    w = ml.random_moe_weights(rng, h, i, e, shared)
    q = ml.quantize_moe_weights(w)
    x = rng.standard_normal((t, h)).astype(np.float32)
    ids, wts = ml.route(x, w.router, k)
    out = _session(ml.build_moe_int8_model(q, k, router_in_graph=False)).run(
        None, {"x": x, "topk_ids": ids, "topk_weights": wts})[0]
    np.testing.assert_array_equal(out, ml.moe_layer_int8_reference(x, q, ids, wts))
    err = ml.relative_l2(out, ml.moe_layer_float(x, w, k, routing=(ids, wts)))
    print(f"{gemm_isa} {cfg}: INT8 chain vs float layer relative L2 {err:.4f}")
    assert err <= MOE_CHAIN_VS_FLOAT_REL_L2


def test_router_in_graph(rng):
    """Softmax + TopK + renormalization in ONNX, then the chain: same as the numpy router
    (up to float rounding of the softmax in the weights)."""
    h, i, e, k, t = 256, 128, 8, 2, 40
    w = ml.random_moe_weights(rng, h, i, e, 64)
    q = ml.quantize_moe_weights(w)
    x = rng.standard_normal((t, h)).astype(np.float32)
    logits = (x @ w.router).astype(np.float32)
    out = _session(ml.build_moe_int8_model(q, k)).run(None, {"x": x, "router_logits": logits})[0]
    ids, wts = ml.route(x, w.router, k)
    ref = ml.moe_layer_int8_reference(x, q, ids, wts)
    assert ml.relative_l2(out, ref) < 1e-5  # only the router's float rounding differs
    assert ml.relative_l2(out, ml.moe_layer_float(x, w, k)) <= MOE_CHAIN_VS_FLOAT_REL_L2


def test_error_budget_issue_shape():
    """Issue 4's error budget at its shape (hidden 2048, intermediate 1408, 8 experts top-2, 64
    tokens; weights and x drawn from a fixed seed): the native chain's error against the float64
    layer is the plain W8A8 model's (``moe_layer_w8a8``: per-token int8 x, per-channel int8
    weights, integer matmuls, float SwiGLU, per-row int8 SwiGLU output), i.e. the kernels add
    nothing, and stays within MOE_W8A8_ISSUE_SHAPE_REL_L2 (measured + a stated margin). Each INT8
    rounding's share (benchmarks/RESULTS_cpu.md): the SwiGLU output's is the largest."""
    h, i, e, k, t = 2048, 1408, 8, 2, 64
    rng = np.random.default_rng(4)
    w = ml.random_moe_weights(rng, h, i, e)
    x = rng.standard_normal((t, h)).astype(np.float32)
    ids, wts = ml.route(x, w.router, k)
    out = _session(ml.build_moe_int8_model(ml.quantize_moe_weights(w), k, router_in_graph=False)).run(
        None, {"x": x, "topk_ids": ids, "topk_weights": wts})[0]
    want = ml.moe_layer_float(x, w, k, routing=(ids, wts))
    err = ml.relative_l2(out, want)
    w8a8 = ml.moe_layer_w8a8(x, w, (ids, wts))
    print(f"INT8 chain vs float layer {err:.5f}, vs the float64 W8A8 model {ml.relative_l2(out, w8a8):.2e}")
    assert ml.relative_l2(out, w8a8) <= MOE_CHAIN_VS_W8A8_REL_L2
    assert err <= MOE_W8A8_ISSUE_SHAPE_REL_L2
    # The budget's largest share: without the SwiGLU output's rounding the error drops by a third.
    no_h = ml.relative_l2(ml.moe_layer_w8a8(x, w, (ids, wts), ("x", "gate_up", "down")), want)
    assert no_h < 0.75 * err


@pytest.mark.parametrize("alpha,limit", [(1.702, 7.0), (1.702, 0.5), (1.0, 1.5)], ids=["gpt-oss", "tight", "a1-l1.5"])
def test_gpt_oss_chain(rng, gemm_isa, alpha, limit):
    """gpt-oss's expert form: biases on both GEMMs and the clamped SwiGLU ("swiglu_oai"; the
    tight limits clamp a large share of the gate and up values). The native chain equals the
    chain of references bit for bit and the float64 layer (same biases and activation) within
    MOE_CHAIN_VS_FLOAT_REL_L2: the helpers the gpt-oss rewrite is proved against."""
    h, i, e, k, t = 256, 192, 8, 2, 40
    w = ml.random_moe_weights(rng, h, i, e)
    w.gate_up_bias = (0.5 * rng.standard_normal((e, 2 * i))).astype(np.float32)
    w.down_bias = (0.5 * rng.standard_normal((e, h))).astype(np.float32)
    q = ml.quantize_moe_weights(w)
    x = rng.standard_normal((t, h)).astype(np.float32)
    ids, wts = ml.route(x, w.router, k)
    act = {"activation": "swiglu_oai", "alpha": alpha, "limit": limit}
    c = np.einsum("th,tkhn->tkn", x, w.w_gate_up[ids]) + w.gate_up_bias[ids]  # [T, K, 2I], routed
    assert limit > 5 or np.mean(c[..., :i] > limit) > 0.05, "the gate clamp must act"
    out = _session(ml.build_moe_int8_model(q, k, router_in_graph=False, **act)).run(
        None, {"x": x, "topk_ids": ids, "topk_weights": wts})[0]
    np.testing.assert_array_equal(out, ml.moe_layer_int8_reference(x, q, ids, wts, **act))
    # Not held to MOE_CHAIN_VS_W8A8_REL_L2: the clamps put many SwiGLU outputs on a few equal
    # values, and where float32 and float64 S round to different h codes (measured up to 3e-4
    # here) the two differ by those codes' down-projection rows. Printed, not asserted.
    w8a8 = ml.relative_l2(out, ml.moe_layer_w8a8(x, w, (ids, wts), **act))
    err = ml.relative_l2(out, ml.moe_layer_float(x, w, k, routing=(ids, wts), **act))
    print(f"{gemm_isa} alpha {alpha} limit {limit}: INT8 chain vs float layer relative L2 {err:.4f}, "
          f"vs its float64 W8A8 model {w8a8:.1e}")
    assert err <= MOE_CHAIN_VS_FLOAT_REL_L2
    plain = ml.moe_layer_float(x, w, k, routing=(ids, wts))  # the biases and activation matter
    assert ml.relative_l2(out, plain) > 10 * MOE_CHAIN_VS_FLOAT_REL_L2


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_expert_weights_quantized_per_expert_equal_the_whole_array_rule(rng, dtype):
    """quantize_expert_weights (one expert at a time) gives the codes and scales of quantize_rows
    over the whole [E, K, N] array: float16 and float32 weights, a transposed view (the rewrite
    reads exporters' [E, N, K] weights that way), an all-zero expert and a column of tiny values."""
    from ort_ops.ops._quant import quantize_expert_weights, quantize_rows

    w = (rng.standard_normal((5, 24, 40)) * 0.02).astype(dtype)
    w[2] = 0
    w[3, :, 7] = np.float32(1e-38) if dtype == np.float32 else 0
    for arr in (w, np.ascontiguousarray(w.transpose(0, 2, 1)).transpose(0, 2, 1), w.transpose(0, 2, 1)):
        q, s = quantize_expert_weights(arr)
        q0, s0 = quantize_rows(np.asarray(arr, np.float32), axis=1)
        assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (arr.shape[0], arr.shape[2])
        np.testing.assert_array_equal(q, q0)
        np.testing.assert_array_equal(s, s0)
