# SPDX-License-Identifier: MIT
"""The ordered list of fusions ``ort-ops rewrite`` runs, and the report they fill.

A fusion is a function ``fuse_<kind>(model: onnx_ir.Model, options: RewriteOptions) ->
FusionResult`` living in ``ort_ops/rewrite/<op or kind>.py``; adding one is one line in
``FUSIONS`` below. Each returns how many blocks it replaced and, for every candidate it
declined, where and why (the model then stays correct, unfused there).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ort_ops.ops._moe import EKN


@dataclasses.dataclass
class RewriteOptions:
    """What the user asked of ``ort-ops rewrite``."""

    block_size: int = 16
    pv_quant: str = "s8"  # s8 | u8 | none
    qk_quant: str = "s8"  # s8 | none
    attention: bool = True
    moe: bool = True
    moe_shared_expert: str = "int8"  # int8 (one always-on expert through the MoE GEMMs) | float
    moe_weight_layout: str = EKN  # GroupedMatmulSwigluQuant's weight: EKN [E, H, 2I] | ENK [E, 2I, H]
    norms: bool = True  # RMSNorm chains as ORT's SimplifiedLayerNormalization
    concat_matmuls: bool = True  # MatMuls of one activation as one MatMul and a Split
    rotary: bool = True  # RoPE chains of paged models as ORT's com.microsoft RotaryEmbedding
    swiglu: bool = True  # the MLP's Split + SiLU + Mul as one ort_ops SwiGLU
    # Split + rotaries of Q and K + QuantizeKVCache as one ort_ops RotaryQuantizeKVCache
    rotary_kv: bool = True


@dataclasses.dataclass
class Decline:
    """A candidate a fusion looked at and left alone."""

    where: str  # node name(s) of the candidate
    reason: str


@dataclasses.dataclass
class FusionResult:
    kind: str  # "attention", "moe", "rotary", "rmsnorm", "matmul_concat", "swiglu", "rotary_kv"
    fused: int = 0
    declined: list[Decline] = dataclasses.field(default_factory=list)
    details: dict = dataclasses.field(default_factory=dict)  # per-kind facts (forms matched, bytes, ...)


# (kind, option flag on RewriteOptions, import path "module:function"), in the order they run.
FUSIONS: list[tuple[str, str, str]] = [
    # MoE first: it proves each block by running the model as exported (plain inputs), before
    # other fusions change the model's inputs.
    ("moe", "moe", "ort_ops.rewrite.moe:fuse_moe"),
    # Attention after MoE: a KV-cache model becomes paged (inputs change), and its checks probe
    # the model with the library registered when it already holds ort_ops nodes.
    ("attention", "attention", "ort_ops.rewrite.paged_attention_int8:fuse_paged_attention_int8"),
    # RoPE after attention: it needs the paged model (one row of packed tokens, so the per-token
    # cos/sin rows are the tokens' rows), and the attention rewrite matches the chains as exported.
    # Before the norms, which match the model as exported (it reads no norm, nor they a RoPE
    # chain: the order between the two changes nothing).
    ("rotary", "rotary", "ort_ops.rewrite.rotary:fuse_rotary"),
    # Norms last: the other fusions match the model as exported (Qwen3's Q/K norms included).
    ("rmsnorm", "norms", "ort_ops.rewrite.rmsnorm:fuse_rmsnorm"),
    # Joined projections after everything that matches them one by one (attention's Q / K / V).
    ("matmul_concat", "concat_matmuls", "ort_ops.rewrite.matmul_concat:fuse_matmul_concat"),
    # SwiGLU after the joined projections: it matches the gate/up Split that matmul_concat writes.
    ("swiglu", "swiglu", "ort_ops.rewrite.swiglu:fuse_swiglu"),
    # The attention prologue last: it matches what attention, rotary and matmul_concat wrote (the
    # QuantizeKVCache, the RotaryEmbeddings, the Q/K/V Split).
    ("rotary_kv", "rotary_kv", "ort_ops.rewrite.rotary_kv:fuse_rotary_kv"),
]


def _load(path: str) -> Callable:
    import importlib

    module, _, fn = path.partition(":")
    return getattr(importlib.import_module(module), fn)


def run_fusions(model, options: RewriteOptions) -> list[FusionResult]:
    """Runs every enabled fusion on ``model`` (an ``onnx_ir.Model``, changed in place)."""
    results = []
    for kind, flag, path in FUSIONS:
        if getattr(options, flag):
            results.append(_load(path)(model, options))
    return results
