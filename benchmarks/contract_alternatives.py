# SPDX-License-Identifier: MIT
"""The contract's INT8 choices against two alternatives, at the op, on trained models' activations (issue 21, item 3).

    python benchmarks/contract_alternatives.py --models DIR [--shared DIR] [--contexts 512,2048,4096]
                                               [--windows 4] [--queries 128] [--threads 2] [--json out.json]

DIR: what ``graphs/train_models.py --tiny`` writes (dense.pt, moe.pt, eval_tokens.npy,
manifest.json); ``--shared``: the directory of its ``--models moe_shared`` run (optional).

Perplexity does not resolve what the INT8 contract costs these models (benchmarks/NOTES_accuracy.md),
so this script measures the two choices the issue names where they act, against float64:

1. PagedAttentionInt8's P.V rule (DESIGN.md): W_t = P_t * sV_t, codes re-quantized per group of
   32 key positions (one scale max W / L per group). Contract: ``ort_ops.reference.paged_attention_int8``
   itself. Alternative: groups of 16, computed by ``attend_groups`` below, which follows the
   reference's float32 steps with the group size as a parameter (tests/test_contract_alternatives.py
   checks it equals the reference bit for bit at 32, and a float64 loop at 16). Both read the same
   INT8 cache (``build_paged_cache``), qk s8. The yardstick is ``exact_attention`` (float64, unquantized
   K/V); "pv none" (float P.V on the same INT8 cache and qk s8) is the floor no group size can beat.
   Queries: the last ``--queries`` positions of each window (the tokens eval_perplexity.py scores),
   each seeing every earlier key (prefill form, the same causal attention as its decode steps).
2. GroupedMatmulSwigluQuant's output scale: one per row (contract: the reference chain
   DynamicQuant -> MoeInitRouting -> GroupedMatmulSwigluQuant -> GroupedMatmulDequant ->
   MoeFinalizeRouting) against one per row per C-column group of the intermediate dimension
   (alternative, C = 128 as the issue proposes; 64 and 32 as probes of finer groups):
   ``swiglu_column_groups`` quantizes the reference's own float32 SwiGLU output (``swiglu_rows``) per
   group and runs GroupedMatmulDequant's reference on each group's columns, summing the groups'
   float32 outputs (what a kernel would do: one int32 sum and one scale multiply per group). The
   yardstick is ``moe_experts_float`` (float64, unquantized weights and activations); "S float" (the
   SwiGLU output not re-quantized, everything else INT8) is the floor no scale grouping can beat.
   Blocks: every MoE layer's routed experts (the model's own router, top-2), moe_shared's shared
   expert (an always-on expert, as the rewrite runs it), and, as a proxy only, the dense model's
   SwiGLU MLP run through the same chain as one expert (the rewrite does not quantize dense MLPs;
   it is the one real SwiGLU here wider than 256).

Activations come from the torch model rebuilt by ``graphs/train_models.build_model`` with the
manifest's config and the trained state dict (``<model>.pt``): the same weights as the exported
ONNX model. Hooks record each layer's q and k after RoPE and v (the attention function's inputs),
each MoE block's post-norm hidden state and its router's top-k ids and weights, and each MLP's input.
Every layer gets the float model's inputs, so each row is that op's own error, not the error
propagated from earlier INT8 layers. The float perplexity of the scored tokens is printed as a
check that these are the windows and the model eval_perplexity.py scores.

Errors: relative RMS = ||out - ref|| / ||ref|| over all heads, tokens (and layers, windows) together,
and the largest absolute error. "part" is the error beyond the floor, sqrt(err^2 - floor^2): what
the choice under study adds (independent errors add in quadrature). Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ort_ops import reference as R
from ort_ops.ops._moe import moe_experts_float
from ort_ops.ops._quant import quantize_expert_weights, quantize_rows
from ort_ops.ops.grouped_matmul_swiglu_quant import swiglu_rows
from ort_ops.ops.paged_attention_int8 import PV_LEVELS, build_paged_cache, gather_sequence

CONTRACT_GROUP = 32     # DESIGN.md: W codes re-quantized per 32 key positions
ALT_GROUP = 16
ALT_COLUMNS = (128, 64, 32)  # 128: the alternative; 64 / 32: probes of finer groups


# --- attention: the P.V rule with the group size as a parameter ----------------------------------


def attend_groups(q, kq, sk, vq, sv, scale, pv_quant: str, group: int):
    """One q head's causal attention over its kv head's INT8 cache, W re-quantized per ``group``
    key positions: the reference's steps (``paged_attention_int8._attend_one_head``, no window,
    softcap or sink) in the same float32 order, with GROUP a parameter.

    q float32 [n, D] at positions L - n .. L - 1; kq, vq int8 [L, D]; sk, sv float32 [L]. qk s8.
    Returns float32 [n, D].
    """
    n, d = q.shape
    length = kq.shape[0]
    qq, sq = quantize_rows(q, axis=-1)                                   # qk s8: per-query-row codes
    idot = (qq.astype(np.float64) @ kq.astype(np.float64).T).astype(np.int64)
    s = (((idot.astype(np.float32) * sq[:, None]) * sk[None, :]) * np.float32(scale)).astype(np.float32)
    visible = np.arange(length)[None, :] <= (length - n + np.arange(n))[:, None]
    s = np.where(visible, s, np.float32(-np.inf))
    m = s.max(axis=1, keepdims=True)
    e = np.exp(s - m).astype(np.float32)
    den = e.sum(axis=1, keepdims=True, dtype=np.float32)
    p = (e / den).astype(np.float32)
    w = (p * sv[None, :]).astype(np.float32)                             # V's per-token scale folded into P
    levels = np.float32(PV_LEVELS[pv_quant])
    groups = -(-length // group)
    pad = groups * group - length                                        # invisible / padded keys: W = 0
    wg = np.pad(w, ((0, 0), (0, pad))).reshape(n, groups, group)
    vg = np.pad(vq, ((0, pad), (0, 0))).reshape(groups, group, d)
    gmax = wg.max(axis=2)
    with np.errstate(over="ignore"):
        inv = levels / np.where(gmax > 0, gmax, np.float32(1))
    inv = np.where(gmax > 0, np.minimum(inv, np.finfo(np.float32).max), np.float32(0)).astype(np.float32)
    wq = np.minimum(np.rint((wg * inv[:, :, None]).astype(np.float32)), levels)
    isum = np.einsum("ngk,gkd->ngd", wq.astype(np.float64), vg.astype(np.float64)).astype(np.int64)
    gscale = (gmax / levels).astype(np.float32)
    return (gscale[:, :, None] * isum.astype(np.float32)).astype(np.float32).sum(axis=1, dtype=np.float32)


def paged_attention_groups(query, cache: dict, cu_seqlens_q, pv_quant: str, group: int, scale=None):
    """PagedAttentionInt8 (qk s8, no window / softcap / sink) with P.V groups of ``group`` keys,
    on a cache from ``build_paged_cache``: [T, Hq, D] float32."""
    t, hq, d = query.shape
    hkv = cache["key_cache"].shape[1]
    scale = np.float32(1.0 / math.sqrt(d)) if scale is None else np.float32(scale)
    cu = np.asarray(cu_seqlens_q, np.int64)
    out = np.zeros((t, hq, d), np.float32)
    for s, length in enumerate(np.asarray(cache["seq_lens"], np.int64)):
        kq, sk, vq, sv = gather_sequence(cache["key_cache"], cache["value_cache"], cache["key_scale"],
                                         cache["value_scale"], cache["block_tables"][s], int(length))
        for h in range(hq):
            kh = h // (hq // hkv)
            out[cu[s]:cu[s + 1], h] = attend_groups(np.asarray(query[cu[s]:cu[s + 1], h], np.float32), kq[:, kh],
                                                    sk[:, kh], vq[:, kh], sv[:, kh], scale, pv_quant, group)
    return out


# --- MoE: the SwiGLU output scale per row or per column group ------------------------------------


def expert_weights(w_gate_up, w_down):
    """The rewrite's offline rule (per output channel) for float [E, H, 2I] and [E, I, H]."""
    gq, gs = quantize_expert_weights(w_gate_up)
    dq, ds = quantize_expert_weights(w_down)
    return gq, gs, dq, ds


