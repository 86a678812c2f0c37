"""Load generators for the service benchmark, all answering with a `Load`:

- `run_hey`: several `hey` processes (a compiled Go load generator), one per body, so that
  concurrent requests carry different tokens and route differently; latencies from its CSV
  (0.1 ms resolution).
- `run_python`: bench/http_bench.py's asyncio clients in this process, where hey is absent.
- `run_one_client`: one keep-alive connection on a raw socket, request after request, timed
  with the host clock (microseconds): single-client latency, where 0.1 ms is too coarse.
"""

from __future__ import annotations

import csv
import io
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .http_bench import ClientShare, Request, drive, percentiles_ms, split

_HEY_TIMEOUT_S = 30  # per request


@dataclass(frozen=True)
class Load:
    """What one load level saw."""

    clients: int
    elapsed_s: float
    latencies_s: list[float] = field(repr=False)  # of the 200 answers
    errors: dict[str, int]  # HTTP status or error kind -> count
    generator: str  # hey, python or one-client

    @property
    def ok(self) -> int:
        return len(self.latencies_s)

    @property
    def rate(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def percentiles_ms(self) -> tuple[float | None, float | None, float | None]:
        return percentiles_ms(self.latencies_s)


def hey_binary() -> str | None:
    return shutil.which("hey")


def parse_hey_csv(text: str) -> tuple[list[float], Counter, float]:
    """hey's `-o csv` -> (latencies of 200s, other statuses, seconds from start to last end)."""
    latencies, errors, end = [], Counter(), 0.0
    for row in csv.DictReader(io.StringIO(text)):
        seconds = float(row["response-time"])
        end = max(end, float(row["offset"]) + seconds)
        if row["status-code"] == "200":
            latencies.append(seconds)
        else:
            errors[row["status-code"]] += 1
    return latencies, errors, end


def run_hey(
    url: str, bodies: list[Path], content_type: str, clients: int, duration_s: float
) -> Load:
    """`clients` connections spread over one hey process per body (fewer if fewer clients)."""
    hey = hey_binary()
    if hey is None:
        raise FileNotFoundError("hey is not on PATH")
    shares = split(clients, len(bodies))
    procs = []
    for share, body in zip(shares, bodies, strict=False):
        command = [hey, "-z", f"{duration_s}s", "-c", str(share), "-m", "POST",
                   "-T", content_type, "-D", str(body), "-t", str(_HEY_TIMEOUT_S),
                   "-o", "csv", url]  # fmt: skip
        procs.append(
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    finished = []
    for proc in procs:
        out, err = proc.communicate(timeout=duration_s + _HEY_TIMEOUT_S + 30)
        finished.append((proc.returncode, out, err))
    return hey_load(clients, finished)


def hey_load(clients: int, finished: list[tuple[int, str, str]]) -> Load:
    """The hey processes' (exit status, CSV, stderr) as one level: their answers together, the
    level's time that of the one that ended last."""
    latencies: list[float] = []
    errors: Counter = Counter()
    elapsed = 0.0
    for returncode, out, err in finished:
        if returncode != 0:
            errors[f"hey exit {returncode}: {err.strip()[:200]}"] += 1
            continue
        got, bad, end = parse_hey_csv(out)
        latencies += got
        errors += bad
        elapsed = max(elapsed, end)
    return Load(clients, elapsed, latencies, dict(errors), "hey")


def run_python(url: str, body: bytes, content_type: str, clients: int, duration_s: float) -> Load:
    """bench/http_bench.py's asyncio clients, all in this process, all sending `body`."""
    parts = urlsplit(url)
    share = ClientShare(
        f"{parts.scheme}://{parts.netloc}",
        Request(parts.path, body, content_type),
        clients,
        time.time(),
        duration_s,
        1_000_000,
        _HEY_TIMEOUT_S,
    )
    tally = drive(share)
    elapsed = max(tally.last_done - tally.first_start, 1e-9)
    return Load(clients, elapsed, tally.latencies_s, dict(tally.errors), "python")


def run_one_client(
    url: str,
    body: bytes,
    content_type: str,
    duration_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> Load:
    """One keep-alive connection, one request at a time, for `duration_s` of `clock` (one
    request at least)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    message = head + body
    latencies: list[float] = []
    errors: Counter = Counter()
    with socket.create_connection((host, port), timeout=_HEY_TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        begin = clock()
        deadline = begin + duration_s
        while True:  # at least one request, however late it starts
            start = clock()
            sock.sendall(message)
            status = _read_response(reader)
            if status == 200:
                latencies.append(clock() - start)
            else:
                errors[str(status)] += 1
            if clock() >= deadline:
                break
        elapsed = clock() - begin
    return Load(1, elapsed, latencies, dict(errors), "one-client")


def _read_response(reader: io.BufferedReader) -> int:
    """Read one HTTP/1.1 response with a Content-Length body; its status."""
    status = int(reader.readline().split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    reader.read(length)
    return status
