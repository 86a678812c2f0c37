"""The transport benchmark runs end to end on the CPU (no CUDA regions there) and every
transport returns the same output as binary HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.transport_bench import run

pytest.importorskip("tritonclient.grpc")


@pytest.mark.slow
def test_transport_bench_times_every_transport_and_writes_json(tmp_path: Path) -> None:
    report = run(tmp_path, tokens=4, requests=3, device="cpu")
    assert json.loads((tmp_path / "transport-bench.json").read_text()) == report
    transports = report["transports"]
    assert set(transports) == {"http-binary", "grpc", "http-system-shm", "grpc-system-shm"}
    for name, result in transports.items():
        assert result["matches_http_binary"], name
        assert 0 < result["p50_ms"] <= result["p90_ms"], name
        assert result["server_forward_ms"] > 0, name
