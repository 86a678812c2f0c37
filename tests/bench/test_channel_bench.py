"""`moe-serve bench service --mode channel` runs end to end: front-end processes through the real
channel, the engine side measured, and the module's stand-ins for CUDA registration put back."""

from __future__ import annotations

import json
from pathlib import Path

from moe_serve.bench import channel_bench
from moe_serve.service.cli import main
from moe_serve.service.frontends import channel_server


def test_a_short_run_answers_requests_and_restores_the_pinning() -> None:
    pin = channel_server._pin
    load = channel_bench.ChannelLoad(front_ends=2, clients=4, seconds=0.3, tokens=64, hidden=64)
    result = channel_bench.measure(load)
    assert result["requests_per_s"] > 0
    assert result["engine_cpu_us_per_request"] > 0
    assert channel_server._pin is pin


def test_the_channel_mode_writes_a_row_per_layer_and_level(tmp_path: Path) -> None:
    argv = ["bench", "service", "--mode", "channel", "--layers", "tiny", "--clients", "2,4"]
    argv += ["--front-ends", "2", "--duration", "0.2", "--out", str(tmp_path), "--commit", "test"]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu/channel-*-test.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["clients"], r["hidden"]) for r in rows] == [(2, 64), (4, 64)]
    assert all(r["requests_per_s"] > 0 for r in rows)
    assert "| 2 | 4 | 64x64 |" in path.with_suffix(".md").read_text()
