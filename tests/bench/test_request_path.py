"""bench/request_path.py's in-process levels on the CPU (a GPU adds the device and pinned ones)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from moe_serve.bench import request_path
from moe_serve.service.engine.batcher import BatchPolicy, DynamicBatcher
from moe_serve.service.engine.engine import Engine
from moe_serve.service.metrics import Metrics
from tests.service.layers import TINY, tiny_layers


def test_each_level_runs_the_servers_own_path_and_is_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(request_path, "_BUDGET_S", 0.0)
    monkeypatch.setattr(request_path, "_MIN_CALLS", 3)
    engine = Engine([torch.device("cpu")], "reference")
    engine.add(tiny_layers()[0])
    submitted = []

    async def run() -> list[dict]:
        batcher = DynamicBatcher(engine, BatchPolicy(64, 0.0, 16), Metrics())
        submit = batcher.submit
        batcher.submit = lambda *a, **k: submitted.append(a[0]) or submit(*a, **k)
        batcher.start()
        try:
            runtime = SimpleNamespace(engine=engine, batcher=batcher, metrics=batcher.metrics)
            return await request_path.time_levels(runtime, [1, 3])
        finally:
            await batcher.close()

    rows = asyncio.run(run())
    assert [(r["tokens"], r["level"]) for r in rows] == [
        (t, level) for t in (1, 3) for level in ("engine", "batcher", "blob")
    ]
    assert all(0 < r["median_us"] <= r["p90_us"] for r in rows)
    assert set(submitted) == {TINY}  # the batcher and blob levels went through the batcher
