"""The kernel benchmark's CUDA paths (events, L2 flush, ceilings, GPU-drawn weights) on a small
bf16 layer: every available backend is checked against the reference and timed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve.bench import shapes
from moe_serve.bench.auto_table import rule_table
from moe_serve.bench.kernel_bench import KernelBench, KernelBenchConfig
from moe_serve.bench.router_loads import Load
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.prepare_finalize.batched import SYNC_FREE_TOKENS
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.registry import EXPERTS
from moe_serve.kernels.timing import TimingPlan

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK], ids=str)
def test_every_available_backend_is_correct_and_timed_on_a_small_bf16_layer(
    scheme: QuantScheme, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = MoEConfig(16, 512, 256, RoutingConfig(top_k=4), quant=QuantConfig(scheme))
    monkeypatch.setitem(shapes.SHAPES, "small", small)
    config = KernelBenchConfig(
        shapes=("small",),
        tokens=(1, 33, 300),
        device=torch.device("cuda"),
        plan=TimingPlan(warmup=2, min_iters=5, max_iters=10, budget_s=0.01),
    )
    run = KernelBench(config, tmp_path / "gpu.json").run()
    assert run.ceilings.copy_bytes_per_s > 1e11  # any data-centre GPU moves > 100 GB/s
    assert all(peak > 1e13 for peak in run.ceilings.gemm_flops_per_s.values())
    for point in run.points:
        for r in point.results:
            assert r.error is None, f"{r.backend} at {point.tokens}: {r.error}"
            assert r.correct, f"{r.backend} at {point.tokens}: error {r.rel_error}"
            assert 0 < r.routing_excluded.median_us <= r.routing_excluded.p90_us
            assert 0 < r.achieved_fraction <= 1.05  # nothing beats a measured ceiling by much


def test_served_timings_are_captured_where_a_backend_captures_and_auto_is_timed_as_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = MoEConfig(16, 512, 256, RoutingConfig(top_k=4), quant=QuantConfig("fp8-block"))
    monkeypatch.setitem(shapes.SHAPES, "small", small)
    cuda = torch.device("cuda")
    backends = [
        b for b in ("triton", "triton-batched", "deep-gemm") if EXPERTS[b].supports(small, cuda)
    ]
    config = KernelBenchConfig(
        shapes=("small",),
        tokens=(1, 33, SYNC_FREE_TOKENS + 1),
        device=cuda,
        backends=(*backends, "auto"),
        loads=(Load.UNIFORM,),
        plan=TimingPlan(warmup=2, min_iters=5, max_iters=10, budget_s=0.01),
    )
    run = KernelBench(config, tmp_path / "gpu.json").run()
    assert run.shapes[0].auto is not None, run.shapes[0].not_run
    for point in run.points:
        rows = {r.backend: r for r in point.results}
        assert rows["triton"].correct and rows["triton"].captured.median_us > 0
        assert rows["triton"].captured_rel_error < 0.05
        if "triton-batched" in rows:  # captured up to its sync-free bound, eager above
            batched = rows["triton-batched"]
            if point.tokens <= SYNC_FREE_TOKENS:
                assert batched.captured is not None and batched.captured_rel_error < 0.05
            else:
                assert batched.captured is None
                assert "syncs with the host above" in batched.not_captured
        assert rows["auto"].correct and rows["auto"].served() is not None
        assert point.auto_served_ratio is not None and point.best_served != "auto"
        assert rows["auto"].member in rows and point.auto_beside_ratio is not None
    rule = rule_table(run)["rules"]["fp8-block/small"]
    assert rule["plan"] and "triton" in rule["captured"]


def test_tune_times_graph_replays_and_writes_tiles_that_run_on_a_small_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search's CUDA path (each candidate built, replayed from a graph, confirmed on fresh
    routings) on a decode and a prefill bucket, its rounds cut to one choice each."""
    from moe_serve.bench import tune as tuning

    monkeypatch.setattr(tuning, "_GEMM_CHOICES", ((64, 64, 4),))
    monkeypatch.setattr(tuning, "_GEMM2_CHOICES", ((128, 64, 4),))
    monkeypatch.setattr(tuning, "_DECODE_CHOICES", ((32, 4, 3),))
    monkeypatch.setattr(tuning, "_PREFILL_CHOICES", {"gemm1": ((64, 64, 4, 3),),
                                                      "gemm2": ((128, 64, 8, 4),)})  # fmt: skip
    monkeypatch.setattr(tuning, "_PER_PAIR_CHOICES", ((16, 128, 2),))
    cfg = MoEConfig(16, 512, 256, RoutingConfig(top_k=4))
    out = tmp_path / "tuned.json"
    body = tuning.tune(tuning.TuneRequest(cfg, (1, 300), out), torch.device("cuda"))
    assert set(body["buckets"]) == {"1", "300"}
    assert all(entry["us"] > 0 for entry in body["buckets"].values())
