"""Scoring a point (ratios, fractions, best) and checking the targets on it."""

from __future__ import annotations

import pytest

from moe_serve.bench.kernel_bench import PointKey, score_point
from moe_serve.bench.roofline import Ceilings, Work
from moe_serve.bench.router_loads import Load
from moe_serve.bench.schema import BackendResult, Point, Timing
from moe_serve.bench.summary import headline_table
from moe_serve.bench.targets import check_targets
from tests.bench.sample import sample_run

CEILINGS = Ceilings(copy_bytes_per_s=1e12, gemm_flops_per_s=1e15)
WORK = Work(bytes=10**6, flops=10**6, experts_hit=2)  # 1 us of copying, 1 ns of compute


def _timed(backend: str, us: float, correct: bool = True) -> BackendResult:
    return BackendResult(
        backend=backend,
        routing_excluded=Timing(median_us=us, p90_us=us * 1.1, iters=5),
        routing_included=Timing(median_us=us + 1, p90_us=us * 1.2, iters=5),
        rel_error=0.0 if correct else 1.0,
        correct=correct,
    )


def _point(tokens: int, results: list[BackendResult], auto: str | None = "triton"):
    return score_point(PointKey("s", Load.UNIFORM, tokens), WORK, CEILINGS, results, auto)


def test_score_point_rates_each_backend_against_the_fastest_correct_one() -> None:
    point = _point(
        8, [_timed("triton", 2.0), _timed("deep-gemm", 4.0), _timed("wrong", 1.0, False)]
    )
    by_name = {r.backend: r for r in point.results}
    assert point.best == "triton"  # "wrong" is faster but incorrect
    assert by_name["deep-gemm"].ratio_to_best == pytest.approx(2.0)
    assert by_name["triton"].achieved_fraction == pytest.approx(0.5)  # 1 us roofline / 2 us
    assert by_name["triton"].bandwidth_fraction == pytest.approx(0.5)
    assert point.roofline_us == pytest.approx(1.0)
    assert point.bound_by == "memory"
    assert point.auto_ratio == pytest.approx(1.0)


def test_score_point_keeps_failures_and_has_no_best_without_a_correct_result() -> None:
    point = _point(8, [BackendResult(backend="triton", error="boom"), _timed("x", 1.0, False)])
    assert point.best is None
    assert point.auto_ratio is None
    assert point.results[0].error == "boom"


def test_targets_report_the_worst_point_and_whether_each_is_met() -> None:
    run = sample_run(
        [
            _point(1, [_timed("triton", 1.1), _timed("deep-gemm", 1.5)]),  # 91% of copy bw
            _point(64, [_timed("triton", 2.0), _timed("deep-gemm", 1.8)], auto="deep-gemm"),
        ]
    )
    checks = {c.target.split(" ")[0]: c for c in check_targets(run)}
    assert checks["decode"].met is False
    assert checks["decode"].worst.endswith("M=64: 0.556")
    assert checks["prefill"].met is None
    assert checks["our"].met is False  # deep-gemm beats triton at M=64
    assert checks["auto"].met is True


def _auto(member: str, us: float, beside_us: float, member_beside_us: float) -> BackendResult:
    update = {"member": member, "served_beside_us": beside_us, "member_beside_us": member_beside_us}
    return _timed("auto", us).model_copy(update=update)


def _auto_check(points):
    return next(c for c in check_targets(sample_run(points)) if c.target.startswith("auto "))


def test_auto_is_judged_beside_its_member_and_its_member_against_the_fastest() -> None:
    rows = [_timed("triton", 2.0), _timed("deep-gemm", 2.01)]
    # auto timed last reads slower than its member's row, but not beside it
    fair = _point(8, [*rows, _auto("triton", 2.2, 2.0, 2.0)], auto="auto")
    assert fair.auto_beside_ratio == pytest.approx(1.0)
    assert fair.member_served_ratio == pytest.approx(1.0)
    assert _auto_check([fair]).met is True
    slow = _point(8, [*rows, _auto("triton", 2.2, 2.1, 2.0)], auto="auto")
    assert _auto_check([fair, slow]).met is False
    assert _auto_check([fair, slow]).worst.endswith("M=8: 1.05")
    # beside its member, but the member is not within 2% of the fastest by the rows
    far = _point(8, [*rows, _auto("deep-gemm", 3.0, 2.0, 2.0)], auto="auto")
    assert far.member_served_ratio == pytest.approx(3.01 / 3.0)
    assert _auto_check([far]).met is True  # within 2% of the fastest counts
    slow_member = [_timed("triton", 2.0), _timed("deep-gemm", 2.5)]
    wrong_pick = _point(8, [*slow_member, _auto("deep-gemm", 3.0, 2.0, 2.0)], auto="auto")
    assert _auto_check([wrong_pick]).met is False


def test_an_older_result_without_the_times_beside_is_read_and_not_judged() -> None:
    point = _point(8, [_timed("triton", 2.0), _timed("auto", 2.2)], auto="auto")
    old = point.model_dump(exclude={"auto_beside_ratio", "member_served_ratio"})
    old["results"] = [
        r.model_dump(exclude={"member", "served_beside_us", "member_beside_us"})
        for r in point.results
    ]
    run = sample_run([Point.model_validate(old)])
    check = next(c for c in check_targets(run) if c.target.startswith("auto "))
    assert check.met is None
    assert headline_table(run, "uniform").endswith("| - | - |")
