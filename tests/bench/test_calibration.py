"""`moe-serve bench tune --mode calibrate`: the calibrated plan beside the tuned one, and the
refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from moe_serve.bench.calibration import compare, ratios, runs_at
from moe_serve.kernels.selection import Rule
from moe_serve.service.cli import main

SERVED = {
    "1": {"triton": 10.0, "deep-gemm": 30.0},
    "512": {"triton": 400.0, "deep-gemm": 200.0},
    "1024": {"triton": 900.0, "deep-gemm": 300.0},
}


def test_a_plan_runs_the_backend_of_its_last_step_at_or_below_the_count() -> None:
    plan = [[1, "triton"], [512, "deep-gemm"]]
    assert [runs_at(plan, m) for m in (1, 511, 512, 4096)] == [
        "triton",
        "triton",
        "deep-gemm",
        "deep-gemm",
    ]


def test_ratios_set_the_calibrated_plan_against_the_tuned_one_per_count() -> None:
    calibrated = [[1, "triton"], [512, "deep-gemm"]]
    tuned = [[1, "triton"], [1024, "deep-gemm"]]
    assert ratios(SERVED, calibrated, tuned) == ["M=1 1.000", "M=512 0.500", "M=1024 1.000"]
    assert ratios({"1": {"triton": 1.0}}, [[1, "oai-triton"]], tuned) == ["M=1 -"]


def test_compare_names_the_tuned_table_and_both_sets_of_times() -> None:
    tuned = Rule("fp8-block/large", ("triton",), {}, 0, SERVED, frozenset(), ((1, "triton"),))
    body = {"plan": [[1, "triton"], [512, "deep-gemm"]], "served_us": SERVED}
    text = "\n".join(compare(body, tuned, "auto_h200.json at abc1234"))
    assert "Tuned (auto_h200.json at abc1234): triton from M=1." in text
    assert "by the tuned table's times: M=1 1.000, M=512 0.500, M=1024 0.333" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_calibrate_mode_refuses_without_a_gpu(caplog) -> None:
    assert main(["bench", "tune", "--mode", "calibrate", "--shapes", "tiny"]) == 2
    assert "measures on a GPU: none is visible" in caplog.text
