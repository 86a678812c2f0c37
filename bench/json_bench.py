"""A JSON forward's numbers read and printed on the host (orjson, `service/codecs/json_tensors.py`)
and on a GPU (`service/codecs/json_device.py`), side by side in one process, each checked to give
the other's result byte for byte: `moe-serve bench service --mode json` (needs a GPU).

The bodies (tokens x H of SHAPES: rows of 512 and 2048 where the device's fixed costs show, a
DeepSeek-V3 row, the demo layer's 64 tokens, DeepSeek-V3's 64 and 512) are what the service
benchmark sends (bf16 values as Python floats through `json.dumps`); the outputs bf16. Each
figure is the median of `--repeats` calls after two warm-ups, from the call to its result in
host memory (the device's result complete: its last step is a copy to the host).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel

from ..service.codecs import json_device, json_tensors
from .schema import Environment, write_result

log = logging.getLogger(__name__)
SHAPES = (
    (1, 512),
    (1, 2048),
    (1, 7168),
    (64, 256),
    (64, 7168),
    (512, 7168),
)  # (tokens, H) of the bodies


class JsonRow(BaseModel):
    tokens: int
    hidden: int
    body_bytes: int
    reply_bytes: int
    read_host_ms: float
    read_device_ms: float
    print_host_ms: float
    print_device_ms: float


class JsonBench(BaseModel):
    environment: Environment
    rows: list[JsonRow]


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn(), fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(tokens: int, hidden: int, repeats: int) -> JsonRow:
    generator = torch.Generator().manual_seed(tokens * hidden)
    rows = torch.randn(tokens, hidden, generator=generator).bfloat16().float().tolist()
    body = json.dumps({"hidden_states": rows}).encode()
    output = torch.randn(tokens, hidden, generator=generator).bfloat16()
    on_device = output.cuda()
    rest = {"layer": "bench", "tokens": tokens, "backend": "triton"}
    read = json_device.decode_forward(body, on_device.device)
    if read is None or not torch.equal(
        read.hidden_states.cpu(), json_tensors.decode_forward(body).hidden_states
    ):
        raise RuntimeError(f"{tokens}x{hidden}: the device read the body differently")
    reply = json_tensors.dumps({"output": output} | rest)
    if b"".join(json_device.print_reply(on_device, rest)) != reply:
        raise RuntimeError(f"{tokens}x{hidden}: the device printed the output differently")
    return JsonRow(
        tokens=tokens,
        hidden=hidden,
        body_bytes=len(body),
        reply_bytes=len(reply),
        read_host_ms=_median_ms(lambda: json_tensors.decode_forward(body), repeats),
        read_device_ms=_median_ms(
            lambda: json_device.decode_forward(body, on_device.device), repeats
        ),
        print_host_ms=_median_ms(lambda: json_tensors.dumps({"output": output} | rest), repeats),
        print_device_ms=_median_ms(lambda: json_device.print_reply(on_device, rest), repeats),
    )


def render(result: JsonBench) -> str:
    lines = [
        f"# JSON numbers on the host and on the device: {result.environment.device}, "
        f"commit {result.environment.commit}",
        "",
        "| tokens x H | body MB | read: host ms | device ms | reply MB | print: host ms "
        "| device ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result.rows:
        lines.append(
            f"| {r.tokens}x{r.hidden} | {r.body_bytes / 1e6:.2f} | {r.read_host_ms:.2f} | "
            f"{r.read_device_ms:.2f} | {r.reply_bytes / 1e6:.2f} | {r.print_host_ms:.2f} | "
            f"{r.print_device_ms:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run(repeats: int, env: Environment, path: Path) -> JsonBench:
    """Every body of SHAPES; writes `path` and its .md."""
    if not torch.cuda.is_available():
        raise ValueError("the JSON benchmark compares the host with a GPU; none is visible here")
    rows = []
    for tokens, hidden in SHAPES:
        rows.append(measure(tokens, hidden, repeats))
        log.info("%dx%d: %s", tokens, hidden, rows[-1])
    result = JsonBench(environment=env, rows=rows)
    write_result(path, result, render(result))
    return result
