# SPDX-License-Identifier: MIT
"""Perplexity of trained models, float original against the ort-ops INT8 rewrites (issue 21).

    python benchmarks/eval_perplexity.py --models DIR [--contexts 512,2048,4096] [--windows 4]
                                         [--score 128] [--variants NAME,...] [--peers NAME,...]
                                         [--agreement 128] [--block-size 16] [--threads 2]
                                         [--device cpu|cuda] [--float-chunk 512] [--json out.json]

DIR is what graphs/train_models.py writes: ``<model>.onnx`` (dense, moe, moe_shared; whichever
exist), ``eval_tokens.npy`` (the held-out token stream) and ``manifest.json`` (seed, config).

Protocol, per context length L: W windows of L consecutive held-out tokens (window w starts at
token w * L of the stream). Each window's last ``--score`` tokens are scored: the model sees the
first L - score tokens (prefill) and then, teacher-forced, one true token per step (decode), and
the negative log-likelihood of every true next token from position L - score on is summed.
Perplexity = exp(mean NLL) over all W * score predictions. Each variant's change is reported with
the paired standard error of its mean NLL change over those predictions (x 100: in % of
perplexity, since d ppl / ppl ~ d NLL): a change within about two of them is not resolved by
this much text.

  float      the exported model on stock onnxruntime (fp32; CPU EP, or CUDA EP with --device cuda): one forward over the whole
             window with an empty past (the same predictions as prefill + decode, no cache
             quantization to differ by);
  rewrites   ``ort_ops.rewrite`` variants. Paged ones (attention fused) run through
             ``ort_ops.runtime.PagedRunner``: all windows prefilled in one packed step, then
             decoded together, the INT8 KV cache bound in place. MoE-only rewrites keep the
             float attention and the dense interface: one forward per window, library loaded.

Variants (the attention ones on every model, the MoE ones where the rewrite fuses MoE blocks):

  attn kv8           qk none, pv none: only K/V stored INT8 (the cache's own error)
  attn s8/s8         qk s8, pv s8 (the contract's default)
  attn s8/u8         qk s8, pv u8
  attn s8/none       qk s8, float P.V
  moe w8a8           MoE blocks on the INT8 chain, attention float
  both s8/s8         both fusions, qk/pv s8
  both s8/u8         both fusions, pv u8

Greedy agreement (``--agreement N``): ``ort_ops.verify.verify`` of each rewrite against the
original over 4 held-out prompts of 64 tokens, N new tokens each (teacher-forced agreement and
free-running agreement).

The INT8 options a user has today (``--peers``; the default takes ORT's own op where one runs in
a whole model, and the emulations stay selectable; rows say "(ORT op)" or "(emulated)"):

  qmoe8, qmoe4       ORT's com.microsoft.QMoE in the model (benchmarks/peers_ort.py): every MoE
                     block the ort-ops MoE rewrite proves becomes one QMoE node, 8- or 4-bit
                     expert weights per output channel, symmetric, activations float; run on
                     stock onnxruntime on --device's EP like the float original. A QMoE node the
                     CUDA EP does not take runs on the CPU EP and the row names that EP; a model
                     the session cannot run gives a row saying so. The shared expert of
                     moe_shared stays float (QMoE does not hold one).
  qmoe8 fp16,        the same node on float16 activations (Casts around it, float16 scales):
  qmoe4 fp16         the type ORT's CUDA QMoE kernel is registered for in some onnxruntime-gpu
                     versions, where the float32 node would fall back to the CPU EP;
  qmoe8 emulated,    QMoE's weight rounding applied to the float graph's stacked expert weights
  qmoe4 emulated     ([E, out, in], ``graphs/moe.py::_qmoe_codes``'s rule), activations float;
  gqa-int8 tensor    GroupQueryAttention with an INT8 KV cache, k/v_quant_type PER_TENSOR,
                     emulated (no whole-model rewrite to GQA with a quantized cache exists here;
                     benchmarks/NOTES_accuracy.md says what it would need): every present K (V) of
                     a layer stored as clip(rint(x / s), -128, 127) * s with one scale
                     s = max|x| / 127 per layer, calibrated on training text
                     (``train_tokens_head.npy``: --calib-windows windows of 512 tokens);
  gqa-int8 channel   the same with PER_CHANNEL scales: one per (kv head, head-dim channel).

Benchmarks never assert; the plumbing is tested in tests/test_eval_perplexity.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL_NAMES = ("dense", "moe", "moe_shared")

# label -> rewrite_model keyword arguments; a variant whose fusions match nothing in a model (the
# MoE ones on the dense model) is left out for that model.
VARIANTS: dict[str, dict] = {
    "attn kv8": {"attention": True, "moe": False, "qk_quant": "none", "pv_quant": "none"},
    "attn s8/s8": {"attention": True, "moe": False, "qk_quant": "s8", "pv_quant": "s8"},
    "attn s8/u8": {"attention": True, "moe": False, "qk_quant": "s8", "pv_quant": "u8"},
    "attn s8/none": {"attention": True, "moe": False, "qk_quant": "s8", "pv_quant": "none"},
    "moe w8a8": {"attention": False, "moe": True},
    "both s8/s8": {"attention": True, "moe": True, "qk_quant": "s8", "pv_quant": "s8"},
    "both s8/u8": {"attention": True, "moe": True, "qk_quant": "s8", "pv_quant": "u8"},
}
# label -> (what is quantized, how, "ort" for ORT's own op in the model or "emulated" for its
# storage rounding in the float graph). The default set takes the real op where one runs.
PEERS: dict[str, tuple[str, object, str]] = {
    "gqa-int8 tensor": ("kv", "tensor", "emulated"),
    "gqa-int8 channel": ("kv", "channel", "emulated"),
    "qmoe8": ("moe", 8, "ort"),
    "qmoe4": ("moe", 4, "ort"),
    "qmoe8 fp16": ("moe", 8, "ort"),
    "qmoe4 fp16": ("moe", 4, "ort"),
    "qmoe8 emulated": ("moe", 8, "emulated"),
    "qmoe4 emulated": ("moe", 4, "emulated"),
}
# The activations of the ORT-op peers' nodes (float32 unless named here).
PEER_ACTIVATIONS = {"qmoe8 fp16": "float16", "qmoe4 fp16": "float16"}
DEFAULT_PEERS = ("gqa-int8 tensor", "gqa-int8 channel", "qmoe8", "qmoe4")
# The report's row for each peer: real ops and emulations never share a name.
PEER_ROWS = {
    "gqa-int8 tensor": "peer GQA INT8 per tensor (emulated)",
    "gqa-int8 channel": "peer GQA INT8 per channel (emulated)",
    "qmoe8": "peer QMoE 8-bit (ORT op)",
    "qmoe4": "peer QMoE 4-bit (ORT op)",
    "qmoe8 fp16": "peer QMoE 8-bit, float16 activations (ORT op)",
    "qmoe4 fp16": "peer QMoE 4-bit, float16 activations (ORT op)",
    "qmoe8 emulated": "peer QMoE 8-bit (emulated)",
    "qmoe4 emulated": "peer QMoE 4-bit (emulated)",
}
# The execution provider each --device runs its sessions on.
DEVICE_EP = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def eval_windows(stream: np.ndarray, context: int, count: int) -> np.ndarray:
    """int64 [W, context]: consecutive, non-overlapping windows from the start of the stream
    (W = min(count, len(stream) // context))."""
    w = min(count, stream.size // context)
    if w == 0:
        raise ValueError(f"eval_perplexity: the held-out stream has {stream.size} tokens, fewer than one "
                         f"{context}-token window")
    return np.asarray(stream[:w * context], np.int64).reshape(w, context)


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (nats, float64) of ``targets`` [...] under ``logits`` [..., V]."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=-1)) + m[..., 0]
    picked = np.take_along_axis(x, np.asarray(targets, np.int64)[..., None], axis=-1)[..., 0]
    return lse - picked


def score_dense(model, windows: np.ndarray, score: int, *, with_library: bool = False,
                threads: int | None = None, device: str = "cpu", chunk: int = 0) -> np.ndarray:
    """NLL [W, score] of each window's last ``score`` tokens (an ordinary decoder: stock
    onnxruntime, or the library for MoE-only rewrites): one forward per window over the whole
    window, or with ``chunk`` > 0 (and a model with past/present) the window fed ``chunk`` tokens a
    Run with the model's own KV cache: the same predictions, in less memory (a whole 4k window of
    a ``batched_mm`` MoE export gathers every token's expert weights at once)."""
    from ort_ops.runtime import DenseRunner, resolve_device

    runner = DenseRunner(model, providers=resolve_device(device)[1], with_library=with_library,
                         intra_op_threads=threads)
    w, length = windows.shape
    step = chunk if chunk > 0 and runner.past else length
    out = np.zeros((w, score), np.float64)
    for i in range(w):
        ids = windows[i:i + 1]
        past, rows = None, []
        for a in range(0, length, step):
            b = min(length, a + step)
            logits, past = runner.run(ids[:, a:b], np.ones((1, b), ids.dtype), past)
            rows.append(logits[0])
        logits = np.concatenate(rows)                                   # [L, V]
        # logits[p] predicts token p + 1: the scored tokens L - score .. L - 1.
        out[i] = token_nll(logits[length - score - 1:length - 1], ids[0, length - score:])
    return out


def score_paged(model, windows: np.ndarray, score: int, *, block_size: int = 16,
                threads: int | None = None, device: str = "cpu", chunk: int = 0) -> np.ndarray:
    """NLL [W, score] through the paged runtime: all windows prefilled with their first
    L - score tokens in one packed step (``chunk`` > 0: chunked prefill, one window's ``chunk``
    tokens a step, for models whose float experts gather weights per token), then decoded one
    true token per step, together. Chunking changes no prediction: each step continues the
    sequences' caches."""
    from ort_ops.runtime import PagedKVCache, PagedRunner, graph_scratch_blocks, paged_metadata

    w, length = windows.shape
    if not 0 < score < length:
        raise ValueError(f"eval_perplexity: --score must be in 1..{length - 1} for {length}-token windows, got {score}")
    meta = paged_metadata(model)
    blocks = w * -(-length // meta["block_size"]) + 1
    # On "cuda" the decode steps run as CUDA graphs, as a user's would: the cache carries the
    # scratch blocks their padding rows write to.
    cache = PagedKVCache(meta["num_layers"], meta["layer_dims"], meta["block_size"], blocks,
                         device="cuda" if device == "cuda" else None,
                         scratch_blocks=graph_scratch_blocks(meta["block_size"]) if device == "cuda" else 0)
    runner = PagedRunner(model, cache, device=device, intra_op_threads=threads)
    out = np.zeros((w, score), np.float64)
    prefill = length - score
    if chunk > 0:
        last = {}
        for i in range(w):
            for start in range(0, prefill, chunk):
                last[i] = runner.step({i: windows[i, start:min(prefill, start + chunk)]})[0]
        logits = np.stack([last[i] for i in range(w)])
    else:
        logits = runner.step({i: windows[i, :prefill] for i in range(w)})       # [W, V]: predicts token `prefill`
    out[:, 0] = token_nll(logits, windows[:, prefill])
    for j in range(1, score):
        logits = runner.step({i: windows[i, prefill + j - 1:prefill + j] for i in range(w)})
        out[:, j] = token_nll(logits, windows[:, prefill + j])
    return out


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll))))


