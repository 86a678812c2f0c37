"""Load generators for the service benchmark, all answering with a `Load`:

- `run_hey`: several `hey` processes (a compiled Go load generator), one per body, so that
  concurrent requests carry different tokens and route differently; latencies from its CSV
  (0.1 ms resolution).
- `run_python`: bench/http_bench.py's asyncio clients in this process, where hey is absent.
- `run_one_client`: one keep-alive connection on a raw socket, request after request, timed
  with the host clock (microseconds): single-client latency, where 0.1 ms is too coarse.

Beside any of them, `SideProber` times the probes (GET /health and /v2/health/ready) from a
process of its own while the load runs (`probe`: a raw socket, no HTTP library).
"""

from __future__ import annotations

import csv
import io
import itertools
import multiprocessing
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
PROBE_PATHS = ("/health", "/v2/health/ready")
PROBE_INTERVAL_S = 0.01
PROBE_TIMEOUT_S = 1.0  # a probe unanswered this long has failed
_PROBER_START_S = 60.0  # a fresh interpreter's imports, on a busy host


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
    body: bytes | None,
    content_type: str,
    duration_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> Load:
    """One keep-alive connection, one request at a time, for `duration_s` of `clock` (one
    request at least): a POST of `body`, or a GET where it is None."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    if body is None:
        message = f"GET {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    else:
        head = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
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
    line = reader.readline()
    if not line:
        raise ConnectionResetError("the server closed the connection")
    status = int(line.split()[1])
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    reader.read(length)
    return status


@dataclass(frozen=True)
class Probes:
    """What a prober saw."""

    latencies_s: list[float] = field(repr=False)  # of the 200 answers
    failures: dict[str, int]  # "PATH STATUS", "PATH timeout" or "PATH ERROR" -> count

    @property
    def sent(self) -> int:
        return len(self.latencies_s) + sum(self.failures.values())


def probe(
    url: str,
    stopped: Callable[[float], bool],
    paths: tuple[str, ...] = PROBE_PATHS,
    interval_s: float = PROBE_INTERVAL_S,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> Probes:
    """GET each of `paths` in turn on `url`'s server, one every `interval_s`, on one keep-alive
    connection (a fresh one after a failure), until `stopped(seconds to the next probe)`, which
    waits that long, says so. A probe's latency runs from sending its request to reading the
    whole response (host clock); the connection is made outside it. The client is a raw socket
    and a buffered reader, so that the figure is the server's answer, not an HTTP library's."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests = [(p, f"GET {p} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()) for p in paths]
    latencies: list[float] = []
    failures: Counter = Counter()
    sock: socket.socket | None = None
    reader: io.BufferedReader | None = None
    due = time.perf_counter()
    for path, message in itertools.cycle(requests):
        try:
            if sock is None:
                sock = socket.create_connection((host, port), timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                reader = sock.makefile("rb")
            start = time.perf_counter()
            sock.sendall(message)
            status = _read_response(reader)
            took = time.perf_counter() - start
            if status == 200:
                latencies.append(took)
            else:
                failures[f"{path} {status}"] += 1
        except (OSError, ValueError, IndexError) as err:  # socket.timeout is an OSError
            kind = "timeout" if isinstance(err, TimeoutError) else type(err).__name__
            failures[f"{path} {kind}"] += 1
            if sock is not None:
                sock.close()
            sock = reader = None
        now = time.perf_counter()
        due = max(due + interval_s, now)  # late: the next one now, no burst to catch up
        if stopped(due - now):
            break
    if sock is not None:
        sock.close()
    return Probes(latencies, dict(failures))


def _probe_until_set(url: str, started, stop, sender) -> None:
    started.set()
    sender.send(probe(url, stop.wait))


class SideProber:
    """`probe` in a process of its own (not the load generator's, whose clients may share this
    one's interpreter) for as long as the block runs; `probes` is what it saw."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.probes: Probes | None = None

    def __enter__(self) -> SideProber:
        context = multiprocessing.get_context("spawn")  # no fork of a process holding threads
        self._stop = context.Event()
        started = context.Event()
        self._receiver, sender = context.Pipe(duplex=False)
        self._proc = context.Process(
            target=_probe_until_set, args=(self.url, started, self._stop, sender), daemon=True
        )
        self._proc.start()
        sender.close()
        if not started.wait(_PROBER_START_S):
            self._proc.kill()
            raise TimeoutError(f"the prober did not start in {_PROBER_START_S:.0f} s")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            if self._receiver.poll(_PROBER_START_S):
                self.probes = self._receiver.recv()
        except EOFError:  # the prober died: no figures
            pass
        finally:
            self._receiver.close()
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
