# SPDX-License-Identifier: MIT
"""Hardware floors on the GPU, measured the way our CUDA benchmarks measure (run on the H200).

Each timed call has CUDA events around it and is preceded by an L2 eviction (reading a 256 MB
buffer, outside the events): eager calls as bench_attention_cuda.py times them, CUDA-graph replays
as bench_moe_cuda.py does. Median and p90 of --iters calls, after 5 untimed calls.

launch   an empty kernel (1 block of 32 threads): the cost of one launch, eager and as a graph replay.
read     a read-only streaming kernel (cupy RawModule, NVRTC) that reads B bytes of random data once,
         cold: 16-byte __ldg loads (LDG.E.128.CONSTANT), 4 or 8 independent loads in flight per
         thread (--unrolls), grid-stride over 256-thread blocks, grids of 1, 2, 4 and 8 blocks per
         SM (--grids), every combination. The loads are xor-folded into a register that is stored
         only under a runtime flag the host keeps 0, so none can be dropped. TB/s = B / t against the
         measured read ceiling (4.35 TB/s, ../shared/GPU.md); the best combination (marked *) is also
         timed as a graph replay. Default sizes (bytes, multiples of 16 KiB) are what our kernels
         must read:
           8,650,752      decode batch 1, 4k context: INT8 K and V (4096 x 8 kv heads x 128 x 2)
                          plus float32 K and V scales per token and head (4096 x 8 x 2 x 4)
           17,301,504     the same at 8k context; 34,603,008 at 16k
           46,137,344     MoE, 8 experts x 2048 x 2816 INT8 gate+up weights
           322,961,408    MoE, 56 of 64 such experts (about what 16 tokens top-8 hit)
           1,107,296,256  decode batch 32, 16k context
int_mm   torch._int_mm, A int8 [M, K] row-major, B int8 [K, N] column-major, int32 out, for the MoE
         prefill GEMMs as one dense GEMM (4096 tokens x top-2 / top-8, K 2048, N 2816) and 8192^3;
         TOP/s = 2 M N K / t against the measured peak (920 TOP/s, GPU.md); eager and graph replay.

Prints "skipped: <reason>" and exits 0 where torch, cupy or a CUDA device is missing.

    python benchmarks/floors_cuda.py [--iters 50] [--sizes 8.65e6 1.11e9] [--grids 132 264]
                                     [--unrolls 4 8] [--no-gemm] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_timing import capture

READ_CEILING_TBS = 4.35  # read-only streaming, measured on the H200 (../shared/GPU.md)
INT8_PEAK_TOPS = 920.0  # torch._int_mm 8192^3, B column-major, measured on the H200 (GPU.md)
WARMUP = 5
BLOCK = 256  # threads per block of the read kernel; its __launch_bounds__ assume 256
SIZE_QUANTUM = 16 * 1024
DEFAULT_SIZES = [8_650_752, 17_301_504, 34_603_008, 46_137_344, 322_961_408, 1_107_296_256]
GEMM_SHAPES_MKN = [(8192, 2048, 2816), (32768, 2048, 2816), (8192, 8192, 8192)]

KERNELS = r"""
extern "C" __global__ void empty_kernel() {}

// Reads n16 16-byte words once. Grid-stride: at each step a thread issues UNROLL loads one grid
// stride apart (a warp's 32 loads are 512 contiguous bytes) before the first is used, then a tail
// loop reads what is left. The xor of all words is stored only when flag != 0: the host passes 0,
// the compiler cannot know it, so every load stays. Launch bounds: UNROLL 4 fits in 32 registers
// (8 blocks of 256 per SM); UNROLL 8 needs 48 to keep all 8 loads in flight (5 blocks per SM, so a
// grid of 8 per SM runs in two waves); at 32 registers ptxas interleaves them 4 + 4.
template <int UNROLL>
__device__ __forceinline__ void read_stream(const uint4* __restrict__ src, unsigned long long n16, int flag,
                                            unsigned int* sink) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned int acc = 0;
  for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = __ldg(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (flag) atomicXor(sink + blockIdx.x, acc);
}

extern "C" __global__ void __launch_bounds__(256, 8)
read_stream_u4(const uint4* __restrict__ src, unsigned long long n16, int flag, unsigned int* sink) {
  read_stream<4>(src, n16, flag, sink);
}