def compare_to_float(nll: np.ndarray, ref_nll: np.ndarray) -> dict:
    """A variant's NLLs against the float original's on the same predictions: perplexity, its
    change in %, and the paired standard error of the mean NLL change (how far the change is
    from what the per-token differences would give by chance: |delta_nll| / se)."""
    d = (nll - ref_nll).ravel()
    ppl = perplexity(nll)
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else float("nan")
    return {"ppl": ppl, "nll": float(nll.mean()), "delta_pct": 100.0 * (ppl / perplexity(ref_nll) - 1.0),
            "delta_nll": float(d.mean()), "delta_nll_se": se}


def make_variant(model_path: Path, label: str, out_dir: Path, block_size: int):
    """Rewrites ``model_path`` as ``VARIANTS[label]`` into out_dir; returns (path, paged, fused
    counts {kind: n}) or (None, False, counts) when a needed fusion matched nothing."""
    import ort_ops
    from ort_ops.runtime import paged_metadata

    kw = VARIANTS[label]
    out = out_dir / f"{model_path.stem}.{label.replace(' ', '_').replace('/', '-')}.onnx"
    # Norm and RoPE chains, projections and the MLP stay as exported: a variant changes only what its label
    # says (INT8 attention, INT8 MoE), so its perplexity change is theirs.
    _, results = ort_ops.rewrite_model(str(model_path), str(out), block_size=block_size, norms=False,
                                       concat_matmuls=False, rotary=False, swiglu=False,
                                       rotary_kv=False, **kw)
    fused = {r.kind: r.fused for r in results}
    if (kw.get("moe") and not fused.get("moe")) or (kw.get("attention") and not fused.get("attention")):
        return None, False, fused
    return out, paged_metadata(str(out)) is not None, fused