def _routed_rows(x, ids, num_experts):
    """DynamicQuant then MoeInitRouting (the rewrite's chain): int8 rows sorted by expert."""
    xq, xs = R.dynamic_quant(np.asarray(x, np.float32))
    sx, s2f, gl, sxs = R.moe_init_routing(xq, np.asarray(ids, np.int32), num_experts, x_scale=xs)
    return sx, s2f, gl, sxs


def moe_contract(x, ids, wts, q):
    """The contract's chain through the references: y = GMSQ's per-row INT8 SwiGLU output."""
    gq, gs, dq, ds = q
    sx, s2f, gl, sxs = _routed_rows(x, ids, gq.shape[0])
    y, ys, _ = R.grouped_matmul_swiglu_quant(sx, gq, gs, sxs, gl)
    eo = R.grouped_matmul_dequant(y, dq, ds, ys, gl)
    return R.moe_finalize_routing(eo, s2f, np.asarray(wts, np.float32))


def swiglu_column_groups(s, valid, columns: int):
    """The SwiGLU output S [M, I] quantized by the contract's rule per row per ``columns`` columns:
    (codes int8 [M, I], scales float32 [M, I / columns]); invalid rows 0 as in the reference."""
    m, i = s.shape
    if i % columns:
        raise ValueError(f"contract_alternatives: intermediate size {i} is not a multiple of {columns}")
    yq, ys = quantize_rows(s.reshape(m, i // columns, columns), axis=-1)
    yq, ys = yq.reshape(m, i), ys.astype(np.float32)
    yq[~valid] = 0
    ys[~valid] = 0
    return yq, ys


def down_column_groups(yq, ys, dq, ds, gl, columns: int):
    """GroupedMatmulDequant with one x scale per column group: its reference on each group's
    columns (that group's rows of the weight), the groups' float32 outputs summed in order."""
    out = None
    for g in range(ys.shape[1]):
        c = slice(g * columns, (g + 1) * columns)
        part = R.grouped_matmul_dequant(np.ascontiguousarray(yq[:, c]), np.ascontiguousarray(dq[:, c, :]), ds,
                                        np.ascontiguousarray(ys[:, g]), gl)
        out = part if out is None else (out + part).astype(np.float32)
    return out


def moe_columns(x, ids, wts, q, columns: int):
    """The chain with the alternative: SwiGLU output scales per row per ``columns`` columns."""
    gq, gs, dq, ds = q
    sx, s2f, gl, sxs = _routed_rows(x, ids, gq.shape[0])
    s, valid = swiglu_rows(sx, gq, gs, sxs, gl)
    yq, ys = swiglu_column_groups(s, valid, columns)
    eo = down_column_groups(yq, ys, dq, ds, gl, columns)
    return R.moe_finalize_routing(eo, s2f, np.asarray(wts, np.float32))


def moe_s_float(x, ids, wts, q):
    """The floor: the same INT8 weights and activations, the SwiGLU output S not re-quantized
    (S float32 times the dequantized down weights, in float64)."""
    gq, gs, dq, ds = q
    sx, s2f, gl, sxs = _routed_rows(x, ids, gq.shape[0])
    s, _ = swiglu_rows(sx, gq, gs, sxs, gl)
    ends = np.asarray(gl, np.int64)
    eo = np.zeros((s.shape[0], dq.shape[2]), np.float64)
    start = 0
    for e, end in enumerate(ends):
        wd = dq[e].astype(np.float64) * ds[e].astype(np.float64)[None, :]
        eo[start:end] = s[start:end].astype(np.float64) @ wd
        start = end
    return R.moe_finalize_routing(eo.astype(np.float32), s2f, np.asarray(wts, np.float32))


# --- errors ----------------------------------------------------------------------------------------


class Err:
    """Accumulates sum (out - ref)^2, sum ref^2 and max |out - ref| over calls."""

    def __init__(self):
        self.d2 = self.r2 = self.amax = 0.0

    def add(self, out, ref):
        d = np.asarray(out, np.float64) - np.asarray(ref, np.float64)
        self.d2 += float((d * d).sum())
        self.r2 += float((np.asarray(ref, np.float64) ** 2).sum())
        self.amax = max(self.amax, float(np.abs(d).max(initial=0.0)))

    @property
    def rel(self) -> float:
        return math.sqrt(self.d2 / self.r2) if self.r2 else float("nan")


def part(err: float, floor: float) -> float:
    """The error beyond the floor, sqrt(err^2 - floor^2) (0 when the floor is not below)."""
    return math.sqrt(max(err * err - floor * floor, 0.0))


# --- the trained models ------------------------------------------------------------------------------


def load_model(models_dir: Path, kind: str):
    """The trained torch model: train_models.build_model with the manifest's config, then its state dict."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graphs"))
    import train_models as tm

    cfg = tm.Config(**json.loads((models_dir / "manifest.json").read_text())["config"])
    model = tm.build_model(kind, cfg)
    model.load_state_dict(torch.load(models_dir / f"{kind}.pt", map_location="cpu"))
    model.set_attn_implementation("sdpa")
    return model.float().eval()


def capture(model, ids: np.ndarray) -> dict:
    """One forward over ids [L]; returns logits [L, V] and per layer: q [L, Hq, D], k / v [L, Hkv, D]
    (the attention function's inputs: after RoPE), and the MLP / MoE inputs (x [L, H], and for MoE
    the router's top-k ids and weights [L, K]; moe_shared's shared expert sees the same x)."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rec: dict = {"attn": [], "mlp": [], "moe": []}
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attn(module, query, key, value, *args, **kwargs):
        rec["attn"].append(tuple(t[0].transpose(0, 1).float().numpy().copy() for t in (query, key, value)))
        return sdpa(module, query, key, value, *args, **kwargs)

    hooks = []
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):  # Mixtral / Qwen2-MoE block: experts(x [T, H], top_k_index, top_k_weights)
            hooks.append(mlp.experts.register_forward_pre_hook(
                lambda mod, args: rec["moe"].append(tuple(a.detach().float().numpy().copy() for a in args[:3]))))
        else:                        # dense SwiGLU MLP: its input
            hooks.append(mlp.register_forward_pre_hook(
                lambda mod, args: rec["mlp"].append(args[0][0].detach().float().numpy().copy())))
    ALL_ATTENTION_FUNCTIONS["sdpa"] = attn
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None]).logits[0].float().numpy()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        for h in hooks:
            h.remove()
    rec["logits"] = logits
    return rec


