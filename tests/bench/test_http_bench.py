"""The HTTP load generator: its pure parts, and a short bounded run against the real service
on a free 127.0.0.1 port with the tiny layers."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client import generate_latest

from moe_serve.bench.http_bench import (
    BATCH_TOKENS,
    FORWARD_SECONDS,
    HttpBenchConfig,
    mean_delta,
    metric_totals,
    percentiles_ms,
    run_http_bench,
    split,
)
from moe_serve.service.cli import main
from moe_serve.service.engine.interface import StageTimes
from moe_serve.service.http.app import create_app
from moe_serve.service.metrics import Metrics
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import TINY, running_server, tiny_loader


def test_percentiles_of_a_hundred_latencies() -> None:
    p50, p90, p99 = percentiles_ms([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert p50 == pytest.approx(50.5)
    assert p90 == pytest.approx(90.1)
    assert p99 == pytest.approx(99.01)
    assert percentiles_ms([]) == (None, None, None)


def test_server_forward_time_is_the_mean_of_the_observations_between_two_scrapes() -> None:
    metrics = Metrics()
    counts = torch.zeros(4, dtype=torch.int64)
    metrics.record_batch("a", "ref", 4, counts, StageTimes(0.010))
    metrics.record_batch("b", "ref", 4, counts, StageTimes(5.0))  # another layer: not counted
    before = metric_totals(generate_latest(metrics.registry).decode(), "a")
    metrics.record_batch("a", "ref", 2, counts, StageTimes(0.002))
    metrics.record_batch("a", "ref", 2, counts, StageTimes(0.004))
    after = metric_totals(generate_latest(metrics.registry).decode(), "a")
    assert mean_delta(before, after, FORWARD_SECONDS) == pytest.approx(0.003)
    assert mean_delta(before, after, BATCH_TOKENS) == pytest.approx(2)
    assert mean_delta(after, after, FORWARD_SECONDS) is None


def test_split_spreads_clients_and_budgets_evenly_over_processes() -> None:
    assert split(10, 4) == [3, 3, 2, 2]
    assert split(1, 4) == [1]  # no idle process for a single client
    assert split(256, 8) == [32] * 8


def test_config_refuses_a_url_without_scheme() -> None:
    with pytest.raises(ValueError, match="--url must be http"):
        HttpBenchConfig(url="127.0.0.1:8000", layer=TINY)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("MOE_SERVE_")]:
            mp.delenv(name)  # a developer's token or limits must not change the server
        settings = Settings(device="cpu", log_level="warning", grpc_port=0)
        app = create_app(settings, tiny_loader)
    with running_server(app) as url:
        wait_ready(lambda path: httpx.get(url + path))
        yield url


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bounded_run_against_the_service_reports_throughput_latency_and_forward_time(
    server_url: str, binary: bool
) -> None:
    # each level ended by its request budget, not a short duration: on a loaded machine a level
    # of a fraction of a second may end before its clients have sent anything
    config = HttpBenchConfig(
        url=server_url, layer=TINY, tokens=4, concurrency=(1, 4), duration_s=30, max_requests=8,
        binary=binary,
    )  # fmt: skip
    report = run_http_bench(config)
    assert [lv.concurrency for lv in report.levels] == [1, 4]
    for level in report.levels:
        assert level.errors == 0 and level.requests == 8
        assert level.requests_per_s > 0 and level.tokens_per_s == pytest.approx(
            4 * level.requests_per_s
        )
        assert 0 < level.p50_ms <= level.p90_ms <= level.p99_ms
        assert 0 < level.server_forward_ms < level.p99_ms
        assert level.server_batch_tokens >= 4


def test_request_count_bound_stops_a_level_early(server_url: str) -> None:
    config = HttpBenchConfig(
        url=server_url, layer=TINY, tokens=2, concurrency=(3,), duration_s=30, max_requests=5
    )
    (level,) = run_http_bench(config).levels
    assert level.requests + level.errors == 5  # not 30 s of requests


def test_clients_spread_over_two_processes_are_merged_into_one_level(server_url: str) -> None:
    # Ended by its request budget, not a short duration: on a loaded machine the spawned
    # client processes may start late and a first request may take longer than a short level.
    config = HttpBenchConfig(
        url=server_url, layer=TINY, tokens=2, concurrency=(4,), duration_s=30, processes=2,
        max_requests=8,
    )  # fmt: skip
    report = run_http_bench(config)
    (level,) = report.levels
    assert report.processes == 2
    assert level.errors == 0 and level.requests == 8


def test_unknown_layer_is_an_error_naming_it(server_url: str) -> None:
    config = HttpBenchConfig(url=server_url, layer="nope", concurrency=(1,), duration_s=0.1)
    with pytest.raises(ValueError, match="/v1/layers/nope answered 404"):
        run_http_bench(config)


def test_http_mode_writes_its_report(server_url: str, tmp_path: Path) -> None:
    args = ["bench", "service", "--mode", "http", "--url", server_url, "--layers", TINY]
    level = ["--tokens", "2", "--clients", "2", "--max-requests", "2", "--processes", "1"]
    assert main([*args, *level, "--out", str(tmp_path), "--commit", "test"]) == 0
    (path,) = tmp_path.glob("*/http-*-test.json")
    report = json.loads(path.read_text())["layers"][TINY]
    assert report["body"] == "binary" and report["levels"][0]["requests"] == 2
    assert f"## {TINY}" in path.with_suffix(".md").read_text()