def calibrate_kv(model, calib: np.ndarray, threads: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """max |present K| and max |present V| of every layer over the calibration windows, per
    (kv head, channel): [(k_amax [Hkv, D], v_amax [Hkv, D]), ...] in the model's present order."""
    from ort_ops.runtime import DenseRunner

    runner = DenseRunner(model, intra_op_threads=threads)
    amax = None
    for row in calib:
        ids = row[None, :]
        _, presents = runner.run(ids, np.ones_like(ids), None)
        cur = [np.abs(p).max(axis=(0, 2)) for p in presents]            # [B, Hkv, L, D] -> [Hkv, D]
        amax = cur if amax is None else [np.maximum(a, c) for a, c in zip(amax, cur)]
    return [(amax[2 * i], amax[2 * i + 1]) for i in range(len(amax) // 2)]


def emulate_gqa_int8(model_path: Path, out: Path, amax, per: str) -> Path:
    """A copy of the float model whose present K/V pass through clip(rint(x / s), -128, 127) * s
    (``per`` "tensor": one s per layer and K or V; "channel": s [1, Hkv, 1, D]): every consumer
    (the attention and the present output) sees the stored INT8 values, as with GQA's INT8 cache."""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.load(str(model_path))
    presents = [o.name for o in m.graph.output[1:]]
    if len(presents) != 2 * len(amax):
        raise ValueError(f"eval_perplexity: {model_path.name} has {len(presents)} present outputs, "
                         f"expected {2 * len(amax)} (K and V per layer)")
    scales = {}
    for i, (ka, va) in enumerate(amax):
        for name, a in ((presents[2 * i], ka), (presents[2 * i + 1], va)):
            a = np.float32(a.max()) if per == "tensor" else a.astype(np.float32)[None, :, None, :]
            scales[name] = np.maximum(np.asarray(a, np.float32) / np.float32(127), np.float32(1e-12))
    consts = [numpy_helper.from_array(np.array(-128, np.float32), "qdq.lo"),
              numpy_helper.from_array(np.array(127, np.float32), "qdq.hi")]
    nodes = []
    for node in m.graph.node:
        nodes.append(node)
        for k, o in enumerate(node.output):
            if o in scales:
                raw, sname = f"{o}.float", f"{o}.kv_scale"
                node.output[k] = raw
                consts.append(numpy_helper.from_array(scales[o], sname))
                nodes += [helper.make_node("Div", [raw, sname], [f"{o}.div"]),
                          helper.make_node("Round", [f"{o}.div"], [f"{o}.rint"]),      # half to even
                          helper.make_node("Clip", [f"{o}.rint", "qdq.lo", "qdq.hi"], [f"{o}.q"]),
                          helper.make_node("Mul", [f"{o}.q", sname], [o])]
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    m.graph.initializer.extend(consts)
    onnx.save(m, str(out))
    return out


def _qmoe_dequant(w: np.ndarray, bits: int) -> np.ndarray:
    """W [E, out, in] after QMoE's quantization (graphs/moe.py::_qmoe_codes) and dequantization."""
    from graphs.moe import _qmoe_codes

    q, scale = _qmoe_codes(w, bits)
    qmax = 127 if bits == 8 else 7
    if bits == 4:
        q = np.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)[..., :w.shape[-1]]
    return ((q.astype(np.int32) - (qmax + 1)).astype(np.float32) * scale[:, :, None]).astype(np.float32)


def emulate_qmoe(model_path: Path, out: Path, bits: int, num_experts: int) -> tuple[Path | None, int]:
    """A copy of the float model whose stacked expert weights hold QMoE's ``bits``-bit values.

    Expert weights are the 3-D initializers with ``num_experts`` rows that a GatherND feeds into
    a MatMul (transformers' batched_mm form): as MatMul's first input they are [E, out, in]
    (quantized over the last axis), as its second [E, in, out] (transposed around the rule).
    Returns (path, weights changed), path None when none was found."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(model_path))
    consumers: dict[str, list] = {}
    for node in m.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    changed = 0
    for init in m.graph.initializer:
        if len(init.dims) != 3 or init.dims[0] != num_experts or init.data_type != onnx.TensorProto.FLOAT:
            continue
        gathers = [n for n in consumers.get(init.name, []) if n.op_type == "GatherND"]
        mm = [(n, list(n.input).index(g.output[0])) for g in gathers for n in consumers.get(g.output[0], [])
              if n.op_type == "MatMul"]
        if not mm:
            continue
        w = numpy_helper.to_array(init).astype(np.float32)
        out_in = mm[0][1] == 0
        deq = _qmoe_dequant(w if out_in else w.transpose(0, 2, 1), bits)
        init.CopyFrom(numpy_helper.from_array(deq if out_in else deq.transpose(0, 2, 1).copy(), init.name))
        changed += 1
    if not changed:
        return None, 0
    onnx.save(m, str(out))
    return out, changed


def run_ort_peer(path: Path, label: str, tmp: Path, models_dir: Path, stream: np.ndarray, contexts,
                 windows: int, score: int, float_nll: dict, *, threads: int | None = None, device: str = "cpu",
                 float_chunk: int = 0) -> dict | None:
    """A peer as ORT's own op in the whole model (``PEERS[label]`` with "ort"): today QMoE, through
    ``peers_ort.rewrite_to_qmoe`` (probed also on the first 512 training tokens when
    ``train_tokens_head.npy`` exists: experts a trained router picks on text, not on random ids), scored
    like the float original on stock onnxruntime. None when no block was replaced. A model the
    device's session cannot run gives a row with "error" instead of failing the run; "provider"
    names the EP that ran the QMoE nodes (a node the CUDA EP does not take runs on the CPU EP)."""
    from benchmarks.peers_ort import node_providers, rewrite_to_qmoe
    from ort_ops.runtime import resolve_device

    _, bits, _ = PEERS[label]
    head = models_dir / "train_tokens_head.npy"
    probe_ids = np.load(head)[:512] if head.is_file() else None
    out = tmp / f"{path.stem}.{label.replace(' ', '_')}.onnx"
    rep = rewrite_to_qmoe(path, out, bits, probe_ids=probe_ids, activations=PEER_ACTIVATIONS.get(label, "float32"))
    if not rep["blocks"]:
        return None
    res = {"emulated": False, "op": "com.microsoft.QMoE", "blocks": len(rep["blocks"]),
           "routing": sorted({b["routing"] for b in rep["blocks"]}), "declined": rep["declined"]}
    try:
        prov = node_providers(out, "QMoE", resolve_device(device)[1])
        res["provider"] = sorted(set(prov))
        for ctx in contexts:
            win = eval_windows(stream, ctx, windows)
            nll = score_dense(str(out), win, min(score, ctx - 1), threads=threads, device=device, chunk=float_chunk)
            res[str(ctx)] = compare_to_float(nll, float_nll[ctx])
    except Exception as e:  # noqa: BLE001 - the device's EP refuses the model: the row says so, the run goes on
        res["error"] = f"does not run on --device {device}: {str(e).splitlines()[0][:300]}"
    return res


def held_out_prompts(stream: np.ndarray, count: int = 4, length: int = 64) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from the end of the held-out stream (not the text the
    perplexity windows start with)."""
    n = count * length
    tail = np.asarray(stream[-n:], np.int64).reshape(count, length)
    return [[int(t) for t in row] for row in tail]


def evaluate(models_dir: Path, *, contexts, windows: int, score: int, variants, block_size: int,
             threads: int | None, agreement: int, peers=(), calib_windows: int = 8, only=MODEL_NAMES,
             log=print, device: str = "cpu", float_chunk: int = 0) -> dict:
    stream = np.load(models_dir / "eval_tokens.npy")
    manifest_path = models_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    report = {"models_dir": str(models_dir), "seed": manifest.get("seed"), "config": manifest.get("config", {}).get("name"),
              "heldout_tokens": int(stream.size), "windows": windows, "score": score, "block_size": block_size,
              "device": device, "float_chunk": float_chunk, "models": {}}
    tmp = Path(tempfile.mkdtemp(prefix="eval_ppl_"))
    for name in only:
        path = models_dir / f"{name}.onnx"
        if not path.is_file():
            continue
        log(f"{name}: float original")
        entry = {"float": {}}
        float_nll = {}
        for ctx in contexts:
            win = eval_windows(stream, ctx, windows)
            t = time.time()
            nll = score_dense(str(path), win, min(score, ctx - 1), threads=threads, device=device, chunk=float_chunk)
            float_nll[ctx] = nll
            entry["float"][str(ctx)] = {"ppl": perplexity(nll), "nll": float(nll.mean()), "windows": int(win.shape[0]),
                                        "seconds": round(time.time() - t, 1)}
        for label in variants:
            if device == "cuda" and VARIANTS[label].get("qk_quant") == "none":
                log(f"{name}: {label}: skipped (the CUDA EP runs qk_quant s8 only)")
                continue
            t = time.time()
            rew, paged, fused = make_variant(path, label, tmp, block_size)
            if rew is None:
                log(f"{name}: {label}: not applicable (fused {fused})")
                continue
            log(f"{name}: {label} (fused {fused}, rewrite {time.time() - t:.0f} s)")
            res = {"fused": fused, "paged": paged}
            for ctx in contexts:
                win = eval_windows(stream, ctx, windows)
                s = min(score, ctx - 1)
                t = time.time()
                nll = (score_paged(str(rew), win, s, block_size=block_size, threads=threads, device=device,
                                   chunk=float_chunk) if paged else
                       score_dense(str(rew), win, s, with_library=True, threads=threads, device=device,
                                   chunk=float_chunk))
                res[str(ctx)] = {**compare_to_float(nll, float_nll[ctx]), "seconds": round(time.time() - t, 1)}
            if agreement:
                from ort_ops.verify import verify

                v = verify(str(path), str(rew), prompts=held_out_prompts(stream), max_new_tokens=agreement,
                           eos_token_id=-1, device=device)
                res["agreement"] = {"teacher_forced": v["overall"]["token_agreement"],
                                    "free_running": v["overall"]["free_running"]["token_agreement"],
                                    "logits_max_abs_err": v["overall"]["logits_max_abs_err"],
                                    "new_tokens": agreement, "prompts": v["overall"]["prompts"]}
            entry[label] = res
        amax = None
        for label in peers:
            kind, how, impl = PEERS[label]
            t = time.time()
            if impl == "ort":
                res = run_ort_peer(path, label, tmp, models_dir, stream, contexts, windows, score, float_nll,
                                   threads=threads, device=device, float_chunk=float_chunk)
                if res is None:
                    log(f"{name}: {label}: not applicable (no MoE block the rewrite proves)")
                    continue
                log(f"{name}: {label} (ORT op, {time.time() - t:.0f} s){': ' + res['error'] if 'error' in res else ''}")
                entry[PEER_ROWS[label]] = res
                continue
            if kind == "kv":
                if amax is None:
                    calib = eval_windows(np.load(models_dir / "train_tokens_head.npy"), 512, calib_windows)
                    amax = calibrate_kv(str(path), calib, threads)
                emu = emulate_gqa_int8(path, tmp / f"{name}.{label.replace(' ', '_')}.onnx", amax, how)
                detail = {"calibration_windows": calib_windows, "calibration_window": 512}
            else:
                experts = int((manifest.get("config") or {}).get("experts", 8))
                emu, changed = emulate_qmoe(path, tmp / f"{name}.{label.replace(' ', '_')}.onnx", how, experts)
                if emu is None:
                    log(f"{name}: {label}: not applicable (no expert weights)")
                    continue
                detail = {"expert_weights": changed}
            log(f"{name}: {label} (emulated, {time.time() - t:.0f} s)")
            res = {"emulated": True, **detail}
            for ctx in contexts:
                win = eval_windows(stream, ctx, windows)
                nll = score_dense(str(emu), win, min(score, ctx - 1), threads=threads, device=device,
                                  chunk=float_chunk)
                res[str(ctx)] = compare_to_float(nll, float_nll[ctx])
            entry[PEER_ROWS[label]] = res
        report["models"][name] = entry
    return report


def format_table(report: dict, contexts) -> str:
    lines = []
    for name, entry in report["models"].items():
        lines.append(f"\n{name} ({report.get('config')}, seed {report.get('seed')}): perplexity on "
                     f"{report['windows']} held-out windows x last {report['score']} tokens; (change vs float "
                     "+- its paired standard error, both in % of perplexity)")
        head = "| variant | " + " | ".join(f"ctx {c}" for c in contexts) + " | greedy agreement (teacher-forced / free) |"
        lines += [head, "|" + "---|" * (len(contexts) + 2)]
        for label, res in entry.items():
            cells = []
            ep = DEVICE_EP.get(report.get("device", "cpu"))
            if res.get("provider") and res["provider"] != [ep]:
                label = f"{label} [QMoE ran on {', '.join(res['provider'])}]"
            if "error" in res:
                lines.append(f"| {label} | {res['error']} |" + " |" * len(contexts))
                continue
            for c in contexts:
                r = res.get(str(c))
                if r is None:
                    cells.append("")
                elif label == "float":
                    cells.append(f"{r['ppl']:.3f}")
                else:
                    cells.append(f"{r['ppl']:.3f} ({r['delta_pct']:+.2f} % +- {100 * r['delta_nll_se']:.2f})")
            ag = res.get("agreement")
            agc = f"{ag['teacher_forced']:.3f} / {ag['free_running']:.3f}" if ag else ""
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {agc} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="directory written by graphs/train_models.py")
    ap.add_argument("--only", default=",".join(MODEL_NAMES), help="models to evaluate (those present)")
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--score", type=int, default=128, help="scored (decoded) tokens at the end of each window")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    ap.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                    help="comma list of: " + ", ".join(PEERS) + " ('' for none)")
    ap.add_argument("--calib-windows", type=int, default=8, help="512-token training windows that calibrate GQA's scales")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    ap.add_argument("--agreement", type=int, default=0, help="greedy agreement over N new tokens (0: skip)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="execution provider of every session (cuda: ORT's CUDA EP; the paged cache on the GPU)")
    ap.add_argument("--float-chunk", type=int, default=0,
                    help="feed the dense (non-paged) models' windows this many tokens a Run with their "
                         "own KV cache (0: one forward per window; use e.g. 512 where a whole window "
                         "does not fit, as batched_mm MoE exports on a GPU)")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    models_dir = Path(args.models)
    if not (models_dir / "eval_tokens.npy").is_file():
        print(f"eval_perplexity: '{models_dir}' has no eval_tokens.npy (run graphs/train_models.py first)", file=sys.stderr)
        return 2
    contexts = [int(c) for c in args.contexts.split(",") if c]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"eval_perplexity: --variants must name {', '.join(VARIANTS)}, got '{unknown[0]}'", file=sys.stderr)
        return 2
    peers = [v.strip() for v in args.peers.split(",") if v.strip()]
    bad = [v for v in peers if v not in PEERS]
    if bad:
        print(f"eval_perplexity: --peers must name {', '.join(PEERS)}, got '{bad[0]}'", file=sys.stderr)
        return 2
    report = evaluate(models_dir, contexts=contexts, windows=args.windows, score=args.score, variants=variants,
                      block_size=args.block_size, threads=args.threads, agreement=args.agreement, peers=peers,
                      calib_windows=args.calib_windows, only=[n for n in args.only.split(",") if n],
                      log=lambda s: print(s, file=sys.stderr, flush=True), device=args.device,
                      float_chunk=args.float_chunk)
    print(format_table(report, contexts))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
