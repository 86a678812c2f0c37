"""bench/channel_bench.py runs end to end: front-end processes through the real channel, the
engine side measured, and the module's stand-ins for CUDA registration put back."""

from __future__ import annotations

from moe_serve.bench import channel_bench
from moe_serve.service.frontends import channel_server


def test_a_short_run_answers_requests_and_restores_the_pinning() -> None:
    pin = channel_server._pin
    args = channel_bench.parse_args(
        ["--front-ends", "2", "--clients", "4", "--seconds", "0.3", "--hidden", "64"]
    )
    result = channel_bench.measure(args)
    assert result["requests_per_s"] > 0
    assert result["engine_cpu_us_per_request"] > 0
    assert channel_server._pin is pin