extern "C" __global__ void __launch_bounds__(256, 4)
read_stream_u8(const uint4* __restrict__ src, unsigned long long n16, int flag, unsigned int* sink) {
  read_stream<8>(src, n16, flag, sink);
}
"""


def time_calls(torch, fn, iters: int, flush) -> list[float]:
    """Microseconds of GPU time per call (CUDA events around it), L2 evicted before each by
    reading 256 MB outside the events, after WARMUP untimed calls."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        flush.max()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def on_torch_stream(torch, cp, kernel, grid: int, block: int, args: tuple):
    """A call that launches a cupy kernel on torch's current stream (the stream that the events
    are recorded on and that graph capture uses)."""

    def launch() -> None:
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kernel((grid,), (block,), args)

    return launch


def make_row(measure: str, mode: str, size, grid, unroll, times: list[float], work: float, unit: str,
             ceiling: float) -> dict:
    """One result; rate = work / t (bytes/us/1e6 = TB/s, ops/us/1e6 = TOP/s), '' without work."""
    med = statistics.median(times)
    rate = work / med / 1e6 if work else ""
    return {"measure": measure, "mode": mode, "size": size, "grid": grid, "unroll": unroll, "median_us": med,
            "p90_us": sorted(times)[int(0.9 * len(times))], "rate": rate, "unit": unit if work else "",
            "of_ceiling": rate / ceiling if work else ""}


def device_info(torch, cp) -> dict:
    """Device, clocks (maximum, as the driver reports them) and versions."""
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)

    def attr(code: int):
        try:
            return cp.cuda.runtime.deviceGetAttribute(code, dev)
        except Exception:  # noqa: BLE001  (informational only)
            return None

    # cudaDevAttr ClockRate (kHz), MemoryClockRate (kHz), GlobalMemoryBusWidth (bits)
    sm_khz, mem_khz, bus_bits = attr(13), attr(36), attr(37)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
            "l2_mib": getattr(props, "L2_cache_size", 0) / 2**20, "memory_gib": props.total_memory / 2**30,
            "max_sm_clock_mhz": sm_khz / 1e3 if sm_khz else None,
            "max_mem_clock_mhz": mem_khz / 1e3 if mem_khz else None, "mem_bus_bits": bus_bits,
            # double data rate: 2 transfers per memory clock, bus_bits / 8 bytes each
            "dram_peak_tbs": 2 * mem_khz * 1e3 * bus_bits / 8 / 1e12 if mem_khz and bus_bits else None,
            "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cupy": cp.__version__, "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cp.cuda.runtime.driverGetVersion()}


def bench_launch(torch, cp, module, args, flush, emit) -> None:
    fn = on_torch_stream(torch, cp, module.get_function("empty_kernel"), 1, 32, ())
    emit(make_row("launch", "eager", "", 1, "", time_calls(torch, fn, args.iters, flush), 0, "", 0))
    replay = capture(torch, fn, WARMUP, False, "launch")
    if replay is not None:
        emit(make_row("launch", "graph", "", 1, "", time_calls(torch, replay, args.iters, flush), 0, "", 0))