def mlp_weights(layer_mlp):
    """A SwiGLU MLP (gate_proj, up_proj, down_proj Linear) as one expert: [1, H, 2I], [1, I, H]."""
    g = layer_mlp.gate_proj.weight.detach().numpy().T
    u = layer_mlp.up_proj.weight.detach().numpy().T
    d = layer_mlp.down_proj.weight.detach().numpy().T
    return np.concatenate([g, u], axis=1)[None].astype(np.float32), d[None].astype(np.float32)


def expert_stack(experts):
    """transformers' stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) in the ops'
    [E, H, 2I] / [E, I, H] order; gate_up's first I rows are the SiLU'd gate (the chunk order)."""
    gu = experts.gate_up_proj.detach().numpy().transpose(0, 2, 1)
    dn = experts.down_proj.detach().numpy().transpose(0, 2, 1)
    return np.ascontiguousarray(gu, np.float32), np.ascontiguousarray(dn, np.float32)


def nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=-1)) + m[:, 0]
    return lse - x[np.arange(len(targets)), targets]


# --- the measurement -------------------------------------------------------------------------------

ATTN_ROWS = [("pv none (floor)", "none", None), ("pv s8, 32-token groups (contract)", "s8", 32),
             ("pv s8, 16-token groups", "s8", 16), ("pv u8, 32-token groups (contract)", "u8", 32),
             ("pv u8, 16-token groups", "u8", 16)]


