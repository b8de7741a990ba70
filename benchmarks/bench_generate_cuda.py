# SPDX-License-Identifier: MIT
"""Generation of a realistic-size decoder on the GPU: our rewritten model on the paged runtime
against the engines people serve ONNX and torch models with, in one run (issue 18; run on the
H200). Also runs on the CPU EP at tiny sizes (``--device cpu --tiny``) so the harness is
exercised without a GPU.

Cases: prefill (batch 1, ``--prefill`` tokens, default 2048: the time of the one Run that reads
the prompt and gives its last token's greedy pick, or its logits: see the engines) and decode (batches ``--batches``, default 1 and 32, each
sequence with ``--context`` tokens cached, default 4096: the time of one step of one new token per
sequence). Wall clock per Run/step on the host, ORT synchronizing at the end of each Run; median
and p90 of ``--repeat`` after ``--warmup``. tokens/s = tokens of the case / median.

Engines (a row that cannot run prints its reason instead):
  ours       ``ort-ops rewrite`` of the export (INT8 paged KV cache, INT8 MoE) on
             ``ort_ops.runtime.PagedRunner``: caches on the GPU bound in place, the step tables
             copied once per step; each step is a greedy step (``step_greedy``, what ``generate``
             runs when it keeps no logits): the model's next_token output (ArgMax of the last
             tokens' logits, on the GPU) is all that comes back, S int64 token ids, as GenAI's
             generate_next_token leaves its pick on the device; decode steps replayed as CUDA
             graphs (PagedRunner's buckets; the warm-up steps include each bucket's regular Run
             and its capture). A rewrite made before next_token existed takes the argmax on the
             host (the row's note says so; delete model.int8.onnx to rewrite).
  ours-nograph  the same, every step run node by node (``cuda_graph=False``).
  ours-logits   the same as ours, each step returning the last tokens' logits to the host as
             float32 [S, V] (``step``; ``generate(..., return_logits=True)``): what a caller that
             samples or scores on the host pays.
  ort        the original export on ORT's CUDA EP (fp16), its own past/present cache under
             IOBinding: past on the GPU, present allocated by ORT each Run (concat of the past
             and the new token), logits to the host at decode; at prefill all [1, P, V] logits
             stay on the GPU (ours copies its last row back: a small advantage to the peer).
  ort-gqa    the export after ORT's transformer optimizer (onnxruntime.transformers
             optimize_model + convert_generation.replace_mha_with_gqa) or onnxscript's ORT
             fusions (optimize_for_ort) where either turns the attention into
             com.microsoft GroupQueryAttention (fp16 cache); timed like ``ort``. Where neither
             fuses (the torch.onnx dynamo sdpa form of transformers 5 is not matched by either,
             measured on the tiny export) the row says so.
  torch      PyTorch eager, the same weights (the checkpoint beside the export), a StaticCache
             and a hand loop (prefill with logits_to_keep=1, then one token per step).
  genai-fp16 / genai-int4   onnxruntime-genai (``onnxruntime-genai-cuda``) where importable:
             the checkpoint built by its model builder (fp16; int4 weights), CUDA graphs on
             (``enable_cuda_graph``), prefill by append_tokens, decode by generate_next_token.
Ratios: ours' tokens/s over each engine's for the same case (> 1: ours is faster).

One correctness check before timing: the prefill's last-token logits of ours against ort on the
same prompt (max abs difference, same argmax). Benchmarks never assert.

    python benchmarks/bench_generate_cuda.py --family llama --work /data/llama1b [--csv out.csv]
    python benchmarks/bench_generate_cuda.py --family qwen_moe --work /data/qwenmoe
    python benchmarks/bench_generate_cuda.py --device cpu --tiny             # a CPU check, minutes

``--work`` holds the models: model.onnx and checkpoint/ (made by graphs/export_realistic.py when
missing, with ``--layers`` / ``--vocab``), model.int8.onnx (``ort-ops rewrite`` when missing),
model.gqa.onnx, genai-*/.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENGINES = ("ours", "ours-nograph", "ours-logits", "ort", "ort-gqa", "torch", "genai-fp16", "genai-int4")


class Skip(Exception):
    """An engine that cannot run here, with the reason printed in its row."""


def median_p90(times):
    s = sorted(times)
    return statistics.median(s), s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def timed(fn, warmup: int, repeat: int):
    """Calls fn() warmup + repeat times; returns the wall times of the last ``repeat``."""
    times = []
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


# --- models ------------------------------------------------------------------------------------


def prepare(args) -> dict:
    """Paths of the export, its checkpoint and its rewrite (built when missing)."""
    work = Path(args.work)
    orig = work / "model.onnx"
    if not orig.exists():
        from graphs.export_realistic import build

        print(f"building {args.family} ({'tiny, ' if args.tiny else ''}{args.dtype}) into {work} ...", file=sys.stderr)
        build(args.family, work, dtype=args.dtype, tiny=args.tiny, layers=args.layers, vocab=args.vocab,
              exporter=args.exporter)
    rew = work / "model.int8.onnx"
    if not rew.exists():
        import ort_ops

        print(f"ort-ops rewrite {orig} -> {rew} ...", file=sys.stderr)
        _, results = ort_ops.rewrite_model(str(orig), str(rew), block_size=args.block_size,
                                           moe_weight_layout=args.moe_weight_layout)
        for r in results:
            print(f"  {r.kind}: {r.fused} fused" + "".join(f"; declined {d.where}: {d.reason}" for d in r.declined),
                  file=sys.stderr)
    return {"original": str(orig), "rewritten": str(rew), "checkpoint": str(work / "checkpoint"), "work": work}


def model_dims(path: str) -> dict:
    """Layers, kv heads, head dim, vocabulary and float dtype of an export, from its graph."""
    import onnx
    from onnx import helper

    m = onnx.load(path, load_external_data=False)
    ins = {i.name: i for i in m.graph.input}
    # The past keys: past_key_values.{i}.key (torch.onnx dynamo), past_key_values.layers.{i}.keys
    # (transformers' exporter), or other spellings: the rank-4 inputs named for keys.
    past = sorted(n for n, i in ins.items() if len(i.type.tensor_type.shape.dim) == 4
                  and "key" in n.lower().replace("past_key_values", "past") and "value" not in n.lower().split(".")[-1])
    if not past:
        raise ValueError(f"bench_generate_cuda: no past key inputs in {path} (inputs: {sorted(ins)[:8]})")
    t = ins[past[0]].type.tensor_type
    # transformers' exporter writes fixed sizes as dim_param strings ("2", "64")
    dims = [d.dim_value or (int(d.dim_param) if d.dim_param.isdigit() else 0) for d in t.shape.dim]
    logits = next(o for o in m.graph.output if o.name == "logits")
    vocab = logits.type.tensor_type.shape.dim[2].dim_value
    return {"layers": len(past), "kv_heads": dims[1], "head_dim": dims[3], "vocab": vocab,
            "dtype": helper.tensor_dtype_to_np_dtype(t.elem_type)}


# --- engines -----------------------------------------------------------------------------------


def run_ours(paths, args, prompt, dims, cuda_graph: bool = True, greedy: bool = True):
    """Times prefill and decode steps of PagedRunner: greedy steps (token ids back) or, with
    ``greedy=False``, steps that return the logits. Returns the times and the prefill's
    last-token logits (the correctness check, from one logits step outside the timing)."""
    from ort_ops.runtime import PagedRunner, paged_metadata

    meta = paged_metadata(paths["rewritten"])
    if meta is None:
        raise Skip("the rewrite left the model unpaged (see the rewrite's declined reasons)")
    bs = meta["block_size"]
    per_seq = -(-(args.context + args.warmup + args.repeat + 2) // bs)
    num_blocks = per_seq * max(args.batches) + -(-len(prompt) // bs) + 2
    runner = PagedRunner(paths["rewritten"], num_blocks=num_blocks, device=args.device,
                         cuda_graph=cuda_graph and args.device == "cuda")
    if cuda_graph and args.device == "cuda" and not runner.cuda_graph:
        raise Skip(f"no CUDA graphs: {runner.graph_note}")
    out = {}
    if greedy and runner.token_name is None:
        out["note"] = ("greedy steps take the argmax of the logits on the host: model.int8.onnx has no next_token "
                       "output (rewritten before it existed; delete it to rewrite)")
    run = runner.step_greedy if greedy else runner.step
    n = [0]

    def prefill(step=run):
        n[0] += 1
        result = step({f"p{n[0]}": prompt})
        runner.release(f"p{n[0]}")
        return result

    check = prefill(runner.step)[0]
    out[("prefill", 1)] = timed(prefill, args.warmup, args.repeat)
    rng = np.random.default_rng(1)
    for b in args.batches:
        seqs = [f"b{b}s{i}" for i in range(b)]
        ctx = {s: rng.integers(3, dims["vocab"], args.context).tolist() for s in seqs}
        # Fill the contexts in steps of at most --max-step-tokens tokens (chunked prefill).
        todo = {s: 0 for s in seqs}
        while todo:
            batch, room = {}, args.max_step_tokens
            for s in list(todo):
                if room <= 0:
                    break
                take = min(room, args.context - todo[s])
                batch[s] = ctx[s][todo[s]:todo[s] + take]
                room -= take
            runner.step(batch)
            for s, toks in batch.items():
                todo[s] += len(toks)
                if todo[s] >= args.context:
                    del todo[s]
        step = {s: [5] for s in seqs}
        out[("decode", b)] = timed(lambda: run(step), args.warmup, args.repeat)
        for s in seqs:
            runner.release(s)
    return out, check


class _OrtDecoder:
    """An export with past/present on ORT under IOBinding (the peers' harness)."""

    def __init__(self, path, args, dims):
        import onnxruntime as ort

        from ort_ops.runtime import resolve_device

        self.ort = ort
        self.device, providers = resolve_device(args.device)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[args.ort_opt_level]
        t0 = time.perf_counter()
        self.sess = ort.InferenceSession(path, so, providers=providers)
        # (ORT's constant folding of a large export, e.g. Qwen-MoE's stacked experts split into one
        # initializer per expert, can take minutes: said, so a slow start is not taken for a hang)
        print(f"  ORT session of {Path(path).name}: {time.perf_counter() - t0:.1f} s to create", file=sys.stderr,
              flush=True)
        self.inputs = [i.name for i in self.sess.get_inputs()]
        # dynamo: past_key_values.N.key; the transformers exporter: input.past_key_values.layers.N.keys
        self.past = [n for n in self.inputs if "past_key_values" in n]
        self.present = [o.name for o in self.sess.get_outputs() if o.name != "logits"]
        self.dims = dims

    def _val(self, arr):
        return self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), self.device, 0)

    def past_values(self, batch, length, rng):
        shape = (batch, self.dims["kv_heads"], length, self.dims["head_dim"])
        return [self._val(rng.standard_normal(shape, dtype=np.float32).astype(self.dims["dtype"])) for _ in self.past]

    def run(self, ids, past_len, past, logits_to_host: bool):
        b, s = ids.shape
        io = self.sess.io_binding()
        feeds = {"input_ids": ids.astype(np.int64),
                 "attention_mask": np.ones((b, past_len + s), np.int64),
                 "position_ids": np.broadcast_to(np.arange(past_len, past_len + s), (b, s)).astype(np.int64)}
        keep = {n: self._val(v) for n, v in feeds.items() if n in self.inputs}  # alive until the Run ends
        for n, v in keep.items():
            io.bind_ortvalue_input(n, v)
        for n, v in zip(self.past, past):
            io.bind_ortvalue_input(n, v)
        io.bind_output("logits", "cpu" if logits_to_host else self.device)
        for n in self.present:
            io.bind_output(n, self.device)
        self.sess.run_with_iobinding(io)
        return io.get_outputs()[0]


