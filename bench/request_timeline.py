"""One client's requests on a timeline made of the spans the service records:
`moe-serve bench service --mode timeline`. When, after the client starts sending, each span of
a request begins (`>`) and ends (`<`), medians over the requests.

Each layer is served by bench/service_server.py in one process with `--spans`: the service
records its OpenTelemetry spans (service/tracing.py) and the benchmark takes them from
`GET /bench/spans`. A lean keep-alive client sends one bf16 request at a time (safetensors, or
JSON), GAP_S apart, and notes on the clock the spans carry (time.time_ns): `~sent` (its sendall
returned), `~first byte` and `~done`. One request at a time, so requests and traces pair in
order. A span is labelled by its name without the route: `request` (the server span),
`http receive`, `http send`, `queue`, `forward`, numbered where a request has several of a name
(`http send 2`). Where `--mode path` times each level alone, this shows how one request's time
falls between them; the spans cost microseconds each, so compare timelines with each other and
latencies with `--mode load`.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
import safetensors.torch
import torch

from .request_path import server_command
from .schema import Environment, write_result
from .service_bench import _free_port, http_ready, process

ROUTE = "POST /v1/layers/{name}/forward"  # the forward's server span, as FastAPI names it
WARMUP = 20  # requests sent before the timed ones, left out of the medians
GAP_S = 0.001  # between one request's answer and the next request
CLIENT = ("~sent", "~first byte", "~done")


@dataclass(frozen=True)
class Sent:
    """One request as the client saw it, time.time_ns() stamps."""

    start: int
    sent: int
    first_byte: int
    done: int


def _client(port: int, path: str, body: bytes, media: str, count: int) -> list[Sent]:
    """`count` requests, one at a time on one keep-alive connection."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {media}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    message, sent = head + body, []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            start = time.time_ns()
            sock.sendall(message)
            written = time.time_ns()
            data = sock.recv(1 << 20)
            first = time.time_ns()
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
            sent.append(Sent(start, written, first, time.time_ns()))
            time.sleep(GAP_S)
    return sent


def label(name: str) -> str:
    """A span's name without the forward's route: `request` for the server span itself."""
    if name == ROUTE:
        return "request"
    return name.removeprefix(ROUTE + " ")


def traces(spans: Iterable[dict]) -> list[dict[str, tuple[int, int]]]:
    """Spans ({trace, name, start_ns, end_ns}) -> per request with a server span, in the order
    the requests came, label -> (start, end); a name seen again gets its count (`http send 2`)."""
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace"]].append(span)
    found = []
    for members in by_trace.values():
        root = [s for s in members if s["name"] == ROUTE]
        if len(root) != 1:
            continue  # not a forward request (a probe, the /bench routes)
        seen: Counter = Counter()
        labelled = {}
        for span in sorted(members, key=lambda s: (s["start_ns"], s["name"])):
            name = label(span["name"])
            seen[name] += 1
            key = name if seen[name] == 1 else f"{name} {seen[name]}"
            labelled[key] = (span["start_ns"], span["end_ns"])
        found.append((root[0]["start_ns"], labelled))
    return [labelled for _, labelled in sorted(found, key=lambda pair: pair[0])]


def timeline(sent: list[Sent], requests: list[dict[str, tuple[int, int]]]) -> list[dict]:
    """Per point (`label>`, `label<`, the client's), the median of its offset from each
    request's start, in us, over the requests after the first WARMUP; sorted by median."""
    if len(sent) != len(requests):
        raise ValueError(f"{len(sent)} requests sent but {len(requests)} traced")
    offsets: dict[str, list[float]] = defaultdict(list)
    for client, spans in list(zip(sent, requests, strict=True))[WARMUP:]:
        points = dict(zip(CLIENT, (client.sent, client.first_byte, client.done), strict=True))
        for name, (start, end) in spans.items():
            points[f"{name}>"], points[f"{name}<"] = start, end
        for point, ns in points.items():
            offsets[point].append((ns - client.start) / 1e3)
    rows = [
        {"label": point, "median_us": statistics.median(v), "requests": len(v)}
        for point, v in offsets.items()
    ]
    return sorted(rows, key=lambda row: (row["median_us"], row["label"]))


def _body(hidden: torch.Tensor, kind: str) -> tuple[bytes, str]:
    """`hidden` [T, H] bf16 as a forward's body of `kind` (binary or json) and its media type;
    JSON as the service benchmark writes it (bench/service_bench.py: Python's json module)."""
    if kind == "json":
        return json.dumps({"hidden_states": hidden.float().tolist()}).encode(), "application/json"
    return safetensors.torch.save({"hidden_states": hidden}), "application/octet-stream"


def measure(
    layer: str, tokens: list[int], requests: int, body: str, shared: int, logs: Path
) -> list[dict]:
    """The layer served in one process with spans kept: a timeline per token count."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*server_command(layer, port, 0, shared), "--spans"]
    results = []
    with process(command, logs / f"timeline-{layer}.log", http_ready(url), 600):
        hidden = httpx.get(f"{url}/v1/layers/{layer}").json()["hidden_size"]
        for t in tokens:
            data, media = _body(torch.randn(t, hidden).bfloat16(), body)
            httpx.get(f"{url}/bench/spans")  # forget the spans of what came before
            sent = _client(port, f"/v1/layers/{layer}/forward", data, media, requests + WARMUP)
            spans = httpx.get(f"{url}/bench/spans", timeout=60).json()
            results.append({"layer": layer, "tokens": t, "body": body,
                            "timeline": timeline(sent, traces(spans))})  # fmt: skip
    return results


def render(result: dict) -> str:
    env = Environment.model_validate(result["environment"])
    lines = [f"# One request's spans: {env.device}, commit {env.commit}", ""]
    for run in result["runs"]:
        lines += [f"## {run['layer']}, {run['tokens']} tokens, {run['body']}", "",
                  "| us after the client starts sending | point |", "| ---: | --- |"]  # fmt: skip
        lines += [f"| {row['median_us']:,.0f} | {row['label']} |" for row in run["timeline"]]
        lines.append("")
    return "\n".join(lines)


def run(
    layers: list[str],
    tokens: int,
    requests: int,
    body: str,
    shared: int,
    env: Environment,
    path: Path,
) -> dict:
    """Each layer at one token and at `tokens`; writes `path` and its .md."""
    runs = []
    logs = path.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    for layer in layers:
        runs += measure(layer, sorted({1, tokens}), requests, body, shared, logs)
    result = {"environment": env.model_dump(), "runs": runs}
    write_result(path, result, render(result))
    return result