def measure_attention(att: dict, layers_qkv, queries: int, block_size: int, rng) -> None:
    """Adds one window's layers to the per-row Err accumulators ``att``."""
    for q, k, v in layers_qkv:
        length = k.shape[0]
        cuk = np.array([0, length], np.int64)
        cuq = np.array([0, queries], np.int32)
        qs = np.ascontiguousarray(q[length - queries:])
        ref = R.exact_attention(qs, k, v, cuk, cuq)
        cache = build_paged_cache(k, v, cuk, block_size, rng)
        args = [cache[n] for n in ("key_cache", "value_cache", "key_scale", "value_scale", "block_tables", "seq_lens")]
        for label, pv, group in ATTN_ROWS:
            if group in (None, CONTRACT_GROUP):   # the contract (and the floor): the reference itself
                out = R.paged_attention_int8(qs, *args, cuq, qk_quant="s8", pv_quant=pv)
            else:
                out = paged_attention_groups(qs, cache, cuq, pv, group)
            att.setdefault(label, Err()).add(out, ref)
        # The script's own path at 32 against the reference: equal bit for bit (tested), shown here too.
        same = np.array_equal(paged_attention_groups(qs, cache, cuq, "s8", CONTRACT_GROUP),
                              R.paged_attention_int8(qs, *args, cuq, qk_quant="s8", pv_quant="s8"))
        att["_own32_equal"] = att.get("_own32_equal", True) and bool(same)


