# SPDX-License-Identifier: MIT
"""Stacked-layer sessions on the CUDA EP, ours against ORT's own ops, in one run (issue 17).

What a user sees: one ORT session per model, IOBinding with every input, output and cache on the
GPU, caches bound in place; wall time of ``run_with_iobinding`` (ORT synchronizes the GPU at the
end of each Run), medians. Each model is timed with ORT's CUDA graphs off and on
(``enable_cuda_graph``: the first Runs capture, later ones replay). Beside each session the GPU
time of its kernels (CUPTI through torch.profiler, summed per Run) gives the per-node overhead:
(wall - GPU time) / nodes.

Models (fp16 activations for ORT's ops, as they take; ours float32 or fp16 as stated):
  attention  N layers of [QuantizeKVCache + PagedAttentionInt8] (block 64, s8/s8, fp16 q/k/v),
             decode of one token per sequence on `context` cached ones; layer i+1's query is
             layer i's output. Peer: N layers of com.microsoft GroupQueryAttention with an INT8
             per-tensor KV cache (k_quant_type PER_TENSOR, kv_cache_bit_width 8), past and present
             sharing one buffer.
  moe        N layers of [router MatMul, Softmax, TopK, renormalize, DynamicQuant of the token rows,
             MoeInitRouting of the int8 rows and scales, GroupedMatmulSwigluQuant,
             GroupedMatmulDequant, MoeFinalizeRouting + residual] (the chain the rewrite emits),
             float32 activations. Peer: N layers of [router MatMul, com.microsoft MoE fp16, Add].

Usage: python benchmarks/bench_model_cuda.py [--what attention,moe] [--layers 16] [--csv out.csv]
Never asserts and never runs under pytest; a peer that cannot run is reported with its reason.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ort_ops._domain import DOMAIN, OPSET_VERSION  # noqa: E402
from ort_ops.ops._moe import EKN, ENK  # noqa: E402
from ort_ops.ops._schema import IR_VERSION, ONNX_OPSET  # noqa: E402
from ort_ops.paged_interface import (  # noqa: E402
    BLOCK_TABLES,
    CACHE_PARTS,
    CU_SEQLENS_Q,
    SEQ_LENS,
    SLOT_MAPPING,
    cache_shapes,
)

F16, F32, I8, I32, I64 = TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT32, TensorProto.INT64
NP = {F16: np.float16, F32: np.float32, I8: np.int8, I32: np.int32, I64: np.int64}
vi = helper.make_tensor_value_info


def _model(nodes, inputs, outputs, inits=(), domains=((DOMAIN, OPSET_VERSION),)):
    graph = helper.make_graph(nodes, "stack", inputs, outputs, list(inits))
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", ONNX_OPSET), *(helper.make_opsetid(d, v) for d, v in domains)])


# ---------------------------------------------------------------- attention models

def ours_attention_model(layers, seqs, hq, hkv, d, nblocks, block, max_blocks):
    """N layers of QuantizeKVCache + PagedAttentionInt8; caches are inputs bound in place."""
    t = seqs
    ins = [vi("query", F16, [t, hq, d]), vi("key", F16, [t, hkv, d]), vi("value", F16, [t, hkv, d]),
           vi(SLOT_MAPPING, I64, [t]), vi(BLOCK_TABLES, I32, [seqs, max_blocks]), vi(SEQ_LENS, I32, [seqs]),
           vi(CU_SEQLENS_Q, I32, [seqs + 1])]
    outs, nodes = [], []
    q = "query"
    for i in range(layers):
        names = [f"kv.{i}.{part}" for part in CACHE_PARTS]
        for n, (shp, dt) in zip(names, cache_shapes(nblocks, hkv, block, d)):
            elem = I8 if dt == np.int8 else F32
            ins.append(vi(n, elem, list(shp)))
            outs.append(vi(n + ".out", elem, list(shp)))
        nodes.append(helper.make_node("QuantizeKVCache", ["key", "value", SLOT_MAPPING, *names],
                                      [n + ".out" for n in names], domain=DOMAIN, name=f"qkv{i}"))
        nodes.append(helper.make_node("PagedAttentionInt8", [q, *[n + ".out" for n in names], BLOCK_TABLES,
                                                             SEQ_LENS, CU_SEQLENS_Q],
                                      [f"attn{i}"], domain=DOMAIN, name=f"pa{i}"))
        q = f"attn{i}"
    nodes.append(helper.make_node("Identity", [q], ["output"]))
    outs.insert(0, vi("output", F16, [t, hq, d]))
    return _model(nodes, ins, outs)


def gqa_attention_model(layers, batch, hq, hkv, d, ctx):
    """N layers of com.microsoft GroupQueryAttention with an INT8 per-tensor KV cache."""
    cache = [batch, hkv, ctx, d]
    ins = [vi("query", F16, [batch, 1, hq * d]), vi("key", F16, [batch, 1, hkv * d]),
           vi("value", F16, [batch, 1, hkv * d]), vi("seqlens_k", I32, [batch]),
           vi("total_sequence_length", I32, [1]), vi("kv_scale", F32, [1])]
    outs, nodes = [], []
    q = "query"
    for i in range(layers):
        pk, pv = f"past_key.{i}", f"past_value.{i}"
        ins += [vi(pk, I8, cache), vi(pv, I8, cache)]
        outs += [vi(f"present_key.{i}", I8, cache), vi(f"present_value.{i}", I8, cache)]
        nodes.append(helper.make_node(
            "GroupQueryAttention", [q, "key", "value", pk, pv, "seqlens_k", "total_sequence_length",
                                    "", "", "", "", "", "kv_scale", "kv_scale"],
            [f"attn{i}", f"present_key.{i}", f"present_value.{i}"], domain="com.microsoft", name=f"gqa{i}",
            num_heads=hq, kv_num_heads=hkv, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR",
            kv_cache_bit_width=8))
        q = f"attn{i}"
    nodes.append(helper.make_node("Identity", [q], ["output"]))
    outs.insert(0, vi("output", F16, [batch, 1, hq * d]))
    return _model(nodes, ins, outs, domains=(("com.microsoft", 1),))


# ---------------------------------------------------------------- MoE models

def ours_moe_model(layers, hidden, inter, experts, top_k, rng, layout=EKN):
    """N layers of the router + our INT8 chain, residual added by MoeFinalizeRouting; ``layout``
    is GroupedMatmulSwigluQuant's weight_layout ("ENK": [E, N, K], the wgmma kernel's operand)."""
    from ort_ops.testing.moe_layer import quantize_moe_weights, random_moe_weights

    nodes, inits = [], [numpy_helper.from_array(np.array([top_k], np.int64), "k"),
                        numpy_helper.from_array(np.array([-1], np.int64), "last_axis")]
    x = "x"
    for i in range(layers):
        w = random_moe_weights(rng, hidden, inter, experts)
        q = quantize_moe_weights(w)
        p = f"l{i}."
        inits += [numpy_helper.from_array(w.router, p + "router"),
                  numpy_helper.from_array(q.gate_up if layout == EKN else np.ascontiguousarray(q.gate_up.transpose(0, 2, 1)),
                                          p + "w1"),
                  numpy_helper.from_array(q.gate_up_scale, p + "s1"),
                  numpy_helper.from_array(q.down, p + "w2"), numpy_helper.from_array(q.down_scale, p + "s2")]
        dm = {"domain": DOMAIN}
        nodes += [
            helper.make_node("MatMul", [x, p + "router"], [p + "logits"]),
            helper.make_node("Softmax", [p + "logits"], [p + "probs"], axis=-1),
            helper.make_node("TopK", [p + "probs", "k"], [p + "tp", p + "ti64"], axis=-1),
            helper.make_node("ReduceSum", [p + "tp", "last_axis"], [p + "tsum"], keepdims=1),
            helper.make_node("Div", [p + "tp", p + "tsum"], [p + "tw"]),
            helper.make_node("Cast", [p + "ti64"], [p + "ti"], to=I32),
            helper.make_node("DynamicQuant", [x], [p + "tq", p + "ts"], **dm),
            helper.make_node("MoeInitRouting", [p + "tq", p + "ti", p + "ts"], [p + "xq", p + "s2f", p + "gl", p + "xs"],
                             num_experts=experts, **dm),
            helper.make_node("GroupedMatmulSwigluQuant", [p + "xq", p + "w1", p + "s1", p + "xs", p + "gl"],
                             [p + "hq", p + "hs", p + "ho"], weight_layout=layout, **dm),
            helper.make_node("GroupedMatmulDequant", [p + "hq", p + "w2", p + "s2", p + "hs", p + "gl"],
                             [p + "eo"], **dm),
            helper.make_node("MoeFinalizeRouting", [p + "eo", p + "s2f", p + "tw", x], [p + "y"], **dm),
        ]
        x = p + "y"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    return _model(nodes, [vi("x", F32, ["T", hidden])], [vi("y", F32, ["T", hidden])], inits)


def contrib_moe_model(layers, hidden, inter, experts, top_k, rng):
    """N layers of router MatMul + com.microsoft MoE (fp16, SwiGLU with separate fc3) + Add."""
    from ort_ops.testing.moe_layer import random_moe_weights

    nodes, inits = [], []
    x = "x"
    for i in range(layers):
        w = random_moe_weights(rng, hidden, inter, experts)
        p = f"l{i}."
        gate = w.w_gate_up[:, :, :inter].transpose(0, 2, 1)
        up = w.w_gate_up[:, :, inter:].transpose(0, 2, 1)
        down = w.w_down.transpose(0, 2, 1)
        for name, a in (("router", w.router), ("fc1", gate), ("fc2", down), ("fc3", up)):
            inits.append(numpy_helper.from_array(np.ascontiguousarray(a).astype(np.float16), p + name))
        nodes += [
            helper.make_node("MatMul", [x, p + "router"], [p + "logits"]),
            helper.make_node("MoE", [x, p + "logits", p + "fc1", "", p + "fc2", "", p + "fc3"], [p + "moe"],
                             domain="com.microsoft", k=top_k, normalize_routing_weights=1, activation_type="silu"),
            helper.make_node("Add", [x, p + "moe"], [p + "y"]),
        ]
        x = p + "y"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    return _model(nodes, [vi("x", F16, ["T", hidden])], [vi("y", F16, ["T", hidden])], inits,
                  domains=(("com.microsoft", 1),))


# ---------------------------------------------------------------- sessions and timing

class Session:
    """One ORT CUDA session over device tensors bound once (inputs, outputs, in-place caches)."""

    def __init__(self, model, feeds, outputs, *, ours, graph, torch):
        import onnxruntime as ort

        from ort_ops._lib import session_options

        so = session_options() if ours else ort.SessionOptions()
        opts = {"enable_cuda_graph": "1"} if graph else {}
        self.sess = ort.InferenceSession(model.SerializeToString(), so,
                                         providers=[("CUDAExecutionProvider", opts), "CPUExecutionProvider"])
        self.io = self.sess.io_binding()
        for name, t in feeds.items():
            if isinstance(t, np.ndarray):  # CPU-memory input (GQA's total_sequence_length)
                self.io.bind_cpu_input(name, t)
            else:
                self.io.bind_input(name, "cuda", 0, _np_dtype(t, torch), list(t.shape), t.data_ptr())
        for name, t in outputs.items():
            self.io.bind_output(name, "cuda", 0, _np_dtype(t, torch), list(t.shape), t.data_ptr())
        self.nodes = len(model.graph.node)

    def run(self):
        self.sess.run_with_iobinding(self.io)


def _np_dtype(t, torch):
    return {torch.float16: np.float16, torch.float32: np.float32, torch.int8: np.int8, torch.int32: np.int32,
            torch.int64: np.int64}[t.dtype]


BREAKDOWN = False  # --breakdown: print each session's kernels by GPU time


def time_session(s, iters, torch):
    """Median wall microseconds of a Run, and the GPU time of its kernels (CUPTI, per Run)."""
    for _ in range(5):  # warm-up; with CUDA graphs these Runs also capture
        s.run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        s.run()
        times.append((time.perf_counter() - t0) * 1e6)
    gpu = float("nan")
    try:
        from torch.profiler import ProfilerActivity, profile

        reps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                s.run()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        gpu = sum(e.device_time_total for e in kernels) / reps
        if BREAKDOWN:
            by_name = {}
            for e in kernels:
                by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time_total / reps
            for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:10]:
                print(f"      {us:9.1f} us/Run  {name[:110]}", flush=True)
    except Exception as ex:  # noqa: BLE001 - a profiler failure leaves the GPU column empty
        print(f"  (profiler failed: {str(ex)[:100]})", flush=True)
    return statistics.median(times), gpu


def attention_cases(args, torch, writer):
    hq, hkv, d, block = 32, 8, 128, 64
    for batch, ctx in [(1, 4096), (32, 4096), (32, 16384)][: args.attn_cases]:
        gen = torch.Generator(device="cuda").manual_seed(batch * 7 + ctx)
        max_blocks = ctx // block
        nblocks = batch * max_blocks + 1
        # Ours: each sequence owns max_blocks consecutive blocks; its new token goes to the last slot.
        q = torch.randn((batch, hq, d), device="cuda", generator=gen).half()
        k = torch.randn((batch, hkv, d), device="cuda", generator=gen).half()
        v = torch.randn((batch, hkv, d), device="cuda", generator=gen).half()
        tables = torch.arange(batch * max_blocks, dtype=torch.int32, device="cuda").view(batch, max_blocks)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        slots = (tables[:, -1].long() * block + block - 1).contiguous()
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        feeds = {"query": q, "key": k, "value": v, SLOT_MAPPING: slots, BLOCK_TABLES: tables, SEQ_LENS: lens,
                 CU_SEQLENS_Q: cu}
        outs = {"output": torch.empty_like(q)}
        for i in range(args.layers):
            for name, (shp, np_dt) in zip(CACHE_PARTS, cache_shapes(nblocks, hkv, block, d)):
                dt = torch.int8 if np_dt == np.int8 else torch.float32
                if dt == torch.int8:
                    t = torch.randint(-127, 128, shp, dtype=dt, device="cuda", generator=gen)
                else:
                    t = torch.rand(shp, device="cuda", generator=gen) * 0.02
                feeds[f"kv.{i}.{name}"] = t
                outs[f"kv.{i}.{name}.out"] = t  # in place
        model = ours_attention_model(args.layers, batch, hq, hkv, d, nblocks, block, max_blocks)
        # Peer: GQA INT8, one cache per layer [B, Hkv, ctx, D].
        gcache = [batch, hkv, ctx, d]
        gfeeds = {"query": q.view(batch, 1, hq * d), "key": k.view(batch, 1, hkv * d),
                  "value": v.view(batch, 1, hkv * d),
                  "seqlens_k": torch.full((batch,), ctx - 1, dtype=torch.int32, device="cuda"),
                  "total_sequence_length": np.array([ctx], np.int32),
                  "kv_scale": torch.full((1,), 0.02, dtype=torch.float32, device="cuda")}
        gouts = {"output": torch.empty((batch, 1, hq * d), dtype=torch.float16, device="cuda")}
        for i in range(args.layers):
            for name in ("key", "value"):
                t = torch.randint(-127, 128, gcache, dtype=torch.int8, device="cuda", generator=gen)
                gfeeds[f"past_{name}.{i}"] = t
                gouts[f"present_{name}.{i}"] = t
        gmodel = gqa_attention_model(args.layers, batch, hq, hkv, d, ctx)
        results = {}
        for graph in (False, True):
            for impl, m, f, o, ours in (("ours", model, feeds, outs, True), ("ort-gqa-int8", gmodel, gfeeds, gouts, False)):
                try:
                    s = Session(m, f, o, ours=ours, graph=graph, torch=torch)
                    if ours:
                        import ort_ops
                        s.run()
                        torch.cuda.synchronize()
                        ort_ops.check_device_errors()
                    wall, gpu = time_session(s, args.iters, torch)
                    results[(impl, graph)] = wall
                    writer({"what": "attention", "impl": impl, "cuda_graph": graph, "batch": batch, "context": ctx,
                            "layers": args.layers, "wall_us": wall, "wall_us_per_layer": wall / args.layers,
                            "gpu_us": gpu, "overhead_us_per_node": (wall - gpu) / max(1, s.nodes - 1),
                            "speed_vs_peer": ""})
                except Exception as ex:  # noqa: BLE001 - report the peer's failure, go on
                    print(f"  attention {impl} graph={graph} b{batch}/{ctx}: failed: {str(ex)[:300]}", flush=True)
            if ("ours", graph) in results and ("ort-gqa-int8", graph) in results:
                r = results[("ort-gqa-int8", graph)] / results[("ours", graph)]
                print(f"  => attention b{batch}/{ctx} graph={graph}: ours {results[('ours', graph)]:.1f} us, "
                      f"GQA INT8 {results[('ort-gqa-int8', graph)]:.1f} us: speed ours/GQA {r:.2f}x", flush=True)
        del feeds, outs, gfeeds, gouts
        torch.cuda.empty_cache()


def moe_cases(args, torch, writer):
    hidden, inter = 2048, 1408
    for experts, top_k in args.moe_shapes:
        rng = np.random.default_rng(experts)
        model = ours_moe_model(args.moe_layers, hidden, inter, experts, top_k, rng, args.moe_layout)
        rng = np.random.default_rng(experts)
        peer = contrib_moe_model(args.moe_layers, hidden, inter, experts, top_k, rng)
        for tokens in args.tokens:
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            x = torch.randn((tokens, hidden), device="cuda", generator=gen)
            y = torch.empty_like(x)
            xh, yh = x.half(), torch.empty((tokens, hidden), dtype=torch.float16, device="cuda")
            results = {}
            for graph in (False, True):
                for impl, m, f, o, ours in (("ours", model, {"x": x}, {"y": y}, True),
                                            ("ort-moe-fp16", peer, {"x": xh}, {"y": yh}, False)):
                    try:
                        s = Session(m, f, o, ours=ours, graph=graph, torch=torch)
                        wall, gpu = time_session(s, args.iters, torch)
                        if ours:
                            import ort_ops
                            ort_ops.check_device_errors()
                        results[(impl, graph)] = wall
                        writer({"what": f"moe {experts}e top{top_k}",
                                "impl": f"ours-{args.moe_layout}" if ours else impl, "cuda_graph": graph,
                                "batch": tokens, "context": "", "layers": args.moe_layers, "wall_us": wall,
                                "wall_us_per_layer": wall / args.moe_layers, "gpu_us": gpu,
                                "overhead_us_per_node": (wall - gpu) / max(1, s.nodes - 1), "speed_vs_peer": ""})
                    except Exception as ex:  # noqa: BLE001
                        print(f"  moe {impl} graph={graph} {experts}e T={tokens}: failed: {str(ex)[:300]}", flush=True)
                if ("ours", graph) in results and ("ort-moe-fp16", graph) in results:
                    r = results[("ort-moe-fp16", graph)] / results[("ours", graph)]
                    print(f"  => moe {experts}e top{top_k} T={tokens} graph={graph}: ours "
                          f"{results[('ours', graph)]:.1f} us, ORT MoE fp16 {results[('ort-moe-fp16', graph)]:.1f} us:"
                          f" speed ours/ORT {r:.2f}x", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="attention,moe")
    ap.add_argument("--layers", type=int, default=16, help="attention layers")
    ap.add_argument("--attn-cases", type=int, default=3, help="how many of b1/4k, b32/4k, b32/16k")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--tokens", default="1,16,256,4096")
    ap.add_argument("--moe-shapes", default="8x2", help="experts x top-k, comma separated (e.g. 8x2,64x8)")
    ap.add_argument("--moe-layout", default=EKN, choices=[EKN, ENK],
                    help="GroupedMatmulSwigluQuant weight layout of our MoE model")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--breakdown", action="store_true", help="print each session's kernels by GPU time")
    args = ap.parse_args(argv)
    global BREAKDOWN
    BREAKDOWN = args.breakdown
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.moe_shapes = [tuple(int(v) for v in s.split("x")) for s in args.moe_shapes.split(",")]
    import onnxruntime as ort
    import torch

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider: nothing to run")
        return 0
    rows = []
    cols = ["what", "impl", "cuda_graph", "batch", "context", "layers", "wall_us", "wall_us_per_layer", "gpu_us",
            "overhead_us_per_node", "speed_vs_peer"]
    print(" | ".join(cols), flush=True)

    def writer(row):
        rows.append(row)
        print(" | ".join(f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in cols), flush=True)

    with torch.no_grad():
        if "attention" in args.what:
            attention_cases(args, torch, writer)
        if "moe" in args.what:
            moe_cases(args, torch, writer)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