def run_ort(path, args, prompt, dims):
    dec = _OrtDecoder(path, args, dims)
    rng = np.random.default_rng(2)
    out = {}
    empty = dec.past_values(1, 0, rng)
    ids = np.asarray([prompt], np.int64)
    check = dec.run(ids, 0, empty, True).numpy()[0, -1].astype(np.float32)
    out[("prefill", 1)] = timed(lambda: dec.run(ids, 0, empty, False), args.warmup, args.repeat)
    for b in args.batches:
        past = dec.past_values(b, args.context, rng)
        tok = np.full((b, 1), 5, np.int64)
        out[("decode", b)] = timed(lambda: dec.run(tok, args.context, past, True), args.warmup, args.repeat)
        del past
    return out, check


def gqa_model(paths, args, dims) -> str:
    """The export with its attention as GroupQueryAttention, by ORT's transformer optimizer or
    onnxscript's ORT fusions; Skip (with what each did) where neither fuses."""
    import onnx

    out = Path(paths["work"]) / "model.gqa.onnx"
    if out.exists():
        return str(out)
    notes = []
    try:
        from onnxruntime.transformers.convert_generation import replace_mha_with_gqa
        from onnxruntime.transformers.optimizer import optimize_model

        m = onnx.load(paths["original"], load_external_data=False)
        cfg = json.loads(next((p.value for p in m.metadata_props if p.key == "ort_ops.config"), "{}"))
        heads = cfg.get("num_attention_heads", 0)
        hidden = cfg.get("hidden_size", 0)
        opt = optimize_model(paths["original"], model_type="gpt2", num_heads=heads, hidden_size=hidden,
                             opt_level=0, use_gpu=args.device == "cuda")
        ops = {n.op_type for n in opt.model.graph.node}
        if "MultiHeadAttention" in ops:
            replace_mha_with_gqa(opt, "attention_mask", dims["kv_heads"], 1)
        if "GroupQueryAttention" in {n.op_type for n in opt.model.graph.node}:
            opt.save_model_to_file(str(out), use_external_data_format=True)
            return str(out)
        notes.append("onnxruntime.transformers optimize_model fused no attention (Softmax stays)")
    except Exception as e:  # noqa: BLE001 - the reason goes in the row
        notes.append(f"onnxruntime.transformers: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    try:
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model = ir.load(paths["original"])
        res = optimize_for_ort(model)
        model = res[0] if isinstance(res, tuple) else model
        if any(n.op_type == "GroupQueryAttention" for n in model.graph):
            ir.save(model, str(out), external_data=out.name + ".data")
            return str(out)
        notes.append("onnxscript optimize_for_ort fused no GroupQueryAttention")
    except Exception as e:  # noqa: BLE001
        notes.append(f"onnxscript: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    raise Skip("; ".join(notes))


def run_torch(paths, args, prompt):
    try:
        import torch
        from transformers import AutoModelForCausalLM, StaticCache
    except ImportError as e:
        raise Skip(f"torch / transformers not importable ({e})") from None
    if not Path(paths["checkpoint"]).exists():
        raise Skip(f"no checkpoint at {paths['checkpoint']} (graphs/export_realistic.py writes it)")
    dev = "cuda" if args.device == "cuda" else "cpu"
    dtype = {"fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(paths["checkpoint"], dtype=dtype).to(dev).eval()
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = {}

    def forward(ids, cache, start):
        pos = torch.arange(start, start + ids.shape[1], device=dev)
        r = model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True, logits_to_keep=1)
        sync()
        return r.logits

    with torch.inference_mode():
        ids = torch.tensor([prompt], device=dev)

        def prefill():
            return forward(ids, StaticCache(config=model.config, max_cache_len=len(prompt) + 8), 0)

        out[("prefill", 1)] = timed(prefill, args.warmup, args.repeat)
        for b in args.batches:
            cache = StaticCache(config=model.config, max_cache_len=args.context + 8)
            g = torch.Generator().manual_seed(3)
            ctx = torch.randint(3, model.config.vocab_size, (b, args.context), generator=g).to(dev)
            chunk = max(1, args.max_step_tokens // b)
            for s in range(0, args.context, chunk):
                forward(ctx[:, s:s + chunk], cache, s)
            tok = torch.full((b, 1), 5, device=dev)
            # Every timed step writes position `context` again: the same work each time.
            out[("decode", b)] = timed(lambda: forward(tok, cache, args.context), args.warmup, args.repeat)
            del cache
    return out


def run_genai(paths, args, prompt, precision: str):
    try:
        import onnxruntime_genai as og
    except ImportError as e:
        raise Skip(f"onnxruntime_genai not importable ({e}); pip install onnxruntime-genai-cuda") from None
    if not Path(paths["checkpoint"]).exists():
        raise Skip(f"no checkpoint at {paths['checkpoint']}")
    out_dir = Path(paths["work"]) / f"genai-{precision}"
    if not (out_dir / "genai_config.json").exists():
        ep = "cuda" if args.device == "cuda" else "cpu"
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", paths["checkpoint"], "-o", str(out_dir),
               "-p", precision, "-e", ep, "-c", str(Path(paths["work"]) / "genai-cache")]
        if ep == "cuda":
            cmd += ["--extra_options", "enable_cuda_graph=1"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or not (out_dir / "genai_config.json").exists():
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise Skip(f"model builder failed ({precision}): {tail[0][:200]}")
    model = og.Model(str(out_dir))
    out, notes = {}, []

    def new_generator(batch, max_length):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max_length, batch_size=batch, do_sample=False)
        return og.Generator(model, params)

    def prefill():
        g = new_generator(1, len(prompt) + 8)
        g.append_tokens(np.asarray([prompt], np.int32))

    out[("prefill", 1)] = timed(prefill, args.warmup, args.repeat)
    rng = np.random.default_rng(4)
    for b in args.batches:
        steps = args.warmup + args.repeat
        tokens = rng.integers(3, 1000, (b, args.context)).astype(np.int32)
        try:
            g = new_generator(b, args.context + steps + 8)
            g.append_tokens(tokens)
        except Exception as e:  # noqa: BLE001 - its CUDA-graph GQA takes batched prompts only at batch 1
            if b == 1 or args.device != "cuda":
                raise
            # The same model with CUDA graphs off in the provider options (genai_config.json's
            # setting, overridden at load), so the batched prompt append is accepted.
            cfg = og.Config(str(out_dir))
            cfg.clear_providers()
            cfg.append_provider("cuda")
            cfg.set_provider_option("cuda", "enable_cuda_graph", "0")
            model = og.Model(cfg)
            notes.append(f"b{b} without CUDA graphs ({str(e).splitlines()[0][:120]})")
            g = new_generator(b, args.context + steps + 8)
            g.append_tokens(tokens)
        out[("decode", b)] = timed(g.generate_next_token, args.warmup, args.repeat)
        del g
    if notes:
        print(f"genai-{precision}: " + "; ".join(notes), file=sys.stderr)
        out["note"] = "; ".join(notes)
    return out


# --- report ------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("llama", "qwen_moe"), default="llama")
    ap.add_argument("--work", default=None, help="folder of the models (default: a folder under the temp dir)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny fp32 models and sizes (prefill 64, context 128, batches 1,4) for a CPU run")
    ap.add_argument("--dtype", choices=("fp16", "fp32"), default=None, help="export dtype (default fp16; --tiny fp32)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--exporter", choices=("dynamo", "transformers"), default="dynamo",
                    help="how a missing export is made (graphs/export_realistic.py --exporter)")
    ap.add_argument("--block-size", type=int, default=64, help="KV block size of the rewrite (default 64)")
    ap.add_argument("--moe-weight-layout", default=None,
                    help="MoE gate/up weight layout of the rewrite (default ENK on cuda, the K-major layout "
                         "its GEMM reads fastest; EKN on cpu)")
    ap.add_argument("--prefill", type=int, default=None, help="prompt tokens of the prefill case (default 2048)")
    ap.add_argument("--context", type=int, default=None, help="cached tokens per sequence at decode (default 4096)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,32)")
    ap.add_argument("--max-step-tokens", type=int, default=8192, help="tokens a step while filling contexts")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {','.join(ENGINES)}")
    ap.add_argument("--ort-opt-level", choices=("disable", "basic", "extended", "all"), default="all",
                    help="graph optimization level of the ort and ort-gqa sessions (default all, ORT's default; "
                         "'disable' skips the constant folding that splits a stacked-expert export's weights, "
                         "which can take minutes to create a session)")
    ap.add_argument("--csv", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("fp32" if args.tiny else "fp16")
    args.moe_weight_layout = args.moe_weight_layout or ("ENK" if args.device == "cuda" else "EKN")
    args.prefill = args.prefill or (64 if args.tiny else 2048)
    args.context = args.context or (128 if args.tiny else 4096)
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.tiny else "1,32")).split(",")]
    args.work = args.work or str(Path(tempfile.gettempdir()) / f"ort_ops_bench_{args.family}{'_tiny' if args.tiny else ''}")
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        print(f"bench_generate_cuda: unknown engines {sorted(unknown)}, expected some of {ENGINES}", file=sys.stderr)
        return 2

    from ort_ops.runtime import resolve_device

    try:
        resolve_device(args.device)
    except ValueError as e:
        print(f"bench_generate_cuda: {e}", file=sys.stderr)
        return 2
    paths = prepare(args)
    dims = model_dims(paths["original"])
    prompt = np.random.default_rng(0).integers(3, dims["vocab"], args.prefill).tolist()
    cases = [("prefill", 1)] + [("decode", b) for b in args.batches]
    results, reasons, checks = {}, {}, {}
    for engine in engines:
        print(f"running {engine} ...", file=sys.stderr, flush=True)
        try:
            if engine == "ours":
                results[engine], checks["ours"] = run_ours(paths, args, prompt, dims)
            elif engine == "ours-nograph":
                results[engine], check = run_ours(paths, args, prompt, dims, cuda_graph=False)
                checks.setdefault("ours", check)
            elif engine == "ours-logits":
                results[engine], check = run_ours(paths, args, prompt, dims, greedy=False)
                checks.setdefault("ours", check)
            elif engine == "ort":
                results[engine], checks["ort"] = run_ort(paths["original"], args, prompt, dims)
            elif engine == "ort-gqa":
                results[engine], _ = run_ort(gqa_model(paths, args, dims), args, prompt, dims)
            elif engine == "torch":
                results[engine] = run_torch(paths, args, prompt)
            else:
                results[engine] = run_genai(paths, args, prompt, engine.split("-")[1])
        except Skip as e:
            reasons[engine] = str(e)
        except Exception as e:  # noqa: BLE001 - a failing peer is a row with its reason
            reasons[engine] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            traceback.print_exc(file=sys.stderr)

    print(f"\nbench_generate_cuda: {args.family} on {args.device}, {dims['layers']} layers, vocab {dims['vocab']}, "
          f"{np.dtype(dims['dtype']).name} export; prefill {args.prefill} tokens, decode at context {args.context}; "
          f"median / p90 of {args.repeat} after {args.warmup} warm-up"
          + (f"; ort sessions at graph optimization level '{args.ort_opt_level}'" if args.ort_opt_level != "all" else ""))
    if "ours" in checks and "ort" in checks:
        a, b = checks["ours"], checks["ort"]
        print(f"check (prefill last-token logits, ours vs ort): max abs diff {float(np.max(np.abs(a - b))):.4f}, "
              f"argmax {'same' if int(a.argmax()) == int(b.argmax()) else 'DIFFERENT'}")
    print("ours, ours-nograph: greedy steps (token ids back); ours-logits: steps returning float32 logits; "
          "ort, ort-gqa: logits to the host at decode; genai: generate_next_token (its own greedy pick; "
          "the row reads no tokens back)")
    header = f"{'engine':<13} {'case':<8} {'batch':>5} {'median ms':>10} {'p90 ms':>9} {'tokens/s':>11} {'ours x':>7}"
    print(header)
    print("-" * len(header))
    rows = []
    for engine in engines:
        if engine in reasons:
            print(f"{engine:<13} {'':<8} {'':>5} {reasons[engine]}")
            rows.append({"engine": engine, "note": reasons[engine]})
            continue
        for case, b in cases:
            times = results[engine].get((case, b))
            if not times:
                continue
            med, p90 = median_p90(times)
            tokens = args.prefill if case == "prefill" else b
            tps = tokens / med
            ours = results.get("ours", {}).get((case, b))
            ratio = (tokens / median_p90(ours)[0]) / tps if ours else float("nan")
            print(f"{engine:<13} {case:<8} {b:>5} {med * 1e3:>10.3f} {p90 * 1e3:>9.3f} {tps:>11.1f} {ratio:>7.2f}")
            rows.append({"engine": engine, "case": case, "batch": b, "median_ms": med * 1e3, "p90_ms": p90 * 1e3,
                         "tokens_per_s": tps, "ours_speedup": ratio, "note": results[engine].get("note", "")})
        if results[engine].get("note"):
            print(f"{'':<13} note: {results[engine]['note']}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["engine", "case", "batch", "median_ms", "p90_ms", "tokens_per_s",
                                              "ours_speedup", "note"])
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
