# SPDX-License-Identifier: MIT
"""INT8 paged decode attention on the CPU: ort-ops against ONNX Runtime's GroupQueryAttention.

Decode step (one new token per sequence), batch B in --batch, 32 query / 8 kv heads, head_dim
128, context L in --context (the new token included). Every path runs on ORT's CPU EP with the
same intra-op thread count, caches bound in place through IOBinding (no cache copy per step):

  ours-s8 / ours-u8 / ours-none
      one session: QuantizeKVCache (the new token into the paged INT8 cache, outputs bound to
      the cache buffers) then PagedAttentionInt8 (qk s8; pv s8 / u8 / none), block size 16,
      scattered blocks.
  gqa-fp32   com.microsoft.GroupQueryAttention, float32 BNSH cache of max length L shared by
             past_key and present_key (appended in place).
  gqa-int8   the same with its INT8 cache (k_quant_type = v_quant_type = PER_TENSOR,
             kv_cache_bit_width 8): INT8 storage, dequantized and computed in float32.

Reported: median and p90 ms over --repeats steps after warm-up, the cache bytes a step must read
and the GB/s that implies, and each GQA median over ours-s8 (speedup). One correctness check per
shape before timing: every path's max abs and relative L2 error against float64 attention on the
unquantized K/V (ort_ops.reference.exact_attention). Also QuantizeKVCache alone, in place and
copying, with a 4k and a 64k-slot cache: the in-place step must not grow with the cache.

The machine is shared and noisy: run it on a quiet one for numbers that mean something.
Benchmarks never assert.

    python benchmarks/bench_attention.py [--batch 1 8] [--context 4096 8192 16384]
        [--repeats 20] [--threads N] [--block-size 16] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HQ, HKV, D = 32, 8, 128


def _session(model, threads, custom=True):
    import onnxruntime as ort

    from ort_ops import session_options

    so = ort.SessionOptions()
    if custom:
        so = session_options(so)
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time(run, repeats, warmup=3):
    for _ in range(warmup):
        run()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.median(ts)), float(np.percentile(ts, 90))


# --- data: B sequences of L tokens; the last token of each is the one this step adds ---

def _data(rng, b, length):
    k = rng.standard_normal((b, length, HKV, D)).astype(np.float32)
    v = rng.standard_normal((b, length, HKV, D)).astype(np.float32)
    q = rng.standard_normal((b, HQ, D)).astype(np.float32)
    return q, k, v


def _exact(q, k, v):
    from ort_ops import reference

    b, length = k.shape[:2]
    cu = np.arange(b + 1) * length
    return reference.exact_attention(q, k.reshape(b * length, HKV, D), v.reshape(b * length, HKV, D), cu)


# --- ours: QuantizeKVCache (in place) + PagedAttentionInt8 in one session ---

def _ours_model(pv):
    from onnx import TensorProto, helper

    from ort_ops._domain import DOMAIN, OPSET_VERSION
    from ort_ops.ops import paged_attention_int8, quantize_kv_cache
    from ort_ops.ops._schema import IR_VERSION, ONNX_OPSET

    f, i8, i32 = TensorProto.FLOAT, TensorProto.INT8, TensorProto.INT32
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in (
        ("key", f), ("value", f), ("slot_mapping", TensorProto.INT64), ("key_cache", i8),
        ("value_cache", i8), ("key_scale", f), ("value_scale", f), ("query", f),
        ("block_tables", i32), ("seq_lens", i32))]
    caches = ["key_cache_out", "value_cache_out", "key_scale_out", "value_scale_out"]
    nodes = [quantize_kv_cache.SCHEMA.make_node(
                 ["key", "value", "slot_mapping", "key_cache", "value_cache", "key_scale", "value_scale"], caches),
             paged_attention_int8.SCHEMA.make_node(["query", *caches, "block_tables", "seq_lens"], ["output"],
                                                   pv_quant=pv)]
    outputs = [helper.make_tensor_value_info(n, t, None) for n, t in (
        ("output", f), ("key_cache_out", i8), ("value_cache_out", i8), ("key_scale_out", f), ("value_scale_out", f))]
    graph = helper.make_graph(nodes, "decode_step", inputs, outputs)
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)])


def _ours(rng, q, k, v, pv, threads, block_size):
    """A step runner and its output; the cache holds L-1 tokens, the step adds the L-th."""
    import onnxruntime as ort

    from ort_ops.ops.paged_attention_int8 import build_paged_cache

    b, length = k.shape[:2]
    cu = np.arange(b + 1) * length
    cache = build_paged_cache(k.reshape(b * length, HKV, D), v.reshape(b * length, HKV, D), cu, block_size, rng)
    tables = cache["block_tables"]
    pos = length - 1
    slots = (tables[:, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    sess = _session(_ours_model(pv), threads)
    io = sess.io_binding()
    feeds = {"key": np.ascontiguousarray(k[:, -1]), "value": np.ascontiguousarray(v[:, -1]), "slot_mapping": slots,
             "query": q, "block_tables": tables, "seq_lens": np.full(b, length, np.int32)}
    for name, val in feeds.items():
        io.bind_cpu_input(name, val)
    io.bind_output("output")  # first: copy_outputs_to_cpu()[0]
    for name in ("key_cache", "value_cache", "key_scale", "value_scale"):
        ov = ort.OrtValue.ortvalue_from_numpy(cache[name])
        io.bind_ortvalue_input(name, ov)
        io.bind_ortvalue_output(name + "_out", ov)  # in place: only the new slot is written

    def run():
        sess.run_with_iobinding(io)

    run()
    out = io.copy_outputs_to_cpu()[0]
    return run, out


# --- ORT GroupQueryAttention, cache shared by past and present (in place) ---

def _gqa_model(int8):
    from onnx import TensorProto, helper

    from ort_ops.ops._schema import IR_VERSION, ONNX_OPSET

    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    ct = TensorProto.INT8 if int8 else f
    inputs = [helper.make_tensor_value_info("query", f, None), helper.make_tensor_value_info("key", f, None),
              helper.make_tensor_value_info("value", f, None), helper.make_tensor_value_info("past_key", ct, None),
              helper.make_tensor_value_info("past_value", ct, None),
              helper.make_tensor_value_info("seqlens_k", i32, None),
              helper.make_tensor_value_info("total_sequence_length", i32, [])]
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    attrs = {"num_heads": HQ, "kv_num_heads": HKV}
    if int8:
        inputs += [helper.make_tensor_value_info("k_scale", f, None), helper.make_tensor_value_info("v_scale", f, None)]
        names += ["", "", "", "", "", "k_scale", "v_scale"]
        attrs.update(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8)
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", **attrs)
    outputs = [helper.make_tensor_value_info("output", f, None), helper.make_tensor_value_info("present_key", ct, None),
               helper.make_tensor_value_info("present_value", ct, None)]
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    return helper.make_model(graph, ir_version=IR_VERSION, opset_imports=[
        helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid("com.microsoft", 1)])


def _gqa(q, k, v, int8, threads):
    import onnxruntime as ort

    b, length = k.shape[:2]
    past_k = np.zeros((b, HKV, length, D), np.float32)  # max_sequence_length = L
    past_v = np.zeros_like(past_k)
    past_k[:, :, : length - 1] = k[:, : length - 1].transpose(0, 2, 1, 3)
    past_v[:, :, : length - 1] = v[:, : length - 1].transpose(0, 2, 1, 3)
    feeds = {"query": q.reshape(b, 1, HQ * D), "key": k[:, -1].reshape(b, 1, HKV * D),
             "value": v[:, -1].reshape(b, 1, HKV * D), "seqlens_k": np.full(b, length - 1, np.int32),
             "total_sequence_length": np.array(length, np.int32)}
    if int8:
        # Per-tensor scales over the whole K (V) history, as a calibrated model would carry.
        ks, vs = np.float32(np.abs(k).max() / 127), np.float32(np.abs(v).max() / 127)
        past_k = np.clip(np.rint(past_k / ks), -127, 127).astype(np.int8)
        past_v = np.clip(np.rint(past_v / vs), -127, 127).astype(np.int8)
        feeds.update(k_scale=np.array([ks], np.float32), v_scale=np.array([vs], np.float32))
    sess = _session(_gqa_model(int8), threads, custom=False)
    io = sess.io_binding()
    for name, val in feeds.items():
        io.bind_cpu_input(name, val)
    io.bind_output("output")  # first: copy_outputs_to_cpu()[0]
    for name, cache in (("key", past_k), ("value", past_v)):
        ov = ort.OrtValue.ortvalue_from_numpy(cache)
        io.bind_ortvalue_input("past_" + name, ov)
        io.bind_ortvalue_output("present_" + name, ov)

    def run():
        sess.run_with_iobinding(io)

    run()
    out = io.copy_outputs_to_cpu()[0].reshape(b, HQ, D)
    return run, out


def _quantize_step(rng, slots_total, b, threads, in_place):
    """QuantizeKVCache alone: b new tokens into a cache of slots_total slots."""
    import onnxruntime as ort

    from ort_ops.ops import quantize_kv_cache
    from ort_ops.ops._run import make_session

    bs = 16
    n = slots_total // bs
    ins = {"key": rng.standard_normal((b, HKV, D)).astype(np.float32),
           "value": rng.standard_normal((b, HKV, D)).astype(np.float32),
           "slot_mapping": rng.choice(slots_total, b, replace=False).astype(np.int64),
           "key_cache": np.zeros((n, HKV, bs, D), np.int8), "value_cache": np.zeros((n, HKV, D, bs), np.int8),
           "key_scale": np.zeros((n, HKV, bs), np.float32), "value_scale": np.zeros((n, HKV, bs), np.float32)}
    sess = make_session(quantize_kv_cache.SCHEMA, ins, intra_op_threads=threads)
    io = sess.io_binding()
    for name in ("key", "value", "slot_mapping"):
        io.bind_cpu_input(name, ins[name])
    for name in ("key_cache", "value_cache", "key_scale", "value_scale"):
        ov = ort.OrtValue.ortvalue_from_numpy(ins[name])
        io.bind_ortvalue_input(name, ov)
        if in_place:
            io.bind_ortvalue_output(name + "_out", ov)
        else:
            io.bind_output(name + "_out")
    return lambda: sess.run_with_iobinding(io)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    args = ap.parse_args(argv)

    import ort_ops

    print(f"ort-ops {ort_ops.__version__}, library {ort_ops.get_library_path()}, CPU kernels "
          f"{ort_ops._lib.selected_cpu_isa()}, {args.threads} threads, block size {args.block_size}")
    rng = np.random.default_rng(0)
    rows = []
    header = f"{'batch':>5} {'context':>7} {'path':<10} {'median ms':>9} {'p90 ms':>8} {'MB read':>8} {'GB/s':>6} " \
             f"{'max abs err':>11} {'rel L2 err':>10} {'vs ours-s8':>10}"
    print(header)
    for b in args.batch:
        for length in args.context:
            q, k, v = _data(rng, b, length)
            exact = _exact(q, k, v)
            int8_bytes = b * length * HKV * (2 * D + 8)   # codes + per-token float scales
            paths = {}
            for pv in ("s8", "u8", "none"):
                paths[f"ours-{pv}"] = (*_ours(rng, q, k, v, pv, args.threads, args.block_size), int8_bytes)
            paths["gqa-fp32"] = (*_gqa(q, k, v, False, args.threads), b * length * HKV * 2 * D * 4)
            paths["gqa-int8"] = (*_gqa(q, k, v, True, args.threads), b * length * HKV * 2 * D)
            base = None
            for name, (run, out, nbytes) in paths.items():
                err = out.astype(np.float64) - exact
                max_abs = float(np.abs(err).max())
                rel = float(np.linalg.norm(err) / np.linalg.norm(exact))
                med, p90 = _time(run, args.repeats)
                base = med if name == "ours-s8" else base
                ratio = med / base
                row = {"batch": b, "context": length, "path": name, "median_ms": med, "p90_ms": p90,
                       "mb_read": nbytes / 1e6, "gb_s": nbytes / med / 1e6, "max_abs_err": max_abs,
                       "rel_l2_err": rel, "median_over_ours_s8": ratio}
                rows.append(row)
                print(f"{b:>5} {length:>7} {name:<10} {med:>9.2f} {p90:>8.2f} {nbytes / 1e6:>8.1f} "
                      f"{nbytes / med / 1e6:>6.1f} {max_abs:>11.2e} {rel:>10.2e} {ratio:>9.2f}x")
            del paths
    print("\nQuantizeKVCache step (new tokens of every kv head into the paged cache):")
    for slots_total in (4096, 65536):
        for b in args.batch:
            for in_place in (True, False):
                med, p90 = _time(_quantize_step(rng, slots_total, b, args.threads, in_place), args.repeats)
                name = "in-place" if in_place else "copy"
                rows.append({"batch": b, "context": slots_total, "path": f"quantize-kv-{name}", "median_ms": med,
                             "p90_ms": p90})
                print(f"  cache {slots_total:>6} slots, {b} tokens, {name:<8}: median {med * 1e3:9.1f} us, "
                      f"p90 {p90 * 1e3:9.1f} us")
    if args.csv:
        keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
