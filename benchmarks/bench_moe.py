# SPDX-License-Identifier: MIT
"""A whole MoE layer on the CPU: the ort-ops INT8 chain against ONNX Runtime's own paths.

Layer: hidden H = 2048, intermediate I = 1408 (N = 2816 for the SwiGLU GEMM), SwiGLU experts,
softmax router with top-k and renormalized weights; E experts top-k in {8x2, 64x8}; tokens T in
{1, 16, 128, 512}. Every model takes x [T, H] and the router logits [T, E] (com.microsoft.MoE's
interface) and runs on ORT's CPU EP with the same intra-op thread count:

  ours        Softmax/TopK, MoeInitRouting, DynamicQuant, GroupedMatmulSwigluQuant,
              GroupedMatmulDequant, MoeFinalizeRouting (ort_ops.testing.moe_layer.build_moe_int8_model)
  ours_en16k4 the same model with both GEMMs' weights (gate/up and down) stored weight_layout
              "EN16K4" (AMX B tiles, packed offline as the rewrite's --moe-weight-layout EN16K4 does)
  ours_oai    "ours" as a gpt-oss layer: both GEMMs with their bias input (gate_up [E, 2I], down
              [E, H], N(0, 0.1)) and GroupedMatmulSwigluQuant's activation "swiglu_oai" (alpha 1.702,
              limit 7), same weights; its error is against the float64 layer with the same biases
              and activation (the side-by-side cost of the bias adds and the clamped SwiGLU)
  moe_fp32    com.microsoft.MoE, float32 weights (interleaved SwiGLU, alpha 1, beta 0, no limit)
  qmoe8_ch    com.microsoft.QMoE, 8-bit weights, per-output-channel scales (float activations)
  qmoe8_b128  com.microsoft.QMoE, 8-bit weights, block-128 scales
  onnx_fp32   plain ONNX: per expert NonZero/Gather, MatMul, Sigmoid/Mul/Mul, MatMul, ScatterND add

Reported: median and p90 ms over --repeats runs after warm-up, the ratio of the fastest stock
path (MoE / QMoE / plain ONNX) to ours and to ours_en16k4, and one correctness check before
timing: each model's relative L2 against the float64 numpy layer
(ort_ops.testing.moe_layer.moe_layer_float) on T <= 16.
Memory ceiling per row: "MB" is the INT8 expert weights the routing touches (every path must
read at least these bytes once: QMoE's 8-bit weights are the same size), "GB/s" ours over them,
and "floor" the time to read them at this machine's streaming-read rate with the same thread
count (numpy reductions over a buffer as large as all the layer's weights, measured before each
expert config), so "best / floor" is the largest speedup over the best stock path any kernel
could reach here.
Models over 2 GB keep their weights as external data in a temporary directory. All of a config's
sessions are alive at once and are timed one token count at a time, so the paths of one row are
measured close together on this shared machine (still: run it quietly). Benchmarks never assert.

    python benchmarks/bench_moe.py [--experts 8x2,64x8] [--tokens 1,16,128,512] [--repeats 5]
                                   [--threads N] [--skip onnx_fp32,...] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN = 2048
INTER = 1408
PATHS = ["ours", "ours_en16k4", "ours_oai", "moe_fp32", "qmoe8_ch", "qmoe8_b128", "onnx_fp32"]
OURS = ("ours", "ours_en16k4", "ours_oai")  # the stock paths are the others


def with_oai_biases(w, q, rng):
    """(w, q) with gpt-oss-style biases added (the same arrays otherwise): gate_up [E, 2I] and
    down [E, H], N(0, 0.1)."""
    import dataclasses

    e, h, n2 = w.w_gate_up.shape
    bgu = (0.1 * rng.standard_normal((e, n2))).astype(np.float32)
    bd = (0.1 * rng.standard_normal((e, h))).astype(np.float32)
    return (dataclasses.replace(w, gate_up_bias=bgu, down_bias=bd),
            dataclasses.replace(q, gate_up_bias=bgu, down_bias=bd))


def _model(nodes, inits, h, e, opsets):
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h]),
                                         helper.make_tensor_value_info("router_logits", TensorProto.FLOAT, ["T", e])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", h])],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


def _interleave(w_gate_up, inter):
    """[E, H, 2I] (gate columns, then up) -> ORT's [E, 2I, H] with gate/up rows interleaved."""
    t = w_gate_up.transpose(0, 2, 1)
    out = np.empty_like(t)
    out[:, 0::2] = t[:, :inter]
    out[:, 1::2] = t[:, inter:]
    return np.ascontiguousarray(out)


