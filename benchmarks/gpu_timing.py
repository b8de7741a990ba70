# SPDX-License-Identifier: MIT
"""GPU timing shared by the CUDA benchmarks: launches captured in CUDA graphs, timed interleaved.

Why interleaved. An L2 flush before each timed call evicts data, not instructions: timed back to
back, every replay of a launch after the first finds its code warm in the SMs' instruction
caches (and its parameters in the constant caches), which it never does between a model's
layers. So every launch of a case is captured first and then timed in rotation, each iteration
once each, in an order that shifts by one every iteration (no launch always runs first after the
host-side work between cases). Measured on the H200 (benchmarks/NOTES_moe_cuda.md, session 6):
the MoE decode kernel pair's empty launch reads 7.4 us back to back and 11.2 us interleaved.

Why graphs. A launch is one host call, so the host never falls behind the GPU between the
start event and the kernel (an eager launch behind Python and ctypes can, on a short kernel).
"""

from __future__ import annotations

import time

import numpy as np

FLUSH_BYTES = 256 * 2**20  # 4x the H200's L2


def flush_buffer(torch):
    return torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")


def evict_l2(flush, mode: str = "read") -> None:
    """Evicts L2 by reading 256 MB (default) or writing it. A write leaves ~50-60 MB of dirty lines
    whose write-back then competes with the timed call's reads (several us on a small call)."""
    if mode == "read":
        flush.max()
    else:
        flush.zero_()


def capture(torch, fn, warm: int = 3, eager_fallback: bool = True, what: str = ""):
    """fn() warmed up and captured in a CUDA graph: returns its replay. Where stream capture
    refuses the launch, the reason is printed and fn itself is returned (timed eagerly), or None
    when eager_fallback is False."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fn()
        replay = g.replay
    except Exception as ex:  # noqa: BLE001 - torch, cupy and driver errors alike: report, go on
        then = "timing eagerly" if eager_fallback else "no graph row"
        print(f"  {what}{' ' if what else ''}(graph capture failed, {then}: {str(ex)[:120]})", flush=True)
        torch.cuda.synchronize()
        if not eager_fallback:
            return None
        replay = fn
    for _ in range(warm):
        replay()
    torch.cuda.synchronize()
    return replay


# GPU spin before each timed call: covers the host's enqueue of the flush, the events and the
# call. 100 us did not cover eager cuDNN SDPA and FlashInfer launches in one H200 run (batch-1
# medians 23-95 us, p90 up to 152, against 15-26 us where the host kept up); 1 ms costs ~0.2 s
# a benchmark case.
HOLD_US = 1000.0


def time_interleaved(torch, replays: dict, iters: int, flush, mode: str = "read", hold_us: float = HOLD_US) -> dict:
    """Per name of `replays`: the list of its --iters GPU times (us, CUDA events around the
    replay), L2 flushed before each, all names timed in rotation (see the module note).

    Each timed call is enqueued behind a spin kernel of hold_us (torch.cuda._sleep) and the
    flush, so the GPU reaches the start event only after the host has enqueued the call and
    the end event: the events then bracket GPU work alone. Without the hold, a short call
    ends before the host has enqueued its end event and the host's launch latency is timed
    (an empty MoE launch read 23.5 us, its kernels ~9 us in a CUPTI timeline). hold_us=0
    times without it."""
    names = list(replays)
    times = {n: [] for n in names}
    cycles = int(hold_us * 1e-6 * clock_hz(torch)) if hold_us > 0 else 0
    for i in range(iters):
        for j in range(len(names)):
            n = names[(i + j) % len(names)]
            if cycles:
                torch.cuda._sleep(cycles)
            evict_l2(flush, mode)
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            replays[n]()
            b.record()
            b.synchronize()
            times[n].append(a.elapsed_time(b) * 1e3)
    return times


def clock_hz(torch) -> float:
    """The GPU's SM clock (Hz), for torch.cuda._sleep's cycle count (1.98 GHz if unknown)."""
    try:
        return float(torch.cuda.get_device_properties(0).clock_rate) * 1e3  # kHz
    except Exception:  # noqa: BLE001 - newer torch builds may drop the field
        return 1.98e9


def median_p90(ts) -> tuple[float, float]:
    return float(np.median(ts)), float(np.percentile(ts, 90))


def warm_up(torch, seconds: float = 1.0) -> None:
    """Busy the GPU for a while so its clocks have left idle before the first timed case (the
    first case measured from idle ran 1-2 us slower than the same launch later in the run)."""
    a = torch.ones((4096, 4096), dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        torch.cuda.synchronize()
