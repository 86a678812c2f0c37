"""Timing a device call: warm-up, L2 flushed before every iteration, median and p90 (the
benchmarks and the service's self-calibration, kernels/calibrate.py, time with it).

On CUDA each iteration is bracketed by CUDA events (the host never waits inside the loop); a
write of twice the L2 size before each start event evicts what the previous iteration left in
cache, so weights are read from device memory as they would be in a real model where other
layers run in between. On the CPU the host clock times each call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

_DEFAULT_L2_BYTES = 50 * 2**20  # H100; used when the device does not report its L2 size


@dataclass(frozen=True)
class Timing:
    median_us: float
    p90_us: float
    iters: int


@dataclass(frozen=True)
class TimingPlan:
    warmup: int = 3  # calls before timing (the first compiles and autotunes), at least 1
    min_iters: int = 5
    max_iters: int = 100
    budget_s: float = 0.2  # aim for about this much timed work per point


def summarize(samples_s: list[float]) -> Timing:
    """Seconds per iteration -> median and 90th percentile in microseconds."""
    if len(samples_s) < 2:
        raise ValueError(f"need at least 2 samples, got {len(samples_s)}")
    p90 = statistics.quantiles(samples_s, n=10, method="inclusive")[8]
    return Timing(
        median_us=statistics.median(samples_s) * 1e6, p90_us=p90 * 1e6, iters=len(samples_s)
    )


class Timer:
    def __init__(self, device: torch.device, plan: TimingPlan, flush_l2: bool = True) -> None:
        """flush_l2=False: back-to-back calls keep what fits in L2, as a served layer's forwards
        do (its weights stay cached when they fit, e.g. the demo layer's 6 MB)."""
        self.device = device
        self.plan = plan
        self._flush = None
        self._events = device.type == "cuda"
        if device.type == "cuda" and flush_l2:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
            self._flush = torch.empty(
                2 * (l2 or _DEFAULT_L2_BYTES), dtype=torch.uint8, device=device
            )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _iterations(self, fn: Callable[[], object]) -> int:
        """Warm up, then size the run from the last warm-up call so it takes about budget_s.

        A call too slow to fit min_iters in the budget (the reference at full size) stops the
        warm-up after its second call: the first compiled and allocated, the second is steady.
        """
        for i in range(max(1, self.plan.warmup)):
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            once = max(time.perf_counter() - start, 1e-7)
            if i >= 1 and once * self.plan.min_iters > self.plan.budget_s:
                break
        return min(self.plan.max_iters, max(self.plan.min_iters, int(self.plan.budget_s / once)))

    def measure(self, fn: Callable[[], object]) -> Timing:
        iters = self._iterations(fn)
        if not self._events:
            samples = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            return summarize(samples)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(iters)
        ]
        for begin, end in events:
            if self._flush is not None:
                self._flush.zero_()
            begin.record()
            fn()
            end.record()
        self._sync()
        return summarize([begin.elapsed_time(end) / 1e3 for begin, end in events])
