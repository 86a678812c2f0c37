"""`moe-serve bench tune --mode rules`: the rule table `--backend auto` follows, from a kernel
run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from moe_serve.bench.auto_table import rule_table, summary
from moe_serve.bench.kernel_bench import KernelBench, KernelBenchConfig, read_run
from moe_serve.bench.router_loads import Load
from moe_serve.bench.schema import Point, write_result
from moe_serve.kernels import registry, selection
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.timing import TimingPlan
from moe_serve.service.cli import main
from tests.bench.sample import sample_run

RULES = ["bench", "tune", "--mode", "rules", "--from"]
QUICK = TimingPlan(warmup=1, min_iters=2, max_iters=3, budget_s=0.001)


class _WrongExperts(ReferenceExperts):
    name: ClassVar[str] = "test-wrong"

    def apply(self, x, ws):
        return super().apply(x, ws) * 2


@pytest.fixture
def tiny_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A kernel benchmark run on the tiny shape (CPU): the references and a wrong backend."""
    monkeypatch.setitem(registry.EXPERTS, "test-wrong", _WrongExperts)
    config = KernelBenchConfig(
        shapes=("tiny",),
        tokens=(1, 3),
        device=torch.device("cpu"),
        backends=("reference", "reference-batched", "test-wrong"),
        loads=(Load.UNIFORM, Load.SKEWED),
        plan=QUICK,
    )
    out = tmp_path / "run.json"
    KernelBench(config, out).run()
    return out


