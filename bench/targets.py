"""The kernel performance targets, checked against one result file.

- decode: at M <= 64 the best backend moves bytes at >= 80% of the measured copy bandwidth;
- prefill: at M >= 4096 the best backend reaches >= 65% of the measured dense GEMM peak;
- triton: our Triton backends are at least as fast as the best external library (DeepGEMM,
  triton_kernels) wherever both ran;
- auto: at every point, as served (whole layer, captured where the backend captures), auto is
  within 2% of the member it runs there, the two timed beside each other (bench.kernel_bench
  `time_beside`), and that member's own row is within 2% of the fastest; where the run has no
  row `auto`, the backend auto picks is its own member. Points without these figures (older
  results) do not count.
Only correct results (within the scheme's tolerance) count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .schema import AUTO_ROW, BackendResult, BenchRun, Point

DECODE_MAX_TOKENS = 64
DECODE_BANDWIDTH = 0.80
PREFILL_MIN_TOKENS = 4096
PREFILL_COMPUTE = 0.65
AUTO_SLACK = 1.02
OUR_TRITON = ("triton", "triton-batched")
EXTERNAL_PREFIXES = ("deep-gemm", "oai-triton")


@dataclass(frozen=True)
class TargetCheck:
    target: str
    met: bool | None  # None: no point of the run measures it
    worst: str  # the worst point, "shape/load/M: value"


def _best(point: Point) -> BackendResult | None:
    return next((r for r in point.results if r.backend == point.best), None)


def _median(point: Point, names: Callable[[str], bool]) -> float | None:
    times = [
        r.routing_excluded.median_us
        for r in point.results
        if names(r.backend) and r.correct and r.routing_excluded is not None
    ]
    return min(times, default=None)


def _auto_ratios(point: Point) -> tuple[float, ...] | None:
    """What the auto target judges at the point: (auto / its member timed beside it, member /
    fastest) with a row `auto`, else (auto's pick / fastest); None where one is absent."""
    with_row = any(r.backend == AUTO_ROW for r in point.results)
    ratios = (point.auto_beside_ratio,) * with_row + (point.member_served_ratio,)
    return None if None in ratios else ratios


def _check(
    target: str, values: list[tuple[Point, float]], ok: Callable[[float], bool], worse_is_high: bool
) -> TargetCheck:
    """Met when ok(value) holds at every point; report the worst point."""
    if not values:
        return TargetCheck(target, None, "no point measures it")
    point, value = (max if worse_is_high else min)(values, key=lambda pv: pv[1])
    return TargetCheck(
        target,
        all(ok(v) for _, v in values),
        f"{point.shape}/{point.load}/M={point.tokens}: {value:.3g}",
    )


def check_targets(run: BenchRun) -> list[TargetCheck]:
    decode, prefill, triton, auto = [], [], [], []
    for p in run.points:
        best = _best(p)
        if best is not None and p.tokens <= DECODE_MAX_TOKENS:
            decode.append((p, best.bandwidth_fraction))
        if best is not None and p.tokens >= PREFILL_MIN_TOKENS:
            prefill.append((p, best.compute_fraction))
        ours = _median(p, lambda b: b in OUR_TRITON)
        external = _median(p, lambda b: b.startswith(EXTERNAL_PREFIXES))
        if ours is not None and external is not None:
            triton.append((p, external / ours))
        ratios = _auto_ratios(p)
        if ratios is not None:
            auto.append((p, max(ratios)))
    return [
        _check(
            f"decode (M <= {DECODE_MAX_TOKENS}): best >= {DECODE_BANDWIDTH:.0%} of copy bandwidth",
            decode,
            lambda v: v >= DECODE_BANDWIDTH,
            worse_is_high=False,
        ),
        _check(
            f"prefill (M >= {PREFILL_MIN_TOKENS}): best >= {PREFILL_COMPUTE:.0%} of GEMM peak",
            prefill,
            lambda v: v >= PREFILL_COMPUTE,
            worse_is_high=False,
        ),
        _check(
            "our Triton >= 1.0x the best external library (speed-up shown)",
            triton,
            lambda v: v >= 1.0,
            worse_is_high=False,
        ),
        _check(
            f"auto within {AUTO_SLACK - 1:.0%} of its member timed beside it, and that member "
            f"within {AUTO_SLACK - 1:.0%} of the fastest, as served (the larger ratio shown)",
            auto,
            lambda v: v <= AUTO_SLACK,
            worse_is_high=True,
        ),
    ]