def bench_read(torch, cp, np, module, args, flush, emit) -> None:
    kernels = {u: module.get_function(f"read_stream_u{u}") for u in args.unrolls}
    sink = cp.zeros(max(args.grids), dtype=cp.uint32)
    flag = np.int32(0)
    for nbytes in args.sizes:  # ascending: the largest buffer last
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()  # uniform in [0, 255]
        src = cp.asarray(buf)  # zero-copy view (__cuda_array_interface__)
        kargs = (src, np.uint64(nbytes // 16), flag, sink)
        eager = {}
        for unroll in args.unrolls:
            for grid in args.grids:
                fn = on_torch_stream(torch, cp, kernels[unroll], grid, BLOCK, kargs)
                eager[grid, unroll] = make_row("read", "eager", nbytes, grid, unroll,
                                               time_calls(torch, fn, args.iters, flush), nbytes, "TB/s",
                                               READ_CEILING_TBS)
                emit(eager[grid, unroll])
        grid, unroll = min(eager, key=lambda c: eager[c]["median_us"])
        best = eager[grid, unroll]
        best["best"] = True
        print(f"read {nbytes:,} B: best grid {grid} unroll {unroll}, {best['median_us']:.1f} us, "
              f"{best['rate']:.3f} TB/s", flush=True)
        fn = on_torch_stream(torch, cp, kernels[unroll], grid, BLOCK, kargs)
        replay = capture(torch, fn, WARMUP, False, f"read {nbytes}")
        if replay is not None:
            emit(make_row("read", "graph", nbytes, grid, unroll, time_calls(torch, replay, args.iters, flush),
                          nbytes, "TB/s", READ_CEILING_TBS))
        del replay, fn, kargs, src, buf
        torch.cuda.empty_cache()


def bench_int_mm(torch, args, flush, emit) -> None:
    for m, k, n in GEMM_SHAPES_MKN:
        shape = f"{m}x{k}x{n}"
        a_MK = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda")
        b_KN = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda").t()  # column-major

        def fn(a_MK=a_MK, b_KN=b_KN):
            return torch._int_mm(a_MK, b_KN)

        try:
            fn()
        except RuntimeError as e:
            print(f"int_mm {shape}: skipped: {e}", flush=True)
            continue
        ops = 2 * m * n * k
        emit(make_row("int_mm", "eager", shape, "", "", time_calls(torch, fn, args.iters, flush), ops,
                      "TOP/s", INT8_PEAK_TOPS))
        replay = capture(torch, fn, WARMUP, False, f"int_mm {shape}")
        if replay is not None:
            emit(make_row("int_mm", "graph", shape, "", "", time_calls(torch, replay, args.iters, flush), ops,
                          "TOP/s", INT8_PEAK_TOPS))
        del replay, fn, a_MK, b_KN
        torch.cuda.empty_cache()


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sizes", type=float, nargs="+", default=DEFAULT_SIZES,
                    help="bytes to read (1.11e9 is fine), each rounded to a multiple of 16 KiB")
    ap.add_argument("--grids", type=int, nargs="+", default=None,
                    help="read kernel grids in blocks of 256 threads (default: 1, 2, 4, 8 per SM)")
    ap.add_argument("--unrolls", type=int, nargs="+", choices=[4, 8], default=[4, 8],
                    help="read kernel loads in flight per thread")
    ap.add_argument("--no-gemm", action="store_true", help="skip the torch._int_mm rows")
    ap.add_argument("--json", default=None, help="write the device info and all rows here")
    args = ap.parse_args(argv)
    args.sizes = sorted({max(1, round(s / SIZE_QUANTUM)) * SIZE_QUANTUM for s in args.sizes})

    try:
        import cupy as cp
        import numpy as np
        import torch
    except ImportError as e:
        print(f"skipped: {e}")
        return 0
    if not torch.cuda.is_available():
        print(f"skipped: torch {torch.__version__} sees no CUDA device")
        return 0
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001  (cupy without a usable driver or device)
        print(f"skipped: cupy sees no CUDA device ({type(e).__name__}: {e})")
        return 0

    info = device_info(torch, cp)
    print(" ".join(f"{k}={_fmt(v)}" for k, v in info.items()), flush=True)
    if args.grids is None:
        args.grids = [info["sms"] * f for f in (1, 2, 4, 8)]
    torch.manual_seed(0)
    flush = torch.ones(64 * 2**20, dtype=torch.float32, device="cuda")  # 256 MB, read to evict L2
    module = cp.RawModule(code=KERNELS)
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)

    bench_launch(torch, cp, module, args, flush, emit)
    bench_read(torch, cp, np, module, args, flush, emit)
    if not args.no_gemm:
        bench_int_mm(torch, args, flush, emit)

    print("\n| measure | mode | size (bytes or MxKxN) | grid | unroll | median us | p90 us | rate | unit "
          "| of ceiling |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        size = f"{r['size']:,}" if isinstance(r["size"], int) else r["size"]
        grid = f"{r['grid']}*" if r.get("best") else r["grid"]
        cells = [r["measure"], r["mode"], size, grid, r["unroll"], f"{r['median_us']:.2f}",
                 f"{r['p90_us']:.2f}", _fmt(r["rate"]), r["unit"], _fmt(r["of_ceiling"])]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"(* best grid and unroll for that size; ceilings: read {READ_CEILING_TBS} TB/s, "
          f"int8 {INT8_PEAK_TOPS:g} TOP/s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": info, "iters": args.iters, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