def _q8(w, block):
    """Symmetric 8-bit [E, N, K] -> (uint8 codes + 128, float32 scales [E, N] or [E, N, K/block])."""
    e, n, k = w.shape
    wb = w.reshape(e, n, k // block, block) if block > 0 else w[..., None, :]
    sc = (np.abs(wb).max(-1) / 127.0).astype(np.float32)
    q = np.clip(np.rint(wb / np.where(sc > 0, sc, 1)[..., None]), -127, 127).reshape(e, n, k)
    return (q + 128).astype(np.uint8), (sc if block > 0 else sc[..., 0])


def stock_moe_model(w, k, op, block=0):
    from onnx import helper

    e, h, n2 = w.w_gate_up.shape
    fc1 = _interleave(w.w_gate_up, n2 // 2)
    fc2 = np.ascontiguousarray(w.w_down.transpose(0, 2, 1))
    attrs = {"k": k, "normalize_routing_weights": 1, "activation_type": "swiglu", "swiglu_fusion": 1,
                 "activation_alpha": 1.0, "activation_beta": 0.0, "swiglu_limit": 3.0e38}
    if op == "MoE":
        inits, ins = {"fc1": fc1, "fc2": fc2}, ["x", "router_logits", "fc1", "", "fc2"]
    else:
        q1, s1 = _q8(fc1, block)
        q2, s2 = _q8(fc2, block)
        inits, ins = {"fc1": q1, "s1": s1, "fc2": q2, "s2": s2}, ["x", "router_logits", "fc1", "s1", "", "fc2", "s2"]
        attrs["expert_weight_bits"] = 8
        if block > 0:
            attrs["block_size"] = block
    node = helper.make_node(op, ins, ["out"], domain="com.microsoft", **attrs)
    return _model([node], inits, h, e, [("", 20), ("com.microsoft", 1)])


def plain_onnx_model(w, k):
    """The layer as exporters write it: per expert, the tokens routed to it are gathered, run
    through MatMul -> Split -> Sigmoid/Mul/Mul -> MatMul, weighted and scatter-added back."""
    from onnx import TensorProto, helper

    e, h, n2 = w.w_gate_up.shape
    i = n2 // 2
    inits = {"k": np.array([k], np.int64), "ax1": np.array([1], np.int64), "ax0": np.array([0], np.int64),
             "zero": np.zeros((), np.float32), "split": np.array([i, i], np.int64)}
    nodes = [helper.make_node("Softmax", ["router_logits"], ["probs"], axis=-1),
             helper.make_node("TopK", ["probs", "k"], ["tv", "ti"], axis=-1),
             helper.make_node("ReduceSum", ["tv", "ax1"], ["ts"], keepdims=1),
             helper.make_node("Div", ["tv", "ts"], ["tw"]),
             helper.make_node("Mul", ["x", "zero"], ["acc0"])]
    for ex in range(e):
        p = f"e{ex}_"
        inits[p + "id"] = np.array(ex, np.int64)
        inits[p + "gu"] = np.ascontiguousarray(w.w_gate_up[ex])
        inits[p + "d"] = np.ascontiguousarray(w.w_down[ex])
        nodes += [
            helper.make_node("Equal", ["ti", p + "id"], [p + "m"]),
            helper.make_node("Cast", [p + "m"], [p + "mf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["tw", p + "mf"], [p + "wm"]),
            helper.make_node("ReduceSum", [p + "wm", "ax1"], [p + "w"], keepdims=0),
            helper.make_node("ReduceMax", [p + "mf", "ax1"], [p + "sel"], keepdims=0),
            helper.make_node("Greater", [p + "sel", "zero"], [p + "b"]),
            helper.make_node("NonZero", [p + "b"], [p + "nz"]),
            helper.make_node("Squeeze", [p + "nz", "ax0"], [p + "idx"]),
            helper.make_node("Gather", ["x", p + "idx"], [p + "x"], axis=0),
            helper.make_node("MatMul", [p + "x", p + "gu"], [p + "c"]),
            helper.make_node("Split", [p + "c", "split"], [p + "g", p + "u"], axis=1),
            helper.make_node("Sigmoid", [p + "g"], [p + "sg"]),
            helper.make_node("Mul", [p + "g", p + "sg"], [p + "silu"]),
            helper.make_node("Mul", [p + "silu", p + "u"], [p + "hh"]),
            helper.make_node("MatMul", [p + "hh", p + "d"], [p + "y"]),
            helper.make_node("Gather", [p + "w", p + "idx"], [p + "wi"], axis=0),
            helper.make_node("Unsqueeze", [p + "wi", "ax1"], [p + "wc"]),
            helper.make_node("Mul", [p + "y", p + "wc"], [p + "yw"]),
            helper.make_node("Unsqueeze", [p + "idx", "ax1"], [p + "ix"]),
            helper.make_node("ScatterND", [f"acc{ex}", p + "ix", p + "yw"],
                             ["out" if ex == e - 1 else f"acc{ex + 1}"], reduction="add"),
        ]
    return _model(nodes, inits, h, e, [("", 20)])


def build(name, w, q, k, q_oai=None):
    """(model, uses our custom ops) for one path of the table (q_oai: q with biases, ours_oai)."""
    from ort_ops.testing import moe_layer as ml

    if name == "ours":
        return ml.build_moe_int8_model(q, k), True
    if name == "ours_oai":
        return ml.build_moe_int8_model(q_oai, k, activation="swiglu_oai"), True
    if name == "ours_en16k4":
        from onnx import helper, numpy_helper

        from ort_ops.ops._moe import EN16K4, pack_en16k4

        model = ml.build_moe_int8_model(q, k)
        packed = {"w_gate_up": q.gate_up, "w_down": q.down}  # both GEMMs' weights as AMX B tiles
        for i, init in enumerate(model.graph.initializer):
            if init.name in packed:
                model.graph.initializer[i].CopyFrom(numpy_helper.from_array(pack_en16k4(packed[init.name]), init.name))
        for node in model.graph.node:
            if node.op_type in ("GroupedMatmulSwigluQuant", "GroupedMatmulDequant") and node.input[1] in packed:
                node.attribute.append(helper.make_attribute("weight_layout", EN16K4))
        return model, True
    if name == "moe_fp32":
        return stock_moe_model(w, k, "MoE"), False
    if name == "qmoe8_ch":
        return stock_moe_model(w, k, "QMoE"), False
    if name == "qmoe8_b128":
        return stock_moe_model(w, k, "QMoE", block=128), False
    return plain_onnx_model(w, k), False


def session(model, threads, tmpdir, custom_ops, spin=True):
    import onnx
    import onnxruntime as ort

    from ort_ops._lib import session_options

    so = session_options(intra_op_threads=threads) if custom_ops else ort.SessionOptions()
    if not custom_ops:
        so.intra_op_num_threads = threads
    if not spin:  # every path alike
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    size = sum(t.ByteSize() for t in model.graph.initializer)
    if size < (1 << 31) - (1 << 24):
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    path = os.path.join(tmpdir, f"model_{time.monotonic_ns()}.onnx")
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=os.path.basename(path) + ".data")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def read_ceiling(nbytes, threads, repeats=9):
    """Streaming-read rate (GB/s) of `threads` threads each taking the max of a slice of an nbytes
    buffer, the best of `repeats` (numpy's SIMD uint8 max releases the GIL and keeps up with
    memory; large numpy buffers get 2 MB pages, like our weights). A buffer of the weights' size
    stays in the last-level cache between runs exactly when the weights can."""
    from concurrent.futures import ThreadPoolExecutor

    buf = np.ones(nbytes, np.uint8)
    parts = np.array_split(buf, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.max, parts))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.max, parts))
            ts.append(time.perf_counter() - t0)
    return buf.nbytes / min(ts) / 1e9