def test_auto_table_command_writes_the_rules_auto_reads_from_a_benchmark_run(
    tiny_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tuned" / "auto_cpu.json"
    assert main([*RULES, str(tiny_run), "--out", str(out)]) == 0

    table = selection.RuleTable.from_json(out)
    rule = table.rules["none/small"]  # the tiny shape: unquantised, small
    assert table.device == "cpu"
    assert list(rule.times_us) == ["1", "3"]
    assert set(rule.order) == {"reference", "reference-batched"}  # the wrong one is not ranked
    for row in rule.times_us.values():
        assert set(row) == {"reference", "reference-batched"} and min(row.values()) > 0
    body = json.loads(out.read_text())["rules"]["none/small"]
    assert body["shape"] == "tiny"
    assert body["failed"]["test-wrong"].startswith("M=1: relative error 1")
    assert "deep_gemm_min_tokens" not in body  # neither deep-gemm nor triton ran
    summary = out.with_suffix(".md").read_text()
    assert "## none/small: tiny (order: " in summary and "- test-wrong not ranked" in summary


def _timed(point: Point, medians_us: dict[str, float]) -> Point:
    """`point` with one correct result per backend, at the given median times."""
    template = point.results[0]
    results = [
        template.model_copy(
            update={
                "backend": backend,
                "routing_excluded": replace(template.routing_excluded, median_us=us),
            }
        )
        for backend, us in medians_us.items()
    ]
    return point.model_copy(update={"results": results})


def test_auto_table_merge_replaces_the_measured_rules_and_keeps_the_others(
    tiny_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "auto_cpu.json"
    other = {"shape": "gpt-oss", "order": ["oai-triton"], "times_us": {"1": {"oai-triton": 9.0}},
             "failed": {}}  # fmt: skip
    stale = {"shape": "tiny", "order": ["reference"], "times_us": {"1": {"reference": 1.0}},
             "failed": {}}  # fmt: skip
    out.write_text(json.dumps({"device": "cpu", "commit": "old1234", "method": "m",
                               "rules": {"mxfp4/large": other, "none/small": stale}}))  # fmt: skip
    assert main([*RULES, str(tiny_run), "--out", str(out), "--merge"]) == 0

    table = selection.RuleTable.from_json(out)
    run_commit = json.loads(tiny_run.read_text())["environment"]["commit"]
    assert table.rules["mxfp4/large"].commit == "old1234"  # kept, naming where it came from
    assert table.rules["mxfp4/large"].order == ("oai-triton",)
    assert table.rules["none/small"].commit == run_commit  # measured again: replaced
    assert list(table.rules["none/small"].times_us) == ["1", "3"]
    assert f"Measured at commit {run_commit}." in out.with_suffix(".md").read_text()

    out.write_text(json.dumps({"device": "NVIDIA H100", "commit": "x", "rules": {}}))
    assert main([*RULES, str(tiny_run), "--out", str(out), "--merge"]) == 2
    assert json.loads(out.read_text())["device"] == "NVIDIA H100"  # refused, left as it was


def test_triton_or_deep_gemm_row_is_derived_from_the_backend_it_runs_at_each_count() -> None:
    measured = {  # tokens -> medians; triton-or-deep-gemm's own time is not used
        1: {"triton": 40.0, "deep-gemm": 90.0, "triton-or-deep-gemm": 1.0},
        4: {"triton": 80.0, "deep-gemm": 85.0, "triton-or-deep-gemm": 1.0},
        16: {"triton": 900.0, "deep-gemm": 500.0, "triton-or-deep-gemm": 1.0},
    }
    uniform = [p for p in sample_run().points if p.load == "uniform"]
    rule = rule_table(sample_run([_timed(p, measured[p.tokens]) for p in uniform]))["rules"]
    derived = rule["none/small"]
    assert derived["deep_gemm_min_tokens"] == 16
    rows = derived["times_us"]
    assert [rows[m]["triton-or-deep-gemm"] for m in ("1", "4", "16")] == [40.0, 80.0, 500.0]
    assert derived["order"] == ["triton-or-deep-gemm", "triton", "deep-gemm"]


def test_a_run_without_the_uniform_load_is_refused_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = sample_run()
    skewed_only = run.model_copy(update={"points": [p for p in run.points if p.load != "uniform"]})
    write_result(tmp_path / "skewed.json", skewed_only)
    assert main([*RULES, str(tmp_path / "skewed.json")]) == 2
    assert "shape tiny has no uniform-load points" in caplog.text


def _served(point: Point, served_us: dict[str, tuple[float, bool]]) -> Point:
    """`point` with one correct result per backend, served in `us` (captured or not)."""
    template = point.results[0]
    results = []
    for backend, (us, captured) in served_us.items():
        timing = replace(template.routing_included, median_us=us)
        update = {"backend": backend, "captured": timing if captured else None}
        if not captured:
            update |= {"routing_included": timing, "not_captured": "it syncs with the host"}
        results.append(template.model_copy(update=update))
    return point.model_copy(update={"results": results})


def test_the_plan_and_the_fastest_per_count_come_from_the_served_timings() -> None:
    # uncaptured, oai-triton loses at M=1 (the library's Python); captured it wins from 4 on
    measured = {
        1: {"triton": (90.0, True), "oai-triton": (180.0, True), "triton-batched": (50.0, False)},
        4: {"triton": (120.0, True), "oai-triton": (100.0, True), "triton-batched": (900, False)},
        16: {"triton": (400.0, True), "oai-triton": (200.0, True), "triton-batched": (900, False)},
    }
    uniform = [p for p in sample_run().points if p.load == "uniform"]
    run = sample_run([_served(p, measured[p.tokens]) for p in uniform])
    rule = rule_table(run)["rules"]["none/small"]
    assert rule["fastest"] == {"1": "triton-batched", "4": "oai-triton", "16": "oai-triton"}
    assert rule["captured"] == ["oai-triton", "triton"]
    assert rule["served_us"]["4"] == {"triton": 120.0, "oai-triton": 100.0, "triton-batched": 900}
    # triton-batched (batched, uncaptured) shares no layer with triton: 1.8x off at M=1 is best
    assert rule["plan"] == [[1, "triton"], [4, "oai-triton"]]
    parsed = selection.Rule.from_json("none/small", rule)
    assert parsed.plan == ((1, "triton"), (4, "oai-triton"))
    assert "Auto runs triton from M=1, oai-triton from M=4" in summary(rule_table(run))
    assert "auto not timed): M=1 1.800, M=4 1.000, M=16 1.000." in summary(rule_table(run))


def test_a_backend_captured_at_one_count_but_not_another_is_not_planned() -> None:
    measured = {
        1: {"triton": (50.0, True), "oai-triton": (90.0, True)},
        4: {"triton": (50.0, False), "oai-triton": (90.0, True)},  # triton's capture failed
        16: {"triton": (50.0, True), "oai-triton": (90.0, True)},
    }
    uniform = [p for p in sample_run().points if p.load == "uniform"]
    rule = rule_table(sample_run([_served(p, measured[p.tokens]) for p in uniform]))["rules"]
    body = rule["none/small"]
    assert "triton" not in body["served_us"]["4"]
    assert body["failed"]["triton"] == "M=4: not captured: it syncs with the host"
    assert body["plan"] == [[1, "oai-triton"]]


def test_a_rule_table_names_the_run_that_measured_it_and_a_merge_each_rules_own(
    tiny_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "auto_cpu.json"
    kept = {"shape": "gpt-oss", "order": ["oai-triton"], "times_us": {"1": {"oai-triton": 9.0}},
            "failed": {}}  # fmt: skip
    command = "moe-serve bench kernels --shapes gpt-oss"
    out.write_text(json.dumps({"device": "cpu", "commit": "old1234", "date": "2026-01-02",
                               "command": command, "rules": {"mxfp4/large": kept}}))  # fmt: skip
    assert main([*RULES, str(tiny_run), "--out", str(out), "--merge"]) == 0

    body = json.loads(out.read_text())
    environment = json.loads(tiny_run.read_text())["environment"]
    measured = {"commit": environment["commit"], "date": environment["created"][:10],
                "command": "moe-serve bench kernels --shapes tiny --tokens 1,3 --loads uniform,"
                "skewed --reference-max-tokens 64 --check-rows 32 --warmup 1 --min-iters 2 "
                "--max-iters 3 --budget-ms 1"}  # fmt: skip
    assert {name: body["rules"]["none/small"][name] for name in measured} == measured
    old = {"commit": "old1234", "date": "2026-01-02", "command": command}
    assert {name: body["rules"]["mxfp4/large"][name] for name in old} == old
    assert {name: rule_table(read_run(tiny_run))[name] for name in measured} == measured
