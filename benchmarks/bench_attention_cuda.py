# SPDX-License-Identifier: MIT
"""PagedAttentionInt8 on the GPU against its peers (decode and prefill with history).

Decode: batch 1 and 32, 32 query / 8 kv heads, head_dim 128, context 4k / 8k / 16k.
    ours (pv s8 / u8 / none: none is the float P.V twin of the same kernel) on a scattered
    paged INT8 cache, against torch SDPA bf16 (cuDNN backend, enable_gqa=True) on contiguous
    bf16 K/V. GPU time by CUDA events around each call, L2 flushed before each call (--flush:
    reading 256 MB, the default, or writing it; a write leaves ~50 MB of dirty lines whose
    write-back then competes with the timed call's reads, which costs a small call several us),
    median and p90 of --iters calls. The GPU-timed launches of a case (ours in each mode, cuDNN,
    FlashInfer) are timed interleaved, each behind a GPU hold that hides the host's launch cost
    (benchmarks/gpu_timing.py: cold instruction caches, as between a model's layers); eager
    launches, or CUDA-graph replays with --graph. Achieved bandwidth counts the bytes that must be
    read: INT8 K and V plus the two per-token float32 scales (ours), bf16 K and V (SDPA),
    against the measured copy ceiling 4.28 TB/s (../shared/GPU.md).
Prefill with history: 512 new queries on 4k / 8k / 16k of history, batch 1 (INT8 P.V vs its
    float twin: where the matrix units, not memory, bound the kernel), on the 64-row prefill
    kernel (rows ours-*) and on the general kernel (rows general-*, ORT_OPS_PA_PREFILL=general)
    in the same process, interleaved (--prefill-kernels; --rounds x --iters calls each); TOP/s counts 4 ops per
    (row, visible key, d) (Q.K and P.V multiply-adds).
Peers in the same decode run, each optional (skipped with a printed reason where its package or
    the CUDA EP is missing):
    - FlashInfer BatchDecodeWithPagedKVCacheWrapper (tensor cores, NHD pages of --block tokens,
      scattered pages), bf16 query on a bf16 cache and on an fp8 e4m3 cache (GPU time, as above);
    - ORT's own com.microsoft GroupQueryAttention on the CUDA EP (onnxruntime-gpu) with its INT8
      KV cache (k/v_quant_type PER_TENSOR, kv_cache_bit_width 8, one fp32 scale shared by K and V,
      as its XQA decode path needs), fp16 query, past and present sharing one BNSH buffer of
      `context` tokens, one new token appended per call;
    - ours as an ORT session too (PagedAttentionInt8 from the library on the CUDA EP, --ort-pv),
      so that the two ORT rows compare session against session: both are wall time of
      `run_with_iobinding` on device-bound inputs and outputs (L2 flushed before each call), which
      includes ORT's per-Run overhead (about 45 us, ../shared/GPU.md);
    - ORT's own per-Run cost (`ort-noop`): a one-node session on the CUDA EP that adds two fp16
      scalars bound to device memory, timed like the two sessions above (once per run, batch and
      context 0), so that session minus kernel can be split into ORT's part and the op's glue.
One correctness check per configuration before timing: ours against float32 attention on the
dequantized cache (torch), relative L2 error; ORT GQA against float32 attention on its own
dequantized cache after the call (first sequence).

Usage: python benchmarks/bench_attention_cuda.py [--batch 1 32] [--context 4096 8192 16384]
       [--csv PATH] [--splits 0 8 16] [--no-prefill] [--peers flashinfer ort-gqa ours-ort]
       [--warmup-peers]   (only JIT-compile FlashInfer's modules, small shapes, then exit)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import capture, evict_l2, flush_buffer, time_interleaved, warm_up
from ort_ops.testing import attention_launchers as _cuda

COPY_CEILING_TBS = 4.28
READ_CEILING_TBS = 4.35


FLUSH_MODE = "read"  # --flush


def time_wall(fn, iters: int, flush) -> list[float]:
    """Microseconds of wall time per call (host call to device idle), L2 flushed before each."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        evict_l2(flush, FLUSH_MODE)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def peer_reasons(peers) -> dict[str, str]:
    """Why each requested peer cannot run here ('' when it can)."""
    why = {}
    if "flashinfer" in peers:
        try:
            import flashinfer  # noqa: F401

            why["flashinfer"] = ""
        except Exception as e:  # noqa: BLE001
            why["flashinfer"] = f"flashinfer not importable ({type(e).__name__}: {e})"
    if "ort-gqa" in peers or "ours-ort" in peers or "ort-noop" in peers:
        try:
            import onnxruntime as ort

            eps = ort.get_available_providers()
            r = "" if "CUDAExecutionProvider" in eps else (
                f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (onnxruntime-gpu not installed)")
        except Exception as e:  # noqa: BLE001
            r = f"onnxruntime not importable ({type(e).__name__}: {e})"
        for p in ("ort-gqa", "ours-ort", "ort-noop"):
            if p in peers:
                why[p] = r
    return why


def _row(impl, batch, ctx, t, nbytes, rel="", splits="", status=""):
    med = statistics.median(t)
    return {"mode": "decode", "impl": impl, "batch": batch, "context": ctx, "splits": splits, "median_us": med,
            "p90_us": sorted(t)[int(0.9 * len(t))], "tb_s": nbytes / med / 1e6,
            "frac_copy": nbytes / med / 1e6 / COPY_CEILING_TBS, "rel_l2_vs_dequant": rel, "status": status}


def _bind(io, name, t, cpu=False):
    import numpy as np

    dt = {torch.float16: np.float16, torch.float32: np.float32, torch.int8: np.int8, torch.int32: np.int32,
          torch.bfloat16: None}[t.dtype]
    if cpu:
        io.bind_cpu_input(name, t.cpu().numpy())
    else:
        io.bind_input(name, "cuda", 0, dt, list(t.shape), t.data_ptr())


def ours_ort_session(tensors, pv, iters, flush):
    """PagedAttentionInt8 as a one-node ORT session on the CUDA EP, inputs and output bound to the
    given device tensors; wall time of run_with_iobinding."""
    import numpy as np
    import onnxruntime as ort

    from ort_ops._lib import session_options
    from ort_ops.ops import paged_attention_int8 as pa_mod
    from ort_ops.ops._schema import single_op_model

    np_dt = {torch.float16: np.float16, torch.float32: np.float32, torch.int8: np.int8, torch.int32: np.int32}
    shapes = {k: np.broadcast_to(np.zeros((), np_dt[v.dtype]), tuple(v.shape)) for k, v in tensors.items()}
    model = single_op_model(pa_mod.SCHEMA, shapes, output_dtypes={"output": np.float16}, pv_quant=pv)
    sess = ort.InferenceSession(model.SerializeToString(), session_options(),
                                providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    q = tensors["query"]
    out = torch.empty_like(q)
    io = sess.io_binding()
    for k, v in tensors.items():
        _bind(io, k, v)
    io.bind_output("output", "cuda", 0, np.float16, list(out.shape), out.data_ptr())

    def run():
        sess.run_with_iobinding(io)

    run()
    torch.cuda.synchronize()
    return out, time_wall(run, iters, flush)


def ort_noop_session(iters, flush):
    """ORT's per-Run cost on the CUDA EP: one Add of two fp16 scalars, inputs and output bound to
    device tensors; wall time of run_with_iobinding (one tiny kernel and ORT's end-of-Run sync)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    vi = helper.make_tensor_value_info
    f16 = TensorProto.FLOAT16
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "noop",
                              [vi("a", f16, [1]), vi("b", f16, [1])], [vi("c", f16, [1])])
    model = helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), ort.SessionOptions(),
                                providers=["CUDAExecutionProvider"])
    a, b, c = (torch.ones(1, dtype=torch.float16, device="cuda") for _ in range(3))
    io = sess.io_binding()
    _bind(io, "a", a)
    _bind(io, "b", b)
    io.bind_output("c", "cuda", 0, np.float16, [1], c.data_ptr())

    def run():
        sess.run_with_iobinding(io)

    run()
    torch.cuda.synchronize()
    return time_wall(run, iters, flush)


def ort_gqa_int8(batch, ctx, hq, hkv, d, iters, flush, gen):
    """ORT's com.microsoft GroupQueryAttention, INT8 KV cache (per-tensor scale shared by K and V),
    decode of one new token onto `ctx - 1` cached ones, past and present sharing one buffer."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    f16, i8, i32, f32 = TensorProto.FLOAT16, TensorProto.INT8, TensorProto.INT32, TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    cache = [batch, hkv, ctx, d]
    inputs = [vi("query", f16, [batch, 1, hq * d]), vi("key", f16, [batch, 1, hkv * d]),
              vi("value", f16, [batch, 1, hkv * d]), vi("past_key", i8, cache), vi("past_value", i8, cache),
              vi("seqlens_k", i32, [batch]), vi("total_sequence_length", i32, [1]), vi("kv_scale", f32, [1])]
    outputs = [vi("output", f16, [batch, 1, hq * d]), vi("present_key", i8, cache), vi("present_value", i8, cache)]
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
         "", "", "", "", "", "kv_scale", "kv_scale"],
        ["output", "present_key", "present_value"], domain="com.microsoft",
        num_heads=hq, kv_num_heads=hkv, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8)
    model = helper.make_model(helper.make_graph([node], "gqa_int8", inputs, outputs), ir_version=9,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CUDAExecutionProvider"])
    scale_v = 0.02
    q = torch.randn((batch, 1, hq * d), device="cuda", generator=gen).half()
    k = torch.randn((batch, 1, hkv * d), device="cuda", generator=gen).half()
    v = torch.randn((batch, 1, hkv * d), device="cuda", generator=gen).half()
    pk = torch.randint(-127, 128, cache, dtype=torch.int8, device="cuda", generator=gen)
    pv = torch.randint(-127, 128, cache, dtype=torch.int8, device="cuda", generator=gen)
    seqlens = torch.full((batch,), ctx - 1, dtype=torch.int32, device="cuda")
    scale = torch.full((1,), scale_v, dtype=torch.float32, device="cuda")
    out = torch.empty((batch, 1, hq * d), dtype=torch.float16, device="cuda")
    io = sess.io_binding()
    for name, t in (("query", q), ("key", k), ("value", v), ("past_key", pk), ("past_value", pv),
                    ("seqlens_k", seqlens), ("kv_scale", scale)):
        _bind(io, name, t)
    io.bind_cpu_input("total_sequence_length", np.array([ctx], dtype=np.int32))
    io.bind_output("output", "cuda", 0, np.float16, list(out.shape), out.data_ptr())
    io.bind_output("present_key", "cuda", 0, np.int8, cache, pk.data_ptr())
    io.bind_output("present_value", "cuda", 0, np.int8, cache, pv.data_ptr())

    def run():
        sess.run_with_iobinding(io)

    run()
    torch.cuda.synchronize()
    # float32 attention over the first sequence's dequantized cache (the new token now appended).
    g = hq // hkv
    kk = (pk[0].float() * scale_v).repeat_interleave(g, dim=0)           # [Hq, ctx, D]
    vv = (pv[0].float() * scale_v).repeat_interleave(g, dim=0)
    qs = q[0, 0].float().view(hq, 1, d)
    ref = torch.softmax(qs @ kk.transpose(1, 2) / math.sqrt(d), dim=-1) @ vv  # [Hq, 1, D]
    rel = float((out[0, 0].float().view(hq, 1, d) - ref).norm() / ref.norm())
    t = time_wall(run, iters, flush)
    return t, rel


def flashinfer_decode(batch, ctx, hq, hkv, d, page, kv_dtype, gen, workspace):
    """FlashInfer paged decode (tensor cores), bf16 query, NHD pages of `page` tokens, scattered:
    returns its run(), planned in the wrapper's CUDA-graph mode (fixed index buffers) so that it
    can be captured like ours. Each wrapper needs its own workspace (the plan lives there)."""
    import flashinfer

    npg = -(-ctx // page)
    total = batch * npg
    n = total + 7
    indices = torch.randperm(n, device="cuda", generator=gen)[:total].to(torch.int32)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * npg
    last = torch.full((batch,), ctx - (npg - 1) * page, dtype=torch.int32, device="cuda")
    cache = torch.randn((n, 2, page, hkv, d), device="cuda", dtype=torch.bfloat16, generator=gen)
    if kv_dtype != torch.bfloat16:
        cache = cache.to(kv_dtype)
    q = torch.randn((batch, hq, d), device="cuda", dtype=torch.bfloat16, generator=gen)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr.clone(),
        paged_kv_indices_buffer=indices.clone(), paged_kv_last_page_len_buffer=last.clone())
    w.plan(indptr, indices, last, hq, hkv, d, page, pos_encoding_mode="NONE",
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype)

    def run():
        return w.run(q, cache)

    run()
    torch.cuda.synchronize()
    return run


def make_paged_cache(batch, context, hkv, d, block, gen):
    """Random INT8 codes and scales in a scattered paged cache (built on the GPU directly)."""
    nb_seq = -(-context // block)
    n = batch * nb_seq + 7
    kc = torch.randint(-127, 128, (n, hkv, block, d), dtype=torch.int8, device="cuda", generator=gen)
    vc = torch.randint(-127, 128, (n, hkv, d, block), dtype=torch.int8, device="cuda", generator=gen)
    ks = torch.rand((n, hkv, block), device="cuda", generator=gen) * 0.02 + 0.01
    vs = torch.rand((n, hkv, block), device="cuda", generator=gen) * 0.02 + 0.01
    perm = torch.randperm(n, device="cuda", generator=gen)[: batch * nb_seq]
    tables = perm.view(batch, nb_seq).to(torch.int32).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return kc, vc, ks, vs, tables, lens


def dequantized_attention(q, kc, vc, ks, vs, tables, lens, cu, scale, seqs, window=0):
    """float32 attention on the dequantized cache for the first `seqs` sequences (causal; with a
    window > 0 the query at p sees keys p - window < k <= p)."""
    outs = []
    hq = q.shape[1]
    hkv, block = kc.shape[1], kc.shape[2]
    g = hq // hkv
    for s in range(seqs):
        length = int(lens[s])
        pos = torch.arange(length, device="cuda")
        blk = tables[s, pos // block].long()
        off = pos % block
        k = kc[blk, :, off, :].float() * ks[blk, :, off][..., None]          # [L, Hkv, D]
        v = vc[blk, :, :, off].float() * vs[blk, :, off][..., None]          # [L, Hkv, D]
        q0, q1 = (s, s + 1) if cu is None else (int(cu[s]), int(cu[s + 1]))
        qs = q[q0:q1].float()                                               # [n, Hq, D]
        n = q1 - q0
        kk = k.repeat_interleave(g, dim=1).permute(1, 0, 2)                  # [Hq, L, D]
        vv = v.repeat_interleave(g, dim=1).permute(1, 0, 2)
        sc = torch.einsum("nhd,hld->hnl", qs, kk) * scale
        qpos = length - n + torch.arange(n, device="cuda")
        sc = sc.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        if window > 0:
            sc = sc.masked_fill(pos[None, None, :] <= qpos[None, :, None] - window, float("-inf"))
        outs.append(torch.einsum("hnl,hld->nhd", torch.softmax(sc, dim=-1), vv))
    return torch.cat(outs)


def launcher(args):
    """How a timed call is prepared: captured in a CUDA graph (--graph) or launched eagerly
    (after three untimed calls). Either way the timing holds the GPU until the call is
    enqueued (gpu_timing.time_interleaved), so the host's launch cost is not timed."""
    if args.graph:
        return lambda fn: capture(torch, fn)

    def eager(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return fn

    return eager


def bench_decode(args, writer, flush, gen):
    hq, hkv, d = args.hq, args.hkv, args.head_dim
    rows = []
    prepare = launcher(args)
    peers = set(args.peers)
    why = peer_reasons(peers)
    for p in sorted(peers):
        print(f"peer {p}: " + (f"skipped: {why[p]}" if why.get(p) else "runs"), file=sys.stderr, flush=True)
    workspace = ({impl: torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
                  for impl in ("flashinfer-bf16", "flashinfer-fp8")}
                 if "flashinfer" in peers and not why.get("flashinfer") else None)
    if "ort-noop" in peers and not why.get("ort-noop"):
        try:
            rows.append(_row("ort-noop-session", 0, 0, ort_noop_session(args.iters, flush), 0))
            writer(rows[-1])
        except Exception as e:  # noqa: BLE001
            print(f"ORT no-op session: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    for batch in args.batch:
        for ctx in args.context:
            kc, vc, ks, vs, tables, lens = make_paged_cache(batch, ctx, hkv, d, args.block, gen)
            q = (torch.randn((batch, hq, d), device="cuda", generator=gen) * 2).half()
            # Bytes the launch must read: the window's span of each context (all of it without one).
            span = min(ctx, args.window) if args.window > 0 else ctx
            kv_bytes = batch * span * hkv * (2 * d + 8)
            scale = 1.0 / math.sqrt(d)
            ref = dequantized_attention(q, kc, vc, ks, vs, tables, lens, None, scale, min(batch, 2), args.window)
            # GPU-timed launches of this case, captured, then timed interleaved: name -> row fields.
            replays, meta = {}, {}
            for pv in args.pv:
                for splits in args.splits:
                    for loop in args.decode_loops:
                        pa = _cuda.PagedAttention(q, kc, vc, ks, vs, tables, lens, pv_quant=pv,
                                                  partition_size=args.partition, num_splits=splits,
                                                  window=args.window)
                        switch = None if loop == "auto" else loop  # ORT_OPS_PA_DECODE
                        fn = _with_env("ORT_OPS_PA_DECODE", switch, pa)
                        out = fn()
                        st = pa.status()
                        rel = float((out[: ref.shape[0]].float() - ref).norm() / ref.norm())
                        impl = f"ours-{pv}" + (f"-{loop}" if len(args.decode_loops) > 1 else "")
                        name = impl + (f" splits={pa.nsplit}" if len(args.splits) > 1 else "")
                        with _env("ORT_OPS_PA_DECODE", switch):
                            replays[name] = prepare(fn)  # a graph keeps the loop it was captured with
                        meta[name] = {"impl": impl, "nbytes": kv_bytes, "rel": rel, "splits": pa.nsplit, "status": st}
            if "ours-ort" in peers and args.window == 0:  # its session has no window attribute
                for pv in args.ort_pv:
                    if why.get("ours-ort"):
                        break
                    try:
                        tensors = {"query": q, "key_cache": kc, "value_cache": vc, "key_scale": ks,
                                   "value_scale": vs, "block_tables": tables, "seq_lens": lens}
                        out, t = ours_ort_session(tensors, pv, args.iters, flush)
                        rel = float((out[: ref.shape[0]].float() - ref).norm() / ref.norm())
                        rows.append(_row(f"ours-{pv}-ort-session", batch, ctx, t, kv_bytes, rel))
                        writer(rows[-1])
                        # As a rewritten model runs it: cu_seqlens_q on every step (one row each).
                        tensors["cu_seqlens_q"] = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                        out, t = ours_ort_session(tensors, pv, args.iters, flush)
                        rel = float((out[: ref.shape[0]].float() - ref).norm() / ref.norm())
                        rows.append(_row(f"ours-{pv}-ort-session-cu", batch, ctx, t, kv_bytes, rel))
                        writer(rows[-1])
                    except Exception as e:  # noqa: BLE001
                        print(f"ours ORT session pv {pv} batch {batch} ctx {ctx}: {type(e).__name__}: {e}",
                              file=sys.stderr, flush=True)
            # torch SDPA bf16, cuDNN backend, native GQA, contiguous K/V.
            try:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                qb = torch.randn((batch, hq, 1, d), device="cuda", dtype=torch.bfloat16, generator=gen)
                kb = torch.randn((batch, hkv, ctx, d), device="cuda", dtype=torch.bfloat16, generator=gen)
                vb = torch.randn((batch, hkv, ctx, d), device="cuda", dtype=torch.bfloat16, generator=gen)

                def sdpa(qb=qb, kb=kb, vb=vb):
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)

                replays["sdpa-cudnn-bf16"] = prepare(sdpa)
                meta["sdpa-cudnn-bf16"] = {"impl": "sdpa-cudnn-bf16", "nbytes": batch * ctx * hkv * d * 2 * 2}
            except Exception as e:  # noqa: BLE001  (report and go on: a peer missing is not our failure)
                print(f"sdpa cudnn bf16 batch {batch} ctx {ctx}: {type(e).__name__}: {e}", file=sys.stderr)
            if "flashinfer" in peers and not why.get("flashinfer"):
                for kv_dtype, impl, elem in ((torch.bfloat16, "flashinfer-bf16", 2),
                                             (torch.float8_e4m3fn, "flashinfer-fp8", 1)):
                    try:
                        replays[impl] = prepare(flashinfer_decode(batch, ctx, hq, hkv, d, args.block,
                                                                         kv_dtype, gen, workspace[impl]))
                        meta[impl] = {"impl": impl, "nbytes": batch * ctx * hkv * d * 2 * elem}
                    except Exception as e:  # noqa: BLE001
                        print(f"{impl} batch {batch} ctx {ctx}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            for name, t in time_interleaved(torch, replays, args.iters, flush, FLUSH_MODE).items():
                m = meta[name]
                rows.append(_row(m["impl"], batch, ctx, t, m["nbytes"], m.get("rel", ""), m.get("splits", ""),
                                 m.get("status", "")))
                writer(rows[-1])
            del kc, vc, ks, vs, replays
            torch.cuda.empty_cache()
            if "ort-gqa" in peers and not why.get("ort-gqa"):
                try:
                    t, rel = ort_gqa_int8(batch, ctx, hq, hkv, d, args.iters, flush, gen)
                    rows.append(_row("ort-gqa-int8-session", batch, ctx, t, batch * ctx * hkv * d * 2, rel))
                    writer(rows[-1])
                except Exception as e:  # noqa: BLE001
                    print(f"ORT GQA int8 batch {batch} ctx {ctx}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                torch.cuda.empty_cache()
    return rows


def bench_prefill(args, writer, flush, gen):
    """Prefill with history: each pv mode on each kernel (--prefill-kernels: "prefill" = the
    64-row kernel of cuda_prefill.cu, "general" = the general kernel, forced by the environment
    variable ORT_OPS_PA_PREFILL=general, which the launcher reads at each launch), alternated over
    --rounds rounds in one process; each row's median is over all its rounds' calls."""
    hq, hkv, d = args.hq, args.hkv, args.head_dim
    rows = []
    prepare = launcher(args)
    new = args.prefill_new
    for hist in args.context:
        ctx = hist + new
        kc, vc, ks, vs, tables, lens = make_paged_cache(1, ctx, hkv, d, args.block, gen)
        q = (torch.randn((new, hq, d), device="cuda", generator=gen) * 2).half()
        cu = torch.tensor([0, new], dtype=torch.int32, device="cuda")
        ref = dequantized_attention(q, kc, vc, ks, vs, tables, lens, cu, 1.0 / math.sqrt(d), 1)
        runs, replays = {}, {}
        for kernel in args.prefill_kernels:
            for pv in args.pv:
                # The launcher reads ORT_OPS_PA_PREFILL at each launch: the graph keeps the kernel
                # chosen at capture.
                with _env("ORT_OPS_PA_PREFILL", _prefill_switch(kernel)):
                    pa = _cuda.PagedAttention(q, kc, vc, ks, vs, tables, lens, cu, pv_quant=pv,
                                              partition_size=args.partition, max_q_len=new)
                    pa.status_word.zero_()
                    out = pa()
                    st = pa.status()
                    replays[(kernel, pv)] = prepare(_with_env("ORT_OPS_PA_PREFILL", _prefill_switch(kernel), pa))
                rel = float((out.float() - ref).norm() / ref.norm())
                runs[(kernel, pv)] = (pa, st, rel)
        times = time_interleaved(torch, replays, args.iters * args.rounds, flush, FLUSH_MODE)
        for (kernel, pv), (pa, st, rel) in runs.items():
            t = times[(kernel, pv)]
            med = statistics.median(t)
            flops = 4.0 * new * hq * d * (hist + (new + 1) / 2)
            impl = f"ours-{pv}" if kernel == "prefill" else f"general-{pv}"
            rows.append({"mode": "prefill", "impl": impl, "batch": 1, "context": hist, "splits": pa.nsplit,
                         "median_us": med, "p90_us": sorted(t)[int(0.9 * len(t))], "tb_s": flops / med / 1e6,
                         "frac_copy": "", "rel_l2_vs_dequant": rel, "status": st})
            writer(rows[-1])
        del kc, vc, ks, vs, runs, replays
        torch.cuda.empty_cache()
    # INT8 P.V against its float twin, same kernel, same run.
    for kernel in args.prefill_kernels:
        impl = "ours" if kernel == "prefill" else "general"
        med = {(r["impl"], r["context"]): r["median_us"] for r in rows}
        ratios = [f"{h}: {med[(f'{impl}-none', h)] / med[(f'{impl}-s8', h)]:.3f}x"
                  for h in args.context if (f"{impl}-none", h) in med and (f"{impl}-s8", h) in med]
        if ratios:
            print(f"prefill {impl}: none / s8 = " + ", ".join(ratios), flush=True)
    return rows


def _with_env(var, value, fn):
    """fn() with environment variable var set to value (None: unset) for the call itself: the
    launcher reads its kernel switches (ORT_OPS_PA_PREFILL, ORT_OPS_PA_DECODE) when a kernel is
    launched, so an eager launch must see them when it is timed, not when it was prepared."""
    def run():
        with _env(var, value):
            return fn()

    return run


def _prefill_switch(kernel):
    """ORT_OPS_PA_PREFILL's value for a prefill kernel: general for the general kernel, unset for
    the 64-row prefill kernel."""
    return "general" if kernel == "general" else None


@contextlib.contextmanager
def _env(var, value):
    import os

    old = os.environ.pop(var, None)
    if value is not None:
        os.environ[var] = value
    try:
        yield
    finally:
        os.environ.pop(var, None)
        if old is not None:
            os.environ[var] = old


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--pv", nargs="+", default=["s8", "u8", "none"])
    ap.add_argument("--splits", type=int, nargs="+", default=[0], help="0: the launcher's choice")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--partition", type=int, default=256)
    ap.add_argument("--window", type=int, default=0,
                    help="decode: PagedAttentionInt8's sliding window for ours (0: none; peers ignore it, "
                         "so compare ours against its own run without --window)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--prefill-new", type=int, default=512)
    ap.add_argument("--prefill-kernels", nargs="+", default=["prefill", "general"], choices=["prefill", "general"],
                    help="prefill rows: the 64-row prefill kernel and/or the general kernel (same run)")
    ap.add_argument("--rounds", type=int, default=3, help="prefill: alternate the kernels and modes this often")
    ap.add_argument("--decode-loops", nargs="+", default=["auto"], choices=["auto", "wide", "dual", "single"],
                    help="decode: the launcher's loop (auto: at head dim 64 with blocks >= 64 the 8-warp one-stage "
                         "loop, =wide) and/or the 4-warp dual-stage loop (ORT_OPS_PA_DECODE=dual) and/or the 4-warp "
                         "one-stage loop (=single), "
                         "timed interleaved")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays instead of eager launches")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--flush", choices=["read", "write"], default="read",
                    help="evict L2 before each timed call by reading (default) or writing 256 MB")
    ap.add_argument("--peers", nargs="*", default=["flashinfer", "ort-gqa", "ours-ort", "ort-noop"],
                    help="optional peers besides cuDNN SDPA: flashinfer, ort-gqa, ours-ort, ort-noop")
    ap.add_argument("--ort-pv", nargs="*", default=["s8"], help="pv_quant of ours as an ORT session")
    ap.add_argument("--warmup-peers", action="store_true",
                    help="only JIT-compile FlashInfer's decode modules (bf16 and fp8 cache) on small shapes")
    args = ap.parse_args(argv)
    global FLUSH_MODE
    FLUSH_MODE = args.flush
    if args.warmup_peers:
        gen = torch.Generator(device="cuda")
        ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        flush = flush_buffer(torch)
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            t0 = time.perf_counter()
            flashinfer_decode(1, 1024, args.hq, args.hkv, args.head_dim, args.block, kv_dtype, gen, ws)
            print(f"flashinfer {kv_dtype} ready in {time.perf_counter() - t0:.1f} s", flush=True)
        return 0
    why = _cuda.cuda_unavailable_reason()
    if why:
        print(f"bench_attention_cuda: {why}", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    flush = flush_buffer(torch)
    warm_up(torch)
    fields = ["mode", "impl", "batch", "context", "splits", "median_us", "p90_us", "tb_s", "frac_copy",
              "rel_l2_vs_dequant", "status"]
    with contextlib.ExitStack() as stack:
        fh = stack.enter_context(open(args.csv, "w", newline="")) if args.csv else None
        w = csv.DictWriter(fh, fieldnames=fields) if fh else None
        if w:
            w.writeheader()

        def writer(row):
            if w:
                w.writerow(row)
                fh.flush()
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

        rows = []
        if not args.no_decode:
            rows += bench_decode(args, writer, flush, gen)
        if not args.no_prefill:
            rows += bench_prefill(args, writer, flush, gen)
        print("\n| mode | impl | batch | context | splits | median us | p90 us | TB/s (prefill: TOP/s) | of copy ceiling | rel L2 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            f = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
            print("| " + " | ".join(f(r[k]) for k in fields[:-1]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