def measure_block(acc: dict, x, ids, wts, w_gate_up, w_down) -> None:
    """Adds one MoE block's (or one-expert MLP's) tokens to the per-row Err accumulators ``acc``."""
    ref = moe_experts_float(x, ids, wts, w_gate_up, w_down)
    q = expert_weights(w_gate_up, w_down)
    inter = w_down.shape[1]
    acc.setdefault("S float (floor)", Err()).add(moe_s_float(x, ids, wts, q), ref)
    acc.setdefault("per row (contract)", Err()).add(moe_contract(x, ids, wts, q), ref)
    for c in ALT_COLUMNS:
        if inter % c == 0:
            acc.setdefault(f"per {c} columns" + (" (= per row: I = 128)" if c == inter else ""), Err()).add(
                moe_columns(x, ids, wts, q, c), ref)


def run(models_dir: Path, shared_dir: Path | None, contexts, windows: int, queries: int, block_size: int,
        log=print) -> dict:
    stream = np.load(models_dir / "eval_tokens.npy")
    sources = [(models_dir, "dense"), (models_dir, "moe")]
    if shared_dir is not None and (shared_dir / "moe_shared.pt").is_file():
        sources.append((shared_dir, "moe_shared"))
    report = {"contexts": list(contexts), "windows": windows, "queries": queries, "block_size": block_size,
              "models": {}}
    for d, kind in sources:
        if not (d / f"{kind}.pt").is_file():
            log(f"{kind}: no {d / (kind + '.pt')}, skipped")
            continue
        model = load_model(d, kind)
        ent = {"attention": {}, "mlp": {}, "ppl": {}}
        for ctx in contexts:
            w = min(windows, stream.size // ctx)
            att, blocks = {}, {}
            rng = np.random.default_rng(ctx)   # the cache's scattered block layout (no effect on values)
            scored = []
            t0 = time.time()
            for i in range(w):
                ids = np.asarray(stream[i * ctx:(i + 1) * ctx], np.int64)
                rec = capture(model, ids)
                scored.append(nll(rec["logits"][ctx - queries - 1:ctx - 1], ids[ctx - queries:]))
                measure_attention(att, rec["attn"], queries, block_size, rng)
                for li, layer in enumerate(model.model.layers):
                    mlp = layer.mlp
                    if hasattr(mlp, "experts"):
                        x, top_ids, top_w = rec["moe"][li]
                        gu, dn = expert_stack(mlp.experts)
                        measure_block(blocks.setdefault("routed experts", {}), x, top_ids, top_w, gu, dn)
                        if getattr(mlp, "shared_expert", None) is not None:
                            gu1, dn1 = mlp_weights(mlp.shared_expert)
                            one = np.zeros((x.shape[0], 1), np.int64)
                            measure_block(blocks.setdefault("shared expert", {}), x, one, np.ones_like(one, np.float32),
                                          gu1, dn1)
                    else:
                        x = rec["mlp"][li]
                        gu1, dn1 = mlp_weights(mlp)
                        one = np.zeros((x.shape[0], 1), np.int64)
                        measure_block(blocks.setdefault("dense MLP as one expert (proxy)", {}), x, one,
                                      np.ones_like(one, np.float32), gu1, dn1)
            ent["ppl"][str(ctx)] = float(math.exp(np.concatenate(scored).mean()))
            ent["attention"][str(ctx)] = {k: ({"rel": v.rel, "max_abs": v.amax} if isinstance(v, Err) else v)
                                          for k, v in att.items()}
            for name, acc in blocks.items():
                ent["mlp"].setdefault(name, {})[str(ctx)] = {k: {"rel": v.rel, "max_abs": v.amax} for k, v in acc.items()}
            log(f"{kind} ctx {ctx}: {w} windows, {time.time() - t0:.0f} s")
        inter = {}
        for layer in model.model.layers:
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                inter["routed experts"] = int(mlp.experts.down_proj.shape[2])
                if getattr(mlp, "shared_expert", None) is not None:
                    inter["shared expert"] = int(mlp.shared_expert.down_proj.weight.shape[1])
            else:
                inter["dense MLP as one expert (proxy)"] = int(mlp.down_proj.weight.shape[1])
        ent["intermediate"] = inter
        report["models"][kind] = ent
    return report


def format_report(report: dict) -> str:
    ctxs = [str(c) for c in report["contexts"]]
    lines = []
    for kind, ent in report["models"].items():
        lines.append(f"\n{kind}: PagedAttentionInt8 output vs float64 attention on unquantized K/V, qk s8, last "
                     f"{report['queries']} queries of {report['windows']} windows, all layers and heads "
                     "(rel RMS / max abs; ratio = alternative / contract rel RMS; part = beyond pv none)")
        lines.append("float ppl of the scored tokens (torch): " +
                     ", ".join(f"ctx {c} {ent['ppl'][c]:.3f}" for c in ctxs))
        lines.append("| P.V | " + " | ".join(f"ctx {c}" for c in ctxs) + " |")
        lines.append("|---|" + "---|" * len(ctxs))
        for label, pv, group in ATTN_ROWS:
            cells = []
            for c in ctxs:
                a = ent["attention"][c]
                r = a[label]
                cell = f"{r['rel']:.3e} / {r['max_abs']:.2e}"
                if group == ALT_GROUP:
                    base = a[label.replace("16-token groups", "32-token groups (contract)")]
                    floor = a["pv none (floor)"]["rel"]
                    cell += (f" (x{r['rel'] / base['rel']:.3f}; part x"
                             f"{part(r['rel'], floor) / max(part(base['rel'], floor), 1e-300):.3f})")
                cells.append(cell)
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("own 32-group path equals the reference bit for bit: " +
                     str(all(ent["attention"][c].get("_own32_equal") for c in ctxs)))
        for name, per_ctx in ent["mlp"].items():
            lines.append(f"\n{kind}, {name} (I = {ent['intermediate'][name]}): block output vs float64 "
                         "(rel RMS / max abs; ratio = alternative / contract rel RMS; part = beyond S float)")
            lines.append("| SwiGLU output scales | " + " | ".join(f"ctx {c}" for c in ctxs) + " |")
            lines.append("|---|" + "---|" * len(ctxs))
            for label in per_ctx[ctxs[0]]:
                cells = []
                for c in ctxs:
                    r, base = per_ctx[c][label], per_ctx[c]["per row (contract)"]
                    floor = per_ctx[c]["S float (floor)"]["rel"]
                    cell = f"{r['rel']:.3e} / {r['max_abs']:.2e}"
                    if label.startswith("per ") and "contract" not in label:
                        cell += (f" (x{r['rel'] / base['rel']:.3f}; part x"
                                 f"{part(r['rel'], floor) / max(part(base['rel'], floor), 1e-300):.3f})")
                    cells.append(cell)
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="/tmp/ort_ops_models/tiny", help="train_models.py --tiny output (dense, moe)")
    ap.add_argument("--shared", default=None, help="train_models.py --models moe_shared output (optional)")
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--windows", type=int, default=4, help="held-out windows per context (eval_perplexity's)")
    ap.add_argument("--queries", type=int, default=128, help="query rows per window: its last positions")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    models_dir = Path(args.models)
    if not (models_dir / "eval_tokens.npy").is_file():
        print(f"contract_alternatives: '{models_dir}' has no eval_tokens.npy (run graphs/train_models.py --tiny)",
              file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    report = run(models_dir, Path(args.shared) if args.shared else None,
                 [int(c) for c in args.contexts.split(",") if c], args.windows, args.queries, args.block_size,
                 log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
