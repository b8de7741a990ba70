# SPDX-License-Identifier: MIT
"""GroupedMatmulSwigluQuant on the GPU against torch peers, in one run (run on the H200).

Shapes: E experts top-k, hidden H (= K), intermediate I (N = 2 I for the SwiGLU GEMM), tokens T,
so M = T * k routed rows, sorted by expert (uniform random routing, k distinct experts a token).

Peers, each captured in a CUDA graph and timed with events around the replay, L2 flushed (by
reading 256 MB) before every timed replay (the weights of one layer fit in the 60 MB L2 at small T);
the replays of one case are timed interleaved, each iteration once each in a rotating order, each
behind a GPU hold so that the events bracket GPU work only (benchmarks/gpu_timing.py):
  ours      ort_ops GroupedMatmulSwigluQuant CUDA kernel (int8 in, int8 codes + scales out), per
            --configs: auto, the tiled kernel's bm16 / bm16w / bm32 / bm64 / bm128, or stream (the
            decode pair of cuda_stream.cu, which auto picks up to 4 rows an expert)
  packed B  ours with the weights pre-packed per 128-column tile (cuda.cuh weight_layout 1)
  layout2   ours on K-major weights [E, N, K] (weight_layout 2): config bm128 is the Hopper wgmma
            kernel (cuda_wgmma.cuh), bm16/bm16w/bm32/bm64 the mma.sync kernel reading B with
            ldmatrix, stream the K-major decode stream (cuda_stream.cu), auto picks by rows per
            expert (what a graph packing layout 2 gets); a config a shape refuses is skipped
  +bias oai each "ours" row again with the bias input (float32 [E, N]) and activation "swiglu_oai"
            (gpt-oss: alpha 1.702, limit 7), same weights and rows, timed in the same interleaved
            set (--variants '' leaves them out)
  gmd       GroupedMatmulDequant (the down projection: x [M, I] int8, weight [E, I, H]) with
            config auto, without and with its bias [E, H] (--no-gmd leaves them out)
  floor     the same launch (auto) with every group empty (tiled: memset + launch + tile map +
            tail fill; stream: its two kernels). Timed this way it reads ~23-25 us on the H200
            while a CUPTI timeline of the same graph shows ~9 us of memset and kernel: not a
            measure of the fixed cost inside a real launch (NOTES_moe_cuda.md, session 7)
  bf16      torch._grouped_mm bf16 GEMM + torch SwiGLU (fp32) + torch per-row INT8 quantization
  fp8 gemm  torch._scaled_grouped_mm fp8 e4m3 GEMM only (row-wise scales, bf16 out)
Reported: median and p90 us, ratio bf16/ours, TOP/s (2 M K N / t) against the measured INT8
peak (920 TOP/s), and the bytes a perfect kernel moves (weights of non-empty experts + x + y)
against the measured copy ceiling (4.28 TB/s).

One correctness check before timing: our codes against ort_ops.reference (all rows when
M <= 2048, else the rows of the first two experts). Benchmarks never assert.

    python benchmarks/bench_moe_cuda.py [--tokens 16,256,4096] [--experts 8x2,64x8] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import capture, flush_buffer, median_p90, time_interleaved, warm_up

INT8_PEAK_TOPS = 920.0   # torch._int_mm 8192^3, B column-major, measured on the H200 (GPU.md)
COPY_TBPS = 4.28         # device-to-device copy, read + write (GPU.md)


def routing(rng, t, e, k):
    """Per-expert row counts of T tokens each routed to k distinct experts (uniform)."""
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k]
    return np.bincount(ids.ravel(), minlength=e).astype(np.int64)


def check(torch, runner, x, w, ws, xs, counts, bias=None, act=None):
    """Fraction of our codes equal to the reference's, and whether the scales match exactly
    (bias [E, N] numpy or None, act: the activation attributes). GroupedMatmulDequant runners:
    the fraction of y bit-equal, and True."""
    from ort_ops import reference

    act = act or {}
    gl = np.cumsum(counts)
    runner.poison()
    runner.launch()
    err = runner.error_word()
    y = runner.y.cpu().numpy()
    m = x.shape[0]
    rows = m if m <= 2048 else int(gl[1])
    e_used = len(counts) if m <= 2048 else 2
    b = None if bias is None else bias[:e_used]
    if runner.dequant:
        ry = reference.grouped_matmul_dequant(x[:rows], w[:e_used], ws[:e_used], xs[:rows], gl[:e_used], b)
        return err, float(np.mean(y[:rows] == ry)), True
    ys = runner.y_scale.cpu().numpy()
    ry, rys = reference.grouped_matmul_swiglu_quant(x[:rows], w[:e_used], ws[:e_used], xs[:rows], gl[:e_used], b,
                                                    **act)[:2]
    return err, float(np.mean(y[:rows] == ry)), bool(np.array_equal(ys[:rows], rys))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16,256,4096")
    ap.add_argument("--experts", default="8x2,64x8", help="E x top-k list")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--configs", default="auto",
                    help="configs to time (weight [E, K, N]): auto,bm16,bm16w,bm32,bm64,bm128,stream; '' for none")
    ap.add_argument("--wg-configs", default="auto,bm128",
                    help="weight layout 2 ([E, N, K], sm_90 only) configs to time (bm128: the wgmma "
                         "kernel; auto: by rows per expert); '' for none")
    ap.add_argument("--no-packed", action="store_true", help="skip the packed-B (layout 1) row")
    ap.add_argument("--variants", default="bias_oai",
                    help="'bias_oai': every ours row again with bias + swiglu_oai; '' for none")
    ap.add_argument("--no-gmd", action="store_true", help="skip the GroupedMatmulDequant rows (plain, +bias)")
    ap.add_argument("--no-floor", action="store_true", help="skip the empty-launch (floor) row")
    ap.add_argument("--no-peers", action="store_true", help="skip the torch bf16 and fp8 peers")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--flush", choices=["read", "write"], default="read",
                    help="evict L2 by reading (default) or by writing 256 MB before each replay")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from ort_ops.testing.moe_launchers import GmsqRunner, cuda_unavailable_reason, pack_weight, pack_weight_kmajor

    reason = cuda_unavailable_reason()
    if reason:
        print(f"bench_moe_cuda: cannot run: {reason}")
        return 2
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    vrng = np.random.default_rng(1)  # the variants' own data, so the plain rows keep their inputs
    flush = flush_buffer(torch)
    warm_up(torch)
    k_dim, inter = args.hidden, args.inter
    n_dim = 2 * inter
    rows_out = []
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  H={k_dim} I={inter}", flush=True)
    for spec in args.experts.split(","):
        e, topk = (int(v) for v in spec.split("x"))
        w = rng.integers(-127, 128, (e, k_dim, n_dim), dtype=np.int8)
        ws = (rng.uniform(0.2, 1.0, (e, n_dim)) / 127).astype(np.float32)
        w_d = torch.from_numpy(w).to(dev)
        w_packed = None if args.no_packed else pack_weight(w_d)  # weight_layout 1: one run per CTA
        wg_configs = [c for c in args.wg_configs.split(",") if c] if torch.cuda.get_device_capability()[0] == 9 else []
        w_km = pack_weight_kmajor(w_d) if wg_configs else None  # weight_layout 2 ([E, N, K])
        ws_d = torch.from_numpy(ws).to(dev)
        # gpt-oss variant: a bias of the size of C's spread (|C| ~ 1..20 here).
        bias = vrng.uniform(-2.0, 2.0, (e, n_dim)).astype(np.float32)
        bias_d = torch.from_numpy(bias).to(dev)
        oai = {"activation": "swiglu_oai", "alpha": 1.702, "limit": 7.0}
        variants = [v for v in args.variants.split(",") if v]
        if not args.no_gmd:  # the down projection: [E, I, H] weights, its own per-column scales and bias
            w2 = vrng.integers(-127, 128, (e, inter, k_dim), dtype=np.int8)
            ws2 = (vrng.uniform(0.2, 1.0, (e, k_dim)) / 127).astype(np.float32)
            bias2 = vrng.uniform(-2.0, 2.0, (e, k_dim)).astype(np.float32)
            w2_d, ws2_d, bias2_d = (torch.from_numpy(a).to(dev) for a in (w2, ws2, bias2))
        # bf16 / fp8 peers: the same weights dequantized; fp8 wants B column-major ([E, N, K]^T).
        w_bf16 = (w_d.float() * ws_d[:, None, :]).to(torch.bfloat16)
        try:
            w_fp8 = w_bf16.transpose(1, 2).contiguous().to(torch.float8_e4m3fn).transpose(1, 2)
            wsc_fp8 = torch.ones((e, n_dim), dtype=torch.float32, device=dev)
        except Exception as ex:  # noqa: BLE001 - reported, not fatal
            w_fp8, fp8_reason = None, f"{type(ex).__name__}: {ex}"
        for t in (int(v) for v in args.tokens.split(",")):
            counts = routing(rng, t, e, topk)
            m = int(counts.sum())
            x = rng.integers(-128, 128, (m, k_dim), dtype=np.int8)
            xs = (rng.uniform(0.2, 1.0, m) * 3 * 20 / (127 * np.sqrt(k_dim))).astype(np.float32)
            x_d = torch.from_numpy(x).to(dev)
            xs_d = torch.from_numpy(xs).to(dev)
            gl_d = torch.from_numpy(np.cumsum(counts)).to(dev)
            offs = torch.from_numpy(np.cumsum(counts).astype(np.int32)).to(dev)
            active = int(np.count_nonzero(counts))
            ops = 2.0 * m * k_dim * n_dim
            bytes_min = active * k_dim * n_dim + m * k_dim + m * inter + 8 * m
            label = f"{e}e top{topk} T={t}"

            replays = {}  # timed together below, interleaved
            configs = [c for c in args.configs.split(",") if c]
            # (config, weight, weight_layout, name in the log, result row)
            runs = ([(cfg, w_d, 0, cfg, f"ours[{cfg}]") for cfg in configs]
                    + [(cfg, w_km, 2, f"layout 2 {cfg}", f"ours layout2[{cfg}] [E,N,K]") for cfg in wg_configs])
            # The bias_oai variant of each run right after it, so the pair sits side by side.
            runs = [r for run in runs for r in [run] + [
                (run[0], run[1], run[2], run[3] + " +bias oai", run[4] + " +bias oai", "bias_oai") for _ in variants]]
            for cfg, weight, layout, what, row, *variant in runs:
                extra = {"bias": bias_d, **oai} if variant else {}
                runner = GmsqRunner(x_d, weight, ws_d, xs_d, gl_d, config=cfg, layout=layout, **extra)
                try:
                    runner.launch()
                except RuntimeError as ex:  # e.g. stream past its M * N bound: say so, go on
                    print(f"{label}: {what} not run: {ex}", flush=True)
                    continue
                if not args.no_check:
                    err, eq, scales_eq = check(torch, runner, x, w, ws, xs, counts,
                                               bias if variant else None, oai if variant else None)
                    print(f"{label}: check vs reference ({what}): err word {err}, codes equal {eq:.6f}, "
                          f"scales bit-equal {scales_eq}", flush=True)
                replays[row] = capture(torch, runner.launch)
            if not args.no_gmd:
                h = vrng.integers(-127, 128, (m, inter), dtype=np.int8)
                hs = (vrng.uniform(0.2, 1.0, m) * 3 * 20 / (127 * np.sqrt(inter))).astype(np.float32)
                h_d, hs_d = torch.from_numpy(h).to(dev), torch.from_numpy(hs).to(dev)
                for name, b_np, b_d in (("gmd[auto]", None, None), ("gmd[auto] +bias", bias2, bias2_d)):
                    runner = GmsqRunner(h_d, w2_d, ws2_d, hs_d, gl_d, dequant=True, bias=b_d)
                    if not args.no_check:
                        err, eq, _ = check(torch, runner, h, w2, ws2, hs, counts, b_np)
                        print(f"{label}: check vs reference ({name}): err word {err}, y bit-equal {eq:.6f}",
                              flush=True)
                    replays[name] = capture(torch, runner.launch)
            if not args.no_packed:
                packed = GmsqRunner(x_d, w_packed, ws_d, xs_d, gl_d, n=n_dim)
                replays["ours[auto] packed B"] = capture(torch, packed.launch)
            if not args.no_floor:
                floor = GmsqRunner(x_d, w_d, ws_d, xs_d, torch.zeros_like(gl_d))
                replays["ours floor (no rows)"] = capture(torch, floor.launch)

            x_bf16 = (x_d.float() * xs_d[:, None]).to(torch.bfloat16)

            def bf16_peer(x_bf16=x_bf16, w_bf16=w_bf16, offs=offs):
                c = torch._grouped_mm(x_bf16, w_bf16, offs=offs, out_dtype=torch.bfloat16)
                a, g = c.float().split(inter, dim=1)
                s = F.silu(a) * g
                amax = s.abs().amax(dim=1, keepdim=True)
                q = torch.round(s * (127.0 / amax)).clamp_(-127, 127).to(torch.int8)
                return q, (amax / 127.0).squeeze(1)

            if not args.no_peers:
                try:
                    replays["bf16 grouped_mm+swiglu+quant"] = capture(torch, bf16_peer)
                except Exception as ex:  # noqa: BLE001
                    print(f"{label}: bf16 peer failed: {type(ex).__name__}: {ex}")
                if w_fp8 is not None:
                    x_fp8 = x_bf16.to(torch.float8_e4m3fn)
                    sa = torch.ones(m, dtype=torch.float32, device=dev)

                    def fp8_peer(x_fp8=x_fp8, w_fp8=w_fp8, sa=sa, wsc_fp8=wsc_fp8, offs=offs):
                        return torch._scaled_grouped_mm(x_fp8, w_fp8, sa, wsc_fp8, offs=offs,
                                                        out_dtype=torch.bfloat16)

                    try:
                        replays["fp8 scaled_grouped_mm (GEMM only)"] = capture(torch, fp8_peer)
                    except Exception as ex:  # noqa: BLE001
                        print(f"{label}: fp8 peer failed: {type(ex).__name__}: {str(ex)[:300]}")
                else:
                    print(f"{label}: fp8 peer unavailable: {fp8_reason}")

            results = {n: median_p90(ts) for n, ts in
                       time_interleaved(torch, replays, args.iters, flush, args.flush).items()}
            base = results.get("bf16 grouped_mm+swiglu+quant", (float("nan"),))[0]
            for name, (med, p90) in results.items():
                ops_r, bytes_r = ops, bytes_min
                if name.startswith("gmd"):  # the down projection's own work: [M, I] x [I, H], float32 out
                    ops_r = 2.0 * m * inter * k_dim
                    bytes_r = active * inter * k_dim + m * inter + 4 * m * k_dim
                row = {"case": label, "E": e, "topk": topk, "tokens": t, "M": m, "active_experts": active,
                       "impl": name, "median_us": round(med, 2), "p90_us": round(p90, 2),
                       "speedup_vs_bf16": round(base / med, 2), "tops": round(ops_r / med / 1e6, 1),
                       "pct_int8_peak": round(100 * ops_r / med / 1e6 / INT8_PEAK_TOPS, 1),
                       "tbps": round(bytes_r / med / 1e6, 2),
                       "pct_copy": round(100 * bytes_r / med / 1e6 / COPY_TBPS, 1)}
                rows_out.append(row)
            torch.cuda.empty_cache()

    cols = ["case", "impl", "median_us", "p90_us", "speedup_vs_bf16", "tops", "pct_int8_peak", "tbps", "pct_copy"]
    print("\n" + " | ".join(cols))
    for r in rows_out:
        print(" | ".join(str(r[c]) for c in cols))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows_out[0]))
            wr.writeheader()
            wr.writerows(rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
