"""A JSON forward's numbers read and printed on the host (orjson, `service/codecs/json_tensors.py`)
and on a GPU (`service/codecs/json_device.py`), side by side in one process, each checked to give
the other's result byte for byte.

    python -m bench.json_bench --out DIR [--shapes 1x7168,64x256,64x7168,512x7168] [--commit C]

The bodies are what the service benchmark sends (bf16 values as Python floats through
`json.dumps`); the outputs bf16. Each figure is the median of `--repeats` calls after two
warm-ups, from the call to its result in host memory (the device's result complete: its last
step is a copy to the host). Writes DIR/json-bench.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import BaseModel

from ..service.codecs import json_device, json_tensors
from .environment import capture
from .schema import Environment

log = logging.getLogger("bench.json")


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
        raise SystemExit(f"{tokens}x{hidden}: the device read the body differently")
    reply = json_tensors.dumps({"output": output} | rest)
    if json_device.print_reply(on_device, rest) != reply:
        raise SystemExit(f"{tokens}x{hidden}: the device printed the output differently")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="1x7168,64x256,64x7168,512x7168")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--commit", help="the commit measured (default: what git says)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("moe_serve.bench.json_bench needs a GPU")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = []
    for tokens, hidden in shapes:
        rows.append(measure(tokens, hidden, args.repeats))
        log.info("%dx%d: %s", tokens, hidden, rows[-1])
    result = JsonBench(environment=capture(torch.device("cuda"), args.commit), rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "json-bench.json").write_text(result.model_dump_json(indent=1))
    (args.out / "json-bench.md").write_text(render(result))
    log.info("%s", render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
