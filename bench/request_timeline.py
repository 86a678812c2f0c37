"""A one-client request's timeline across the client, the front-end processes and the engine:
when, after the client starts sending, each function of the server's path is entered (`>`) and
left (`<`), medians over the requests (issue 16, target 1).

    python -m bench.request_timeline --out DIR [--layers demo,deepseek-v3] [--tokens 1,64]
        [--front-ends 8] [--requests 200] [--body binary|json]

Each layer is served by bench/service_server.py in one process and behind `--front-ends`
processes, with bench/timeline_site/ on PYTHONPATH: its sitecustomize wraps the path's
functions in every server process to stamp the shared monotonic clock (the list of points is
there). A lean keep-alive client sends one bf16 request at a time (binary, or JSON with
`--body json`; 1 ms apart) and stamps
the same clock: `~sent` (its sendall returned), `~first byte`, `~done`. Where bench/request_path.py
times each level alone, this shows the gaps between them (thread hops, process hops, the event
loop's turns). The stamps cost a few microseconds each: compare timelines with each other, and
latencies with the service benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import safetensors.torch
import torch

from .request_path import add_arguments, server_command
from .service_bench import _free_port, http_ready, process

SITE = Path(__file__).parent / "timeline_site"
_WARMUP = 20
_GAP_S = 0.001


def _client(
    port: int, path: str, body: bytes, media: str, count: int
) -> list[tuple[int, int, int, int]]:
    """`count` requests -> (start, sent, first byte, done) perf_counter_ns of each."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {media}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    message, times = head + body, []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            start = time.perf_counter_ns()
            sock.sendall(message)
            sent = time.perf_counter_ns()
            data = sock.recv(1 << 20)
            first = time.perf_counter_ns()
            while b"\r\n\r\n" not in data:
                data += sock.recv(1 << 20)
            head_bytes, rest = data.split(b"\r\n\r\n", 1)
            if not head_bytes.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the server answered {head_bytes[:200]!r}")
            length = next(
                int(line.split(b":")[1])
                for line in head_bytes.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(rest) < length:
                rest += sock.recv(1 << 20)
            times.append((start, sent, first, time.perf_counter_ns()))
            time.sleep(_GAP_S)
    return times


def _read_stamps(directory: Path) -> tuple[list[tuple[int, str]], set[str]]:
    stamps, missing = [], set()
    for path in directory.glob("stamps-*.txt"):
        for line in path.read_text().splitlines():
            ns, label = line.split()
            if label.startswith("missing:"):
                missing.add(label.removeprefix("missing:"))
            else:
                stamps.append((int(ns), label))
    return sorted(stamps), missing


def timeline(times: list[tuple[int, int, int, int]], stamps: list[tuple[int, str]]) -> list[dict]:
    """Per label, the median of its first stamp's offset from each request's start (us)."""
    offsets: dict[str, list[float]] = defaultdict(list)
    at = 0
    for start, sent, first, done in times[_WARMUP:]:
        while at < len(stamps) and stamps[at][0] < start:
            at += 1
        seen: dict[str, int] = {}
        for ns, label in stamps[at:]:
            if ns > done:
                break
            seen.setdefault(label, ns)
        client = {"~sent": sent, "~first byte": first, "~done": done}
        for label, ns in (seen | client).items():
            offsets[label].append((ns - start) / 1e3)
    rows = [
        {"label": label, "median_us": statistics.median(v), "requests": len(v)}
        for label, v in offsets.items()
    ]
    return sorted(rows, key=lambda row: row["median_us"])


def _body(hidden: torch.Tensor, kind: str) -> tuple[bytes, str]:
    """`hidden` [T, H] bf16 as a forward's body of `kind` (binary or json) and its media type;
    JSON as the service benchmark writes it (bench/service_bench.py: Python's json module)."""
    if kind == "json":
        return json.dumps({"hidden_states": hidden.float().tolist()}).encode(), "application/json"
    return safetensors.torch.save({"hidden_states": hidden}), "application/octet-stream"


def measure(
    layer: str, tokens: list[int], args: argparse.Namespace, work: Path
) -> tuple[list[dict], set[str]]:
    results, missing = [], set()
    for workers in sorted({0, args.front_ends}):
        stamps_dir = work / f"{layer}-{workers}"
        stamps_dir.mkdir()
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        command = server_command(layer, port, workers, args.shared_intermediate)
        python_path = [str(SITE), os.getcwd(), os.environ.get("PYTHONPATH")]
        env = os.environ | {"MOE_SERVE_TIMELINE_DIR": str(stamps_dir),
                            "PYTHONPATH": os.pathsep.join(filter(None, python_path))}  # fmt: skip
        log = args.out / f"timeline-{layer}-{workers}.log"
        with process(command, log, http_ready(url), 600, env=env):
            hidden = httpx.get(f"{url}/v1/layers/{layer}").json()["hidden_size"]
            for t in tokens:
                body, media = _body(torch.randn(t, hidden).bfloat16(), args.body)
                for stamps_file in stamps_dir.glob("stamps-*.txt"):
                    stamps_file.write_text("")
                forward = f"/v1/layers/{layer}/forward"
                times = _client(port, forward, body, media, args.requests + _WARMUP)
                stamps, gone = _read_stamps(stamps_dir)
                missing |= gone
                results.append({"layer": layer, "front_ends": workers, "tokens": t,
                                "body": args.body,
                                "timeline": timeline(times, stamps)})  # fmt: skip
    return results, missing


def render(results: list[dict], missing: set[str]) -> str:
    lines = []
    for run in results:
        title = (
            f"{run['layer']}, {run['tokens']} tokens, {run['body']}, {run['front_ends']} front ends"
        )
        lines += [f"## {title}", "",
                  "| us after the client starts sending | point |", "| ---: | --- |"]  # fmt: skip
        lines += [f"| {row['median_us']:,.0f} | {row['label']} |" for row in run["timeline"]]
        lines.append("")
    if missing:
        lines.append(f"Points not found (renamed?): {', '.join(sorted(missing))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--front-ends", type=int, default=8, help="0: one process only")
    parser.add_argument("--requests", type=int, default=200, help="timed, after 20 warm-up")
    parser.add_argument("--body", choices=("binary", "json"), default="binary",
                        help="the requests' body: bf16 safetensors or JSON")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    results, missing = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for layer in args.layers.split(","):
            runs, gone = measure(layer, tokens, args, Path(tmp))
            results += runs
            missing |= gone
    (args.out / "timeline.json").write_text(
        json.dumps({"runs": results, "missing": sorted(missing)}, indent=1)
    )
    text = render(results, missing)
    (args.out / "timeline.md").write_text(text)
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
