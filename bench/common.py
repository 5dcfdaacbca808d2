"""Timing and bookkeeping shared by the microbenchmarks (method: BENCHMARK_H200.md)."""

from __future__ import annotations

import datetime
import statistics
from typing import Callable, List

import torch

from flashkda import _ext

#: Measured device-to-device copy bandwidth of the H200 (bytes read + written per second).
COPY_BANDWIDTH = 4.3e12

RESULTS: List[dict] = []
#: When set (bench/conftest.py: --flashkda-results), every record rewrites this JSON file at once, so
#: a run cut short by a time limit keeps what it measured.
RESULTS_PATH = None


kernel_family = _ext.kernel_family


def cuda_median_ms(fn: Callable[[], object], warmup: int = 5, rounds: int = 2, calls: int = 50,
                   warmup_s: float = 0.05) -> float:
    """Median of per-call CUDA-event times: each call timed alone, so host gaps show.

    Warm-up: at least `warmup` calls and `warmup_s` seconds, so that the first case of a session is
    not measured on a cold host (clocks, caches) while the later ones are.
    """
    import time

    t_end = time.perf_counter() + warmup_s
    done = 0
    while done < warmup or time.perf_counter() < t_end:
        fn()
        done += 1
        if done % 10 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) for s, e in events]
    return statistics.median(times)


def host_overhead_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Wall time of `calls` eager calls issued back to back without synchronising, per call.

    The launch queue absorbs the GPU work, so for small kernels this is the Python + dispatch cost.
    """
    import time

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def floor_ms(nbytes: float) -> float:
    return nbytes / COPY_BANDWIDTH * 1e3


def record(case: str, impl: str, median_ms: float, floor: float, **extra) -> dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    rec = dict(case=case, impl=impl, median_ms=round(median_ms, 5), floor_ms=round(floor, 5),
               date=datetime.date.today().isoformat(), gpu=gpu, **extra)
    RESULTS.append(rec)
    if RESULTS_PATH:
        import json

        with open(RESULTS_PATH, "w") as f:
            f.write(json.dumps(RESULTS, indent=1) + "\n")
    return rec
