"""The transport benchmark runs end to end on the CPU (no CUDA regions there) and every
transport returns the same output as binary HTTP; its targets are judged from the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.bench.schema import Environment
from moe_serve.bench.transport_bench import Check, checks, render, run

pytest.importorskip("tritonclient.grpc")

ENV = Environment(device="NVIDIA H100", device_type="cuda", commit="abc", created="2026-01-01")


@pytest.mark.slow
def test_transport_bench_times_every_transport_and_writes_json(tmp_path: Path) -> None:
    cpu = ENV.model_copy(update={"device": "cpu", "device_type": "cpu"})
    path = tmp_path / "cpu" / "transport-2026-01-01-abc.json"
    report = run(["demo"], tokens=4, requests=3, device="cpu", env=cpu, path=path)
    saved = json.loads(path.read_text())
    assert saved["layers"] == report["layers"]
    demo = report["layers"]["demo"]
    transports = demo["transports"]
    assert set(transports) == {"http-binary", "grpc", "http-system-shm", "grpc-system-shm"}
    for name, result in transports.items():
        assert result["matches_http_binary"], name
        assert 0 < result["p50_ms"] <= result["p90_ms"], name
        assert result["server_forward_ms"] > 0, name
        # the server's own times nest: handler > infer > forward (one clock; the client's
        # latency is another's, and the handler's span ends after the reply has left)
        assert result["server_handler_ms"] > result["server_infer_ms"], name
        assert result["server_infer_ms"] > result["server_forward_ms"], name
    assert set(demo["floor"]) == {"grpc", "http"}
    assert all(floor["p50_ms"] > 0 for floor in demo["floor"].values())
    assert all(floor["server_handler_ms"] > 0 for floor in demo["floor"].values())
    assert demo["bare_forward_ms"] > 0
    met = [c["met"] for c in report["checks"]]
    assert met[:2] == [None, None]  # no CUDA regions on the CPU
    assert all(isinstance(m, bool) for m in met[2:])  # system regions: judged either way
    markdown = path.with_suffix(".md").read_text()
    last = markdown.rstrip().splitlines()[-1]
    assert last.startswith(
        "| demo: grpc-system-shm p50 <= server forward + grpc no-op call + 0.75 ms | p50 "
    )


def _figures(p50_ms: float, forward_ms: float) -> dict:
    return {"p50_ms": p50_ms, "p90_ms": p50_ms, "mean_ms": p50_ms, "requests_per_s": 1e3 / p50_ms,
            "server_forward_ms": forward_ms, "matches_http_binary": True}  # fmt: skip


def _report(layers: dict) -> dict:
    """A report of `layers` as bench.transport_bench.run writes it (300 requests of 64 tokens)."""
    return {"environment": ENV.model_dump(), "tokens": 64, "requests": 300, "layers": layers}


def test_shared_memory_targets_are_p50_within_a_slack_of_the_forward_and_the_no_op_call() -> None:
    """CUDA regions: forward + the protocol's no-op call + 0.25 ms; system regions 0.5 ms more."""
    floor = {"grpc": {"p50_ms": 0.7, "mean_ms": 0.7}, "http": {"p50_ms": 0.9, "mean_ms": 0.9}}
    report = _report(
        {
            "deepseek-v3": {
                "seconds_to_ready": 60.0,
                "bare_forward_ms": 3.7,
                "bare_graphs": True,
                "transports": {
                    "http-binary": _figures(7.0, 3.8),
                    "http-cuda-shm": _figures(4.9, 3.81),
                    "grpc-cuda-shm": _figures(4.9, 3.9),
                    "http-system-shm": _figures(5.4, 3.8),
                },
                "floor": floor,
            },
            "demo": {"error": "RuntimeError: exited with 1 before ready"},
        }
    )
    found = checks(report)
    failed = "RuntimeError: exited with 1 before ready"
    assert found == [
        Check("deepseek-v3: http-cuda-shm p50 <= server forward + http no-op call + 0.25 ms",
              "p50 4.900 ms, forward 3.810 ms, no-op 0.900 ms (+0.190)", True),
        Check("deepseek-v3: grpc-cuda-shm p50 <= server forward + grpc no-op call + 0.25 ms",
              "p50 4.900 ms, forward 3.900 ms, no-op 0.700 ms (+0.300)", False),
        Check("deepseek-v3: http-system-shm p50 <= server forward + http no-op call + 0.75 ms",
              "p50 5.400 ms, forward 3.800 ms, no-op 0.900 ms (+0.700)", True),
        Check("deepseek-v3: grpc-system-shm p50 <= server forward + grpc no-op call + 0.75 ms",
              "not measured", None),
        Check("demo: http-cuda-shm p50 <= server forward + http no-op call + 0.25 ms", failed,
              None),
        Check("demo: grpc-cuda-shm p50 <= server forward + grpc no-op call + 0.25 ms", failed,
              None),
        Check("demo: http-system-shm p50 <= server forward + http no-op call + 0.75 ms", failed,
              None),
        Check("demo: grpc-system-shm p50 <= server forward + grpc no-op call + 0.75 ms", failed,
              None),
    ]  # fmt: skip
    markdown = render({**report, "checks": [c.__dict__ for c in found]})
    assert (
        "| deepseek-v3 | http-cuda-shm | 4.900 | 4.900 | 4.900 | 204 | 3.810 | 1.090 | yes |"
        in markdown
    )
    assert "- demo: FAILED: RuntimeError" in markdown
    assert markdown.rstrip().splitlines()[-7].endswith("| NO |")  # grpc-cuda-shm on deepseek-v3


def test_the_split_table_shows_client_handler_batcher_and_forward_and_the_floor() -> None:
    figures = _figures(4.0, 1.0) | {"server_handler_ms": 3.0, "server_infer_ms": 2.5}
    report = _report(
        {
            "demo": {
                "seconds_to_ready": 5.0,
                "bare_forward_ms": 0.9,
                "bare_graphs": True,
                "transports": {"grpc": figures},
                "floor": {
                    "grpc": {"p50_ms": 0.3, "mean_ms": 0.35, "server_handler_ms": 0.1},
                    "http": {"p50_ms": 0.5, "mean_ms": 0.55, "server_handler_ms": 0.12},
                },
            }
        }
    ) | {"checks": []}
    markdown = render(report)
    assert "| demo | grpc | 4.000 | 1.000 | 0.500 | 1.500 | 1.000 |" in markdown
    assert (
        "- demo: gRPC ServerLive 0.300 / 0.350 (0.100), HTTP GET /v2/health/live 0.500 / 0.550 "
        "(0.120)" in markdown
    )