def expert_bytes(q, ids):
    """INT8 weights (and their float32 scales) of the distinct experts in ids."""
    e = np.unique(ids)
    return sum(int(a[e].nbytes) for a in (q.gate_up, q.gate_up_scale, q.down, q.down_scale))


def time_runs(sessions, feeds, repeats):
    """{name: (median ms, p90 ms)}: each session in turn, a warm-up run then `repeats` timed
    runs, one token count at a time, so the paths of a row are timed minutes apart at most.
    (Not run by run: ORT's pool threads spin a while after a Run, and another session's spinning
    threads would take the cores from the one being timed.)"""
    res = {}
    for name, sess in sessions.items():
        sess.run(None, feeds)  # warm-up (first-run allocations, pre-packing; the last session's spin ends)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            ts.append((time.perf_counter() - t0) * 1e3)
        res[name] = (float(np.median(ts)), float(np.percentile(ts, 90)))
    return res


def error_budget(configs, tokens=(16, 512), seeds=(0, 1, 2, 3, 4)):
    """Prints where the INT8 layer's error against the float64 layer comes from (no timing).

    For each config, on the benchmark's own data (seed 0; x drawn as for the default --tokens, so
    the 16-token row is the table's error column) at each of ``tokens``: the chain through the
    references ("ours": the kernels equal it bit for bit), the plain W8A8 model of the same integer
    math in float64 (``moe_layer_w8a8``, every step on), that model with each INT8 rounding alone
    and with all but that one, and the weights alone (QMoE's kind of error). Then the chain's and
    the W8A8 model's error at 16 tokens over ``seeds`` (fresh weights and data) for the spread."""
    from ort_ops.testing import moe_layer as ml

    steps = ml.QUANT_STEPS
    for cfg in configs:
        e, k = (int(v) for v in cfg.split("x"))
        rng = np.random.default_rng(0)
        w = ml.random_moe_weights(rng, HIDDEN, INTER, e)
        q = ml.quantize_moe_weights(w)
        xs = {t: rng.standard_normal((t, HIDDEN)).astype(np.float32) for t in (1, 16, 128, 512)}
        print(f"\nE={e} top-{k}: relative L2 (%) against the float64 layer, same routing")
        head = ["ours", "w8a8"] + [f"{a} only" for a in steps] + [f"no {a}" for a in steps] + ["weights only"]
        print(f"{'tokens':>6} " + " ".join(f"{h:>12}" for h in head))
        for t in tokens:
            x = xs[t] if t in xs else rng.standard_normal((t, HIDDEN)).astype(np.float32)
            routing = ml.route(x, w.router, k)
            want = ml.moe_layer_float(x, w, k, routing=routing)
            vals = [ml.relative_l2(ml.moe_layer_int8_reference(x, q, *routing), want)]
            for quant in [steps] + [(a,) for a in steps] + [tuple(b for b in steps if b != a) for a in steps] + [
                    ("gate_up", "down")]:
                vals.append(ml.relative_l2(ml.moe_layer_w8a8(x, w, routing, quant), want))
            print(f"{t:>6} " + " ".join(f"{v * 100:12.3f}" for v in vals))
        del w, q
        gc.collect()
        spread = []
        for seed in seeds:
            rng = np.random.default_rng(seed)
            w = ml.random_moe_weights(rng, HIDDEN, INTER, e)
            x = rng.standard_normal((16, HIDDEN)).astype(np.float32)
            routing = ml.route(x, w.router, k)
            want = ml.moe_layer_float(x, w, k, routing=routing)
            ours = ml.relative_l2(ml.moe_layer_int8_reference(x, ml.quantize_moe_weights(w), *routing), want)
            spread.append((ours, ml.relative_l2(ml.moe_layer_w8a8(x, w, routing), want)))
            del w
            gc.collect()
        print(f"16 tokens, seeds {list(seeds)} (fresh weights and x): ours "
              + " ".join(f"{a * 100:.3f}" for a, _ in spread) + "; w8a8 " + " ".join(f"{b * 100:.3f}" for _, b in spread))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="8x2,64x8", help="comma list of EXPERTSxTOPK")
    ap.add_argument("--tokens", default="1,16,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip", default="", help=f"comma list of paths to leave out, from {PATHS}")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--spin", choices=("on", "off"), default="on",
                    help="ORT's intra-op thread spinning for every session (default on, ORT's default). With all "
                         "of a config's sessions alive, spinning on gave every ~10th Run of the timed session "
                         "~5 ms extra (E=8, 16 tokens: p90 8 ms vs 3 ms alone or with spinning off, RESULTS_cpu.md)")
    ap.add_argument("--error-budget", action="store_true",
                    help="print where the INT8 layer's error comes from (each INT8 rounding on / off in a float64 "
                         "W8A8 model, ort_ops.testing.moe_layer.moe_layer_w8a8) for --experts, then exit; no timing")
    args = ap.parse_args(argv)
    if args.error_budget:
        error_budget(args.experts.split(","))
        return

    from ort_ops.testing import moe_layer as ml

    skip = set(filter(None, args.skip.split(",")))
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    print(f"CPU MoE layer, hidden {HIDDEN}, intermediate {INTER}, {args.threads} threads, "
          f"{args.repeats} repeats; ms (median / p90); err = rel. L2 vs float64 layer")
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmpdir:
        for cfg in args.experts.split(","):
            e, k = (int(v) for v in cfg.split("x"))
            rng = np.random.default_rng(0)
            w = ml.random_moe_weights(rng, HIDDEN, INTER, e)
            q = ml.quantize_moe_weights(w)
            w_oai, q_oai = with_oai_biases(w, q, np.random.default_rng(1))
            xs = {t: rng.standard_normal((t, HIDDEN)).astype(np.float32) for t in tokens}
            feeds = {t: {"x": x, "router_logits": (x @ w.router).astype(np.float32)} for t, x in xs.items()}
            touched = {t: expert_bytes(q, ml.route(xs[t], w.router, k)[0]) for t in tokens}
            ceiling = read_ceiling(sum(a.nbytes for a in (q.gate_up, q.down)), args.threads)
            check_t = min(tokens, key=lambda t: abs(t - 16))
            want = ml.moe_layer_float(xs[check_t], w, k)
            want_oai = ml.moe_layer_float(xs[check_t], w_oai, k, activation="swiglu_oai")
            res = {}
            sessions, errs = {}, {}
            for name in PATHS:
                if name in skip:
                    continue
                try:
                    model, custom = build(name, w, q, k, q_oai)
                    sess = session(model, args.threads, tmpdir, custom, spin=args.spin == "on")
                    del model
                    errs[name] = ml.relative_l2(sess.run(None, feeds[check_t])[0],
                                                want_oai if name == "ours_oai" else want)
                    sessions[name] = sess
                except Exception as ex:  # noqa: BLE001 - a path this ORT build does not run: report, go on
                    print(f"  {name} E{e} top-{k}: not run ({str(ex).splitlines()[0][:160]})")
                gc.collect()
            for t in tokens:
                for name, (med, p90) in time_runs(sessions, feeds[t], args.repeats).items():
                    res[(name, t)] = (med, p90, errs[name])
            del sessions
            gc.collect()
            print(f"\nE={e} top-{k}; streaming read with {args.threads} threads: {ceiling:.1f} GB/s")
            print(f"{'tokens':>6} " + " ".join(f"{n:>19}" for n in PATHS if n not in skip)
                  + "   best stock / ours  / ours_en16k4  oai / ours      MB  GB/s floor ms  best / floor")
            for t in tokens:
                line = f"{t:>6} "
                for n in PATHS:
                    if n in skip:
                        continue
                    r = res.get((n, t))
                    line += f"{r[0]:8.2f}/{r[1]:6.2f} {r[2]*100:3.1f}%" if r else f"{'-':>19}"
                    line += " "
                stock = [res[(n, t)][0] for n in PATHS if n not in OURS and (n, t) in res]
                ratio = min(stock) / res[("ours", t)][0] if stock and ("ours", t) in res else float("nan")
                ratio4 = (min(stock) / res[("ours_en16k4", t)][0] if stock and ("ours_en16k4", t) in res
                          else float("nan"))
                oai = (res[("ours_oai", t)][0] / res[("ours", t)][0] if ("ours_oai", t) in res and ("ours", t) in res
                       else float("nan"))
                mb = touched[t] / 1e6
                floor = mb / ceiling  # ms
                gbs = mb / res[("ours", t)][0] if ("ours", t) in res else float("nan")
                best_floor = min(stock) / floor if stock else float("nan")
                print(line + f"  {ratio:6.2f}x  {ratio4:6.2f}x  {oai:9.2f}x  {mb:12.1f} {gbs:5.1f} {floor:8.2f} {best_floor:10.2f}x")
                for n in PATHS:
                    if (n, t) in res:
                        med, p90, err = res[(n, t)]
                        rows.append({"experts": e, "top_k": k, "tokens": t, "path": n, "median_ms": round(med, 3),
                                         "p90_ms": round(p90, 3), "rel_l2": round(err, 5),
                                         "best_stock_over_ours": (round(ratio, 3) if n == "ours" else
                                                                  round(ratio4, 3) if n == "ours_en16k4" else ""),
                                         "oai_over_ours": round(oai, 3) if n == "ours_oai" else "",
                                         "weights_mb": round(mb, 1), "read_gbps": round(ceiling, 2),
                                         "floor_ms": round(floor, 3)})
            del w, q, w_oai, q_oai
            gc.collect()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
