"""Median and p90 of samples; the CPU timer's iteration count stays within the plan."""

from __future__ import annotations

import time

import pytest
import torch

from moe_serve.kernels.timing import Timer, TimingPlan, summarize


def test_summarize_reports_median_and_p90_in_microseconds() -> None:
    samples = [i * 1e-6 for i in range(1, 11)]  # 1..10 us
    timing = summarize(samples)
    assert timing.median_us == pytest.approx(5.5)
    assert timing.p90_us == pytest.approx(9.1)
    assert timing.iters == 10


def test_summarize_refuses_a_single_sample() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        summarize([1.0])


def test_timer_runs_warmup_plus_a_bounded_number_of_iterations() -> None:
    calls = []
    plan = TimingPlan(warmup=2, min_iters=4, max_iters=6, budget_s=10.0)
    timing = Timer(torch.device("cpu"), plan).measure(lambda: calls.append(1))
    assert timing.iters == 6  # the budget asks for more; max_iters caps it
    assert len(calls) == 2 + 6  # warm-up (the last one sizes the run), then the timed calls
    assert 0 < timing.median_us <= timing.p90_us


def test_timer_cuts_the_warm_up_of_a_call_slower_than_the_budget() -> None:
    calls = []

    def slow() -> None:
        calls.append(1)
        time.sleep(0.01)

    plan = TimingPlan(warmup=5, min_iters=3, max_iters=10, budget_s=0.001)
    timing = Timer(torch.device("cpu"), plan).measure(slow)
    assert timing.iters == 3
    assert len(calls) == 2 + 3
    assert timing.median_us >= 10_000
