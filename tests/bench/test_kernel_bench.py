"""The kernel benchmark end to end on the CPU with the tiny shape, and its building blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from moe_serve.bench import kernel_bench
from moe_serve.bench import random_layer as random_layer_module
from moe_serve.bench.kernel_bench import KernelBench, KernelBenchConfig, time_beside
from moe_serve.bench.random_layer import random_layer
from moe_serve.bench.router_loads import Load, router_logits
from moe_serve.kernels import registry
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import route
from moe_serve.kernels.timing import Timing, TimingPlan
from moe_serve.service.cli import main

CPU = torch.device("cpu")
QUICK = TimingPlan(warmup=1, min_iters=2, max_iters=3, budget_s=0.001)


class _WrongExperts(ReferenceExperts):
    name: ClassVar[str] = "test-wrong"

    def apply(self, x, ws):
        return super().apply(x, ws) * 2


class _NanLastRowExperts(ReferenceExperts):
    name: ClassVar[str] = "test-nan-last-row"

    def apply(self, x, ws):
        y = super().apply(x, ws)
        y[-1] = float("nan")
        return y


class _FailingExperts(ReferenceExperts):
    name: ClassVar[str] = "test-failing"

    def apply(self, x, ws):
        raise RuntimeError("kernel exploded")


@pytest.mark.parametrize("scheme", list(QuantScheme), ids=str)
def test_random_layer_has_the_layout_of_the_scheme_even_when_drawn_in_chunks(
    scheme: QuantScheme, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = MoEConfig(
        3, 128, 64, RoutingConfig(top_k=2), quant=QuantConfig(scheme, group_size=32), has_bias=True
    )
    monkeypatch.setattr(random_layer_module, "_CHUNK_ELEMENTS", 128 * 128)  # one expert a chunk
    got = random_layer(cfg, CPU).experts.tensors()
    want = random_expert_weights(cfg).tensors()
    assert {n: (t.shape, t.dtype) for n, t in got.items()} == {
        n: (t.shape, t.dtype) for n, t in want.items()
    }


def test_skewed_load_sends_more_tokens_to_the_hottest_expert_than_uniform() -> None:
    cfg = RoutingConfig(top_k=2)
    shares = {}
    for load in Load:
        ids = route(router_logits(load, 4096, 16, seed=0, device=CPU), cfg).topk_ids
        shares[load] = torch.bincount(ids.flatten(), minlength=16).max().item() / ids.numel()
    assert shares[Load.UNIFORM] < 0.1
    assert shares[Load.SKEWED] > 2 * shares[Load.UNIFORM]


def test_kernel_bench_times_checks_and_scores_every_backend_on_the_tiny_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.EXPERTS, "test-wrong", _WrongExperts)
    monkeypatch.setitem(registry.EXPERTS, "test-failing", _FailingExperts)
    out = tmp_path / "run.json"
    config = KernelBenchConfig(
        shapes=("tiny",),
        tokens=(1, 5),
        device=CPU,
        loads=(Load.UNIFORM,),
        reference_max_tokens=1,
        plan=QUICK,
    )
    run = KernelBench(config, out).run()

    assert json.loads(out.read_text())["points"]  # written, and valid JSON
    (shape,) = run.shapes
    assert shape.auto == "reference"
    by_tokens = {p.tokens: {r.backend: r for r in p.results} for p in run.points}
    # reference backends only up to reference_max_tokens
    assert set(by_tokens[1]) == {"reference", "reference-batched", "test-wrong", "test-failing"}
    assert set(by_tokens[5]) == {"test-wrong", "test-failing"}
    one = by_tokens[1]
    assert one["reference"].correct and one["reference"].rel_error < 1e-6
    assert not one["test-wrong"].correct and one["test-wrong"].rel_error == pytest.approx(1.0)
    assert "kernel exploded" in one["test-failing"].error
    assert one["test-failing"].routing_excluded is None
    timing = one["reference"].routing_included
    assert timing.iters >= 2 and timing.median_us > 0
    best = {p.tokens: p.best for p in run.points}
    assert best[1] in ("reference", "reference-batched")
    assert best[5] is None  # only a wrong and a failing backend ran there


def test_kernel_bench_records_unsupported_backends_with_their_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class _Bf16Only(ReferenceExperts):
        name: ClassVar[str] = "test-bf16-only"
        schemes: ClassVar[frozenset[QuantScheme]] = frozenset({QuantScheme.FP8_BLOCK})

    monkeypatch.setitem(registry.EXPERTS, "test-bf16-only", _Bf16Only)
    config = KernelBenchConfig(
        shapes=("tiny",), tokens=(2,), device=CPU, loads=(Load.SKEWED,), plan=QUICK
    )
    run = KernelBench(config, tmp_path / "run.json").run()
    assert "quant scheme none not supported" in run.shapes[0].not_run["test-bf16-only"]


def test_kernels_command_writes_a_valid_result_and_refuses_unknown_backends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    quick = ["--warmup", "1", "--min-iters", "2", "--max-iters", "2", "--budget-ms", "1"]
    args = ["bench", "kernels", "--device", "cpu", "--shapes", "tiny", "--tokens", "3"]
    out = ["--out", str(tmp_path), "--commit", "test"]
    assert main([*args, "--loads", "uniform", *out, *quick]) == 0
    (path,) = tmp_path.glob("cpu/kernels-tiny-*-test.json")  # one shape: named by it
    result = json.loads(path.read_text())
    assert result["settings"]["tokens"] == [3]
    assert result["environment"]["command"] == (
        "moe-serve bench kernels --mode backends --shapes tiny --tokens 3 --loads uniform "
        "--device cpu --warmup 1 --min-iters 2 --max-iters 2 --budget-ms 1.0"
    )
    assert main([*args, "--backends", "nope", "--out", str(tmp_path / "x"), *quick]) == 2
    assert "unknown backend(s) ['nope']" in caplog.text


def test_kernels_command_rejects_an_unknown_shape_naming_the_known_ones(
    capsys: pytest.CaptureFixture,
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "kernels", "--shapes", "llama"])
    assert "unknown shape(s) ['llama']" in capsys.readouterr().err


def test_shapes_past_the_time_limit_are_listed_as_not_run(tmp_path: Path) -> None:
    config = KernelBenchConfig(
        shapes=("tiny",), tokens=(1,), device=CPU, plan=QUICK, deadline_s=0.0
    )
    run = KernelBench(config, tmp_path / "run.json").run()
    assert run.shapes == [] and run.points == []
    assert run.shapes_not_run == {"tiny": "the run's time limit was reached"}


def test_a_non_finite_row_beyond_the_checked_rows_marks_the_backend_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(registry.EXPERTS, "test-nan-last-row", _NanLastRowExperts)
    config = KernelBenchConfig(
        shapes=("tiny",),
        tokens=(5,),
        device=CPU,
        backends=("reference", "test-nan-last-row"),
        loads=(Load.UNIFORM,),
        check_rows=2,
        plan=QUICK,
    )
    (point,) = KernelBench(config, tmp_path / "run.json").run().points
    by_name = {r.backend: r for r in point.results}
    assert by_name["test-nan-last-row"].rel_error == float("inf")
    assert not by_name["test-nan-last-row"].correct
    assert point.best == "reference"


def test_a_shape_whose_gemm_peak_cannot_be_measured_is_listed_as_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moe_serve.bench import ceilings

    def no_peak(timer, device, precision):
        raise RuntimeError("no fp32 GEMM today")

    monkeypatch.setattr(ceilings, "gemm_peak", no_peak)
    config = KernelBenchConfig(shapes=("tiny",), tokens=(1,), device=CPU, plan=QUICK)
    run = KernelBench(config, tmp_path / "run.json").run()
    assert run.points == []
    assert "no fp32 GEMM today" in run.shapes_not_run["tiny"]


def test_a_shape_that_fails_to_set_up_is_recorded_and_the_next_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moe_serve.bench import kernel_bench, shapes

    monkeypatch.setitem(shapes.SHAPES, "tiny2", shapes.SHAPES["tiny"])
    real = kernel_bench.random_layer

    def flaky(cfg, device, seed=0):
        if flaky.calls == 0:
            flaky.calls += 1
            raise MemoryError("out of memory drawing weights")
        return real(cfg, device, seed)

    flaky.calls = 0
    monkeypatch.setattr(kernel_bench, "random_layer", flaky)
    config = KernelBenchConfig(
        shapes=("tiny", "tiny2"), tokens=(1,), device=CPU, loads=(Load.UNIFORM,), plan=QUICK
    )
    run = KernelBench(config, tmp_path / "run.json").run()
    assert "MemoryError: out of memory" in run.shapes_not_run["tiny"]
    assert [s.name for s in run.shapes] == ["tiny2"]


def test_invariant_entries_time_the_backend_built_batch_invariant_beside_itself(
    tmp_path: Path,
) -> None:
    config = KernelBenchConfig(
        shapes=("tiny",),
        tokens=(2,),
        device=CPU,
        backends=("reference", "reference+invariant", "reference-batched+invariant"),
        loads=(Load.UNIFORM,),
        plan=QUICK,
    )
    run = KernelBench(config, tmp_path / "run.json").run()
    (point,) = run.points
    results = {r.backend: r for r in point.results}
    assert set(results) == {"reference", "reference+invariant"}
    assert results["reference+invariant"].correct
    assert "batched format" in run.shapes[0].not_run["reference-batched+invariant"]


def test_kernel_bench_times_auto_as_built_from_the_runs_own_rule(tmp_path: Path) -> None:
    config = KernelBenchConfig(
        shapes=("tiny",),
        tokens=(1, 3),
        device=CPU,
        backends=("reference", "reference-batched", "auto"),
        loads=(Load.UNIFORM, Load.SKEWED),
        plan=QUICK,
    )
    run = KernelBench(config, tmp_path / "run.json").run()
    (shape,) = run.shapes
    assert shape.auto in ("reference", "reference-batched")  # one of the backends, as built
    for point in run.points:
        rows = {r.backend: r for r in point.results}
        assert rows["auto"].correct and point.best != "auto" and point.best_served != "auto"
        assert point.auto_served_ratio == pytest.approx(
            rows["auto"].routing_included.median_us / rows[point.best_served].served().median_us
        )
        # the CPU serves uncaptured, and says why
        assert rows["reference"].captured is None
        assert rows["reference"].not_captured == "CUDA graphs need a CUDA device"
        # auto timed beside the member it runs, which is what it built
        auto = rows["auto"]
        assert auto.member == shape.auto
        assert auto.served_beside_us > 0 and auto.member_beside_us > 0
        assert point.auto_beside_ratio == pytest.approx(
            auto.served_beside_us / auto.member_beside_us
        )
        assert point.member_served_ratio == pytest.approx(
            rows[shape.auto].served().median_us / rows[point.best_served].served().median_us
        )
    skewed_only = KernelBenchConfig(
        shapes=("tiny",), tokens=(2,), device=CPU, backends=("reference", "auto"),
        loads=(Load.SKEWED,), plan=QUICK,
    )  # fmt: skip
    run = KernelBench(skewed_only, tmp_path / "skewed.json").run()
    assert "uniform load" in run.shapes[0].not_run["auto"]
    assert {r.backend for r in run.points[0].results} == {"reference"}


def test_auto_and_its_member_are_timed_alternately_each_first_of_a_pair_twice() -> None:
    calls: list[str] = []

    class _Timer:
        def measure(self, fn):
            fn()
            us = {"auto": [10.0, 12.0, 30.0, 11.0], "member": [11.0, 15.0, 9.0, 14.0]}[calls[-1]]
            return Timing(median_us=us[calls.count(calls[-1]) - 1], p90_us=20.0, iters=2)

    auto_us, member_us = time_beside(
        _Timer(), lambda: calls.append("auto"), lambda: calls.append("member")
    )
    assert calls == ["member", "auto", "auto", "member"] * 2
    assert (auto_us, member_us) == (11.5, 12.5)  # the median of each's four


def test_auto_times_the_member_of_its_token_switch_at_each_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class _Other(ReferenceExperts):
        name: ClassVar[str] = "test-other"

    monkeypatch.setitem(registry.EXPERTS, "test-other", _Other)
    # the rule runs reference below 3 tokens, test-other from 3 on: a token switch
    monkeypatch.setattr(
        kernel_bench,
        "shape_rule",
        lambda name, rows: {
            "order": ["reference", "test-other"],
            "served_us": {"1": {"reference": 1.0, "test-other": 2.0},
                          "3": {"reference": 2.0, "test-other": 1.0}},
            "plan": [[1, "reference"], [3, "test-other"]],
        },
    )  # fmt: skip
    config = KernelBenchConfig(
        shapes=("tiny",),
        tokens=(1, 3),
        device=CPU,
        backends=("reference", "test-other", "auto"),
        loads=(Load.UNIFORM,),
        plan=QUICK,
    )
    run = KernelBench(config, tmp_path / "run.json").run()
    members = {p.tokens: next(r for r in p.results if r.backend == "auto") for p in run.points}
    assert run.shapes[0].auto == "reference<3<=test-other"
    assert {m: r.member for m, r in members.items()} == {1: "reference", 3: "test-other"}
    assert all(r.member_beside_us is not None for r in members.values())
