# SPDX-License-Identifier: MIT
"""``ort-ops rewrite``, ``ort-ops verify`` and ``ort-ops bench`` (added to the parser by ``ort_ops.cli.build_parser``).

Errors are ValueError/FileNotFoundError with a one-line message; ``cli.main`` prints it and
exits 2. ``verify`` exits 1 when the rewritten model fails the check (agreement below
``--min-agreement``, or a length/EOS mismatch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _bool_flag(p: argparse.ArgumentParser, name: str, help_: str, default: bool = True) -> None:
    p.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction,
                   default=default, help=help_)


def _cmd_rewrite(args: argparse.Namespace) -> int:
    from ort_ops.rewrite import load_model, rewrite_model, save_model

    t0 = time.time()
    _status(args, f"reading {args.input}")
    model = load_model(args.input)
    _status(args, "rewriting")
    model, results = rewrite_model(model, None, block_size=args.block_size, pv_quant=args.pv_quant,
                                   qk_quant=args.qk_quant, attention=args.attention, moe=args.moe,
                                   moe_weight_layout=args.moe_weight_layout, norms=args.norms,
                                   concat_matmuls=args.concat_matmuls, rotary=args.rotary, swiglu=args.swiglu,
                                   rotary_kv=args.rotary_kv)
    _status(args, f"writing {args.output}")
    save_model(model, args.output)
    report = {
        "input": args.input,
        "output": args.output,
        "fused": {r.kind: r.fused for r in results},
        "declined": {r.kind: len(r.declined) for r in results},
        "results": [{"kind": r.kind, "fused": r.fused, "details": r.details,
                     "declined": [{"where": d.where, "reason": d.reason} for d in r.declined]}
                    for r in results],
        "seconds": round(time.time() - t0, 2),
    }
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"rewrote {args.input} -> {args.output} in {report['seconds']} s")
    if not results:
        print("  no fusion enabled")
    for r in results:
        extra = ""
        if r.details.get("forms"):
            extra = " (" + ", ".join(f"{k}: {v}" for k, v in r.details["forms"].items()) + ")"
        if r.details.get("interface"):
            extra += f", interface: {r.details['interface']}"
        print(f"  {r.kind}: {r.fused} block(s) fused{extra}")
        blocks = (r.details.get("blocks") or []) if r.kind == "attention" else []
        # every block with its window / softcap / sinks, once any block has one
        for i, b in enumerate(blocks if any(b["window"] or b["softcap"] or b["head_sink"] for b in blocks) else []):
            what = [f"window {b['window']}" if b["window"] else "no window"]
            what += [f"softcap {b['softcap']:g}"] if b["softcap"] else []
            what += [f"head_sink [{', '.join(f'{x:g}' for x in b['head_sink'])}]"] if b["head_sink"] else []
            print(f"    {'layer ' + str(b['layer']) if b['layer'] is not None else 'block ' + str(i)}: {', '.join(what)}")
        for d in r.declined:
            print(f"    declined {d.where}: {d.reason}")
    return 0


def _status(args, msg: str) -> None:
    if not getattr(args, "quiet", False):
        print(f"ort-ops: {msg}...", file=sys.stderr, flush=True)


def _cmd_verify(args: argparse.Namespace) -> int:
    from ort_ops.rewrite import load_model
    from ort_ops.runtime import resolve_device
    from ort_ops.verify import verify

    resolve_device(args.device)  # one-line errors before any work
    for path in (args.original, args.rewritten):
        load_model(path)
    prompts = None
    if args.prompt:
        prompts = [[int(t) for t in p.split(",")] for p in args.prompt]
    _status(args, "generating with the original (stock onnxruntime) and the rewritten model")
    report = verify(args.original, args.rewritten, prompts=prompts, max_new_tokens=args.max_new_tokens,
                    eos_token_id=args.eos_token_id, seed=args.seed, device=args.device,
                    progress=False if (args.json or args.quiet) else None,
                    cuda_graph=None if args.cuda_graph else False)
    o = report["overall"]
    ok = o["token_agreement"] >= args.min_agreement and o["length_match"] and o["eos_match"]
    report["passed"] = ok
    report["min_agreement"] = args.min_agreement
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"verify {args.rewritten} ({report['rewritten_interface']}) against {args.original} on {args.device}")
        if "bfloat16" in report:
            print(f"  bfloat16 models: {report['bfloat16']}")
        print(f"  {'prompt':>6} {'len':>4} {'agree':>6} {'logit err':>9} {'stop':>5} {'free agree':>10} "
              f"{'free len o/r':>12}")
        for i, p in enumerate(report["prompts"]):
            fr = p["free_running"]
            print(f"  {i:>6} {p['prompt_len']:>4} {p['token_agreement']:>6.3f} {p['logits_max_abs_err']:>9.4f} "
                  f"{'ok' if p['length_match'] and p['eos_match'] else 'DIFF':>5} {fr['token_agreement']:>10.3f} "
                  f"{len(p['tokens_original']):>6}/{len(fr['tokens']):<5}")
        print(f"  overall (teacher-forced): token_agreement {o['token_agreement']:.3f}, logits_max_abs_err "
              f"{o['logits_max_abs_err']:.4f}, length_match {o['length_match']}, eos_match {o['eos_match']}")
        f = o["free_running"]
        print(f"  free-running: token_agreement {f['token_agreement']:.3f}, length_match {f['length_match']}, "
              f"eos_match {f['eos_match']}")
        print(f"  {'PASS' if ok else 'FAIL'} (token_agreement >= {args.min_agreement}, lengths and EOS match)")
    return 0 if ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    """Greedy generation time of both models on the same batch of prompts (wall clock, medians)."""
    import statistics

    import numpy as np

    from ort_ops.rewrite import load_model
    from ort_ops.runtime import generate, paged_metadata, resolve_device
    from ort_ops.verify import make_prompts, vocab_size

    _, providers = resolve_device(args.device)
    for path in (args.original, args.rewritten):
        load_model(path)
    rng = np.random.default_rng(args.seed)
    lengths = [int(x) for x in rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, args.batch)]
    prompts = make_prompts(vocab_size(args.original, providers=providers), lengths=lengths, seed=args.seed)
    rows = {}
    for label, path, lib in (("original", args.original, False), ("rewritten", args.rewritten, None)):
        times = []
        for i in range(args.repeat + 1):  # the first run warms up (session creation not timed)
            t0 = time.perf_counter()
            out = generate(path, prompts, max_new_tokens=args.new_tokens, with_library=lib,
                           intra_op_threads=args.threads, providers=providers,
                           max_step_tokens=args.max_step_tokens if label == "rewritten" else None,
                           cuda_graph=None if args.cuda_graph or label == "original" else False,
                           progress=None if not args.json else False)
            if i:
                times.append(time.perf_counter() - t0)
        tokens = sum(len(r.tokens) for r in out)
        med = statistics.median(times)
        rows[label] = {"median_s": med, "p90_s": sorted(times)[int(0.9 * (len(times) - 1))],
                       "new_tokens": tokens, "tokens_per_s": tokens / med}
    meta = paged_metadata(args.rewritten)
    report = {"device": args.device, "batch": args.batch, "prompt_lengths": lengths, "new_tokens": args.new_tokens,
              "repeat": args.repeat, **rows,
              "speedup": rows["original"]["median_s"] / rows["rewritten"]["median_s"],
              "note": "wall clock of ort_ops.generate, session creation excluded; includes Python loop "
                      "overhead, which dominates tiny models"}
    if meta:
        per_tok = sum(h * d * 2 + h * 2 * 4 for h, d in meta["layer_dims"])  # int8 K, V + 2 fp32 scales
        dtype = _past_dtype(args.original)
        report["kv_bytes_per_token"] = {"int8_paged": per_tok, "original_dtype": dtype.name,
                                        "original": sum(h * d * 2 * dtype.itemsize for h, d in meta["layer_dims"])}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"bench on {args.device}: batch {args.batch}, prompts {lengths}, {args.new_tokens} new tokens, "
          f"median of {args.repeat}")
    for label in ("original", "rewritten"):
        r = rows[label]
        print(f"  {label:<10} {r['median_s'] * 1e3:9.1f} ms  (p90 {r['p90_s'] * 1e3:.1f} ms)  "
              f"{r['tokens_per_s']:8.1f} tokens/s")
    print(f"  rewritten / original speed: {report['speedup']:.2f}x")
    if meta:
        kv = report["kv_bytes_per_token"]
        print(f"  KV cache per token: {kv['int8_paged']} B (INT8 + scales) vs {kv['original']} B "
              f"({kv['original_dtype']}, the original's)")
    return 0


def _past_dtype(path: str):
    """The numpy dtype of the original's past K/V inputs (its cache), else of its logits."""
    import numpy as np
    import onnx
    from onnx import helper

    m = onnx.load(path, load_external_data=False)
    past = [i for i in m.graph.input if i.name.startswith("past")]
    typed = past[0] if past else m.graph.output[0]
    return np.dtype(helper.tensor_dtype_to_np_dtype(typed.type.tensor_type.elem_type))


def _device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="execution provider of both models: cpu (default) or cuda (onnxruntime-gpu and a CUDA "
                        "build of the library; the rewritten model's KV cache then lives on the GPU)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="on cuda, run the rewritten model's decode steps node by node instead of as CUDA graphs")


def register(sub) -> None:
    """Adds ``rewrite`` and ``verify`` to the ``ort-ops`` subparsers."""
    from ort_ops.ops._moe import EKN, WEIGHT_LAYOUTS

    rw = sub.add_parser("rewrite", help="replace attention (and MoE) of an exported model by the INT8 ops")
    rw.add_argument("input", help="exported ONNX model")
    rw.add_argument("output", help="where to write the rewritten model")
    rw.add_argument("--block-size", type=int, default=16, help="KV-cache block size (tokens), default 16")
    rw.add_argument("--pv-quant", choices=("s8", "u8", "none"), default="s8",
                    help="P.V quantization of PagedAttentionInt8 (default s8)")
    rw.add_argument("--qk-quant", choices=("s8", "none"), default="s8", help="Q.K quantization (default s8)")
    _bool_flag(rw, "attention", "run the attention fusion (default on)")
    _bool_flag(rw, "moe", "run the MoE fusion (default on)")
    _bool_flag(rw, "norms", "fuse RMSNorm chains into ORT's SimplifiedLayerNormalization (default on)")
    _bool_flag(rw, "concat-matmuls", "join MatMuls that read one activation (Q/K/V, gate/up projections) into "
               "one MatMul and a Split (default on)")
    _bool_flag(rw, "swiglu", "fuse the MLP's Split -> SiLU -> Mul (after --concat-matmuls) into one ort_ops "
               "SwiGLU node (default on)")
    _bool_flag(rw, "rotary-kv", "fuse each layer's Q/K/V Split, the RotaryEmbeddings of Q and K and the "
               "QuantizeKVCache (after --attention, --rotary, --concat-matmuls) into one ort_ops "
               "RotaryQuantizeKVCache node (default on)")
    _bool_flag(rw, "rotary", "fuse the RoPE chains of paged models into ORT's com.microsoft RotaryEmbedding "
                             "(default on)")
    rw.add_argument("--moe-weight-layout", choices=WEIGHT_LAYOUTS, default=EKN,
                    help="how the MoE expert weights are stored: EKN [E, H, 2I] (default; fastest on "
                         "CPU without AMX and pre-Hopper GPUs), ENK: gate/up [E, 2I, H], transposed offline for "
                         "the Hopper wgmma kernel (H100/H200, prefill-heavy serving), or EN16K4: gate/up "
                         "[E, 2I/16, H/4, 16, 4] and down [E, H/16, I/4, 16, 4], AMX B tiles packed offline "
                         "for the CPU's AMX kernels (CPU only)")
    rw.add_argument("--json", action="store_true", help="machine-readable report")
    rw.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    rw.set_defaults(func=_cmd_rewrite)

    vf = sub.add_parser("verify", help="greedy-decode the original and the rewritten model, compare")
    vf.add_argument("original", help="the exported model (run on stock onnxruntime, fp32)")
    vf.add_argument("rewritten", help="the output of `ort-ops rewrite`")
    vf.add_argument("--max-new-tokens", type=int, default=32)
    vf.add_argument("--eos-token-id", type=int, default=None,
                    help="stop token (default: the model's ort_ops.eos_token_id metadata, if any)")
    vf.add_argument("--prompt", action="append", help="comma-separated token ids (repeatable); "
                    "default: 4 random prompts of lengths 5, 11, 17, 23")
    vf.add_argument("--seed", type=int, default=0, help="seed of the default prompts")
    vf.add_argument("--min-agreement", type=float, default=0.95,
                    help="token agreement below this fails the check (exit 1), default 0.95")
    _device_flag(vf)
    vf.add_argument("--json", action="store_true", help="machine-readable report")
    vf.add_argument("--quiet", action="store_true", help="no progress on stderr")
    vf.set_defaults(func=_cmd_verify)

    bn = sub.add_parser("bench", help="greedy generation speed of the original vs the rewritten model")
    bn.add_argument("original")
    bn.add_argument("rewritten")
    bn.add_argument("--batch", type=int, default=4)
    bn.add_argument("--prompt-len", type=int, default=64, help="longest prompt (others down to half)")
    bn.add_argument("--new-tokens", type=int, default=32)
    bn.add_argument("--repeat", type=int, default=3)
    bn.add_argument("--threads", type=int, default=None, help="intra-op threads of both sessions")
    bn.add_argument("--seed", type=int, default=0)
    bn.add_argument("--max-step-tokens", type=int, default=None,
                    help="rewritten (paged) model: at most this many tokens a step; longer prefills run in "
                         "chunks (default: all prompts in one step)")
    _device_flag(bn)
    bn.add_argument("--json", action="store_true")
    bn.set_defaults(func=_cmd_bench)
