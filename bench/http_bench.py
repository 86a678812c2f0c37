"""`moe-serve bench service --mode http`: an async load generator for one layer's forward route.

At each concurrency level, that many clients (asyncio tasks, spread over `processes` client
processes) post the same request back to back until the level's duration or request count runs
out; each in-flight request is bounded by its timeout, so a level ends within duration +
timeout. Latency percentiles are over successful requests. The server's own mean forward time
and batch size over the level come from the difference of two /metrics scrapes, which shows how
much of the latency is HTTP, queueing and batching.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections import Counter
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

FORWARD_SECONDS = "moe_serve_forward_seconds"  # service.metrics: device time of one batch
BATCH_TOKENS = "moe_serve_batch_tokens"  # service.metrics: tokens per forward batch
_GRACE_S = 5.0  # slack on top of duration + timeout before a level is cut off
_START_SLACK_S = 0.3  # time for the client processes to receive their share before the start


@dataclass(frozen=True)
class HttpBenchConfig:
    url: str
    layer: str
    tokens: int = 64  # per request
    concurrency: tuple[int, ...] = (1, 16, 64, 256)
    duration_s: float = 20.0  # per level
    max_requests: int = 100_000  # per level
    binary: bool = True  # safetensors body; False: JSON
    timeout_s: float = 30.0  # per request
    processes: int = 1  # client processes the clients are spread over

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--url must be http(s)://host[:port], got {self.url!r}")
        for name in ("tokens", "max_requests", "processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.duration_s <= 0 or self.timeout_s <= 0:
            raise ValueError("duration and timeout must be positive")


class LevelResult(BaseModel):
    concurrency: int
    requests: int  # answered 200
    errors: int
    error_kinds: dict[str, int]  # HTTP status or exception name -> count
    elapsed_s: float
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    server_forward_ms: float | None  # mean device time of one forward batch, from /metrics
    server_batch_tokens: float | None  # mean tokens per forward batch, from /metrics


class HttpReport(BaseModel):
    url: str
    layer: str
    backend: str
    tokens: int
    body: str  # "binary" or "json"
    processes: int  # client processes
    levels: list[LevelResult]

    def table(self) -> str:
        head = (
            "| clients | ok | errors | req/s | tokens/s | p50 ms | p90 ms | p99 ms "
            "| server forward ms | tokens/forward |"
        )
        lines = [head, "|" + " --- |" * 10]

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        for lv in self.levels:
            tokens = "-" if lv.server_batch_tokens is None else f"{lv.server_batch_tokens:.0f}"
            lines.append(
                f"| {lv.concurrency} | {lv.requests} | {lv.errors} | {lv.requests_per_s:.1f} "
                f"| {lv.tokens_per_s:,.0f} | {ms(lv.p50_ms)} | {ms(lv.p90_ms)} | {ms(lv.p99_ms)} "
                f"| {ms(lv.server_forward_ms)} | {tokens} |"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes
    content_type: str


def make_request(config: HttpBenchConfig, hidden_size: int, dtype: str) -> Request:
    """One random [tokens, H] request, encoded once: the clients resend the same bytes."""
    # imported here: spawned client processes import this module and need neither
    import safetensors.torch
    import torch

    hidden = torch.randn(config.tokens, hidden_size)
    path = f"/v1/layers/{config.layer}/forward"
    if config.binary:
        wire = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        blob = safetensors.torch.save({"hidden_states": hidden.to(wire).contiguous()})
        return Request(path, blob, "application/octet-stream")
    body = json.dumps({"hidden_states": hidden.tolist()}).encode()
    return Request(path, body, "application/json")


def percentiles_ms(samples_s: list[float]) -> tuple[float | None, float | None, float | None]:
    """(p50, p90, p99) in milliseconds; None without samples."""
    if not samples_s:
        return None, None, None
    if len(samples_s) == 1:
        return (samples_s[0] * 1e3,) * 3
    q = statistics.quantiles(samples_s, n=100, method="inclusive")
    return q[49] * 1e3, q[89] * 1e3, q[98] * 1e3


def metric_totals(text: str, layer: str) -> dict[str, float]:
    """Sum of each histogram's _sum and _count samples for `layer`, from Prometheus text."""
    wanted = {f"{m}_{part}" for m in (FORWARD_SECONDS, BATCH_TOKENS) for part in ("sum", "count")}
    totals = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and sample.labels.get("layer") == layer:
                totals[sample.name] += sample.value
    return totals


def mean_delta(before: dict[str, float], after: dict[str, float], metric: str) -> float | None:
    """Mean of the observations a histogram got between two scrapes; None if it got none."""
    count = after[f"{metric}_count"] - before[f"{metric}_count"]
    if count <= 0:
        return None
    return (after[f"{metric}_sum"] - before[f"{metric}_sum"]) / count


@dataclass(frozen=True)
class ClientShare:
    """What one client process runs: `clients` loops posting `request` for `duration_s`."""

    url: str
    request: Request
    clients: int
    start_at: float  # wall-clock time.time() at which every process starts sending
    duration_s: float
    max_requests: int
    timeout_s: float


@dataclass
class Tally:
    """What the clients of one process saw; wall-clock stamps so processes can be merged."""

    budget: int
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    first_start: float = float("inf")
    last_done: float = 0.0


async def _client(http: httpx.AsyncClient, request: Request, deadline: float, tally: Tally) -> None:
    """Requests one after another while the budget lasts, until the deadline: at least one, so
    that a level whose clients start late (a loaded host) still measures."""
    headers = {"content-type": request.content_type}
    while tally.budget > 0:
        tally.budget -= 1  # one event loop per process: no lock needed
        start = time.perf_counter()
        try:
            response = await http.post(request.path, content=request.body, headers=headers)
            kind = None if response.status_code == 200 else str(response.status_code)
        except httpx.HTTPError as err:
            kind = type(err).__name__
        if kind is None:
            tally.latencies_s.append(time.perf_counter() - start)
        else:
            tally.errors[kind] += 1
        tally.last_done = time.time()
        if time.monotonic() >= deadline:
            break


async def _drive(share: ClientShare) -> Tally:
    limits = httpx.Limits(max_connections=share.clients, max_keepalive_connections=None)
    await asyncio.sleep(max(0.0, share.start_at - time.time()))
    tally = Tally(budget=share.max_requests, first_start=time.time())
    deadline = time.monotonic() + share.duration_s
    async with (
        httpx.AsyncClient(base_url=share.url, timeout=share.timeout_s, limits=limits) as http,
        asyncio.timeout(share.duration_s + share.timeout_s + _GRACE_S),
    ):
        await asyncio.gather(
            *(_client(http, share.request, deadline, tally) for _ in range(share.clients))
        )
    return tally


def drive(share: ClientShare) -> Tally:
    """Run one process's clients to the end (the entry point of each client process)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(_drive(share))


def _started(_: int) -> None:
    """A task that keeps a pool worker busy a moment, so that every worker gets spawned."""
    time.sleep(0.2)


def split(total: int, parts: int) -> list[int]:
    """`total` as `parts` near-equal positive shares (fewer parts when total is smaller)."""
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def _scrape(http: httpx.Client, layer: str) -> dict[str, float] | None:
    try:
        response = http.get("/metrics")
    except httpx.HTTPError:
        return None
    return metric_totals(response.text, layer) if response.status_code == 200 else None


def run_level(
    http: httpx.Client,
    request: Request,
    config: HttpBenchConfig,
    concurrency: int,
    pool: Executor | None,
) -> LevelResult:
    """One concurrency level, its clients spread over the pool's processes (or run here)."""
    clients = split(concurrency, config.processes)
    budgets = split(config.max_requests, len(clients))
    start_at = time.time() + (_START_SLACK_S if pool is not None else 0.0)
    shares = [
        ClientShare(config.url, request, c, start_at, config.duration_s, budget, config.timeout_s)
        for c, budget in zip(clients, budgets, strict=True)
    ]
    before = _scrape(http, config.layer)
    tallies = [drive(shares[0])] if pool is None else list(pool.map(drive, shares))
    after = _scrape(http, config.layer)
    latencies = [t for tally in tallies for t in tally.latencies_s]
    errors = sum((tally.errors for tally in tallies), Counter())
    start = min(t.first_start for t in tallies)
    elapsed = max(max(t.last_done for t in tallies) - start, 1e-9)
    p50, p90, p99 = percentiles_ms(latencies)
    forward_s = batch = None
    if before is not None and after is not None:
        forward_s = mean_delta(before, after, FORWARD_SECONDS)
        batch = mean_delta(before, after, BATCH_TOKENS)
    return LevelResult(
        concurrency=concurrency,
        requests=len(latencies),
        errors=sum(errors.values()),
        error_kinds=dict(errors),
        elapsed_s=elapsed,
        requests_per_s=len(latencies) / elapsed,
        tokens_per_s=len(latencies) * config.tokens / elapsed,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        server_forward_ms=None if forward_s is None else forward_s * 1e3,
        server_batch_tokens=batch,
    )


def run_http_bench(config: HttpBenchConfig) -> HttpReport:
    """Every concurrency level in turn against one server."""
    with httpx.Client(base_url=config.url, timeout=config.timeout_s) as http:
        try:
            info = http.get(f"/v1/layers/{config.layer}")
        except httpx.HTTPError as err:
            raise ValueError(f"cannot reach {config.url}: {type(err).__name__}: {err}") from err
        if info.status_code != 200:
            raise ValueError(
                f"{config.url}/v1/layers/{config.layer} answered {info.status_code}: {info.text}"
            )
        layer = info.json()
        request = make_request(config, layer["hidden_size"], layer["dtype"])
        # client processes, so that a single Python process's HTTP stack is not what is measured
        pool = None
        if config.processes > 1:
            pool = ProcessPoolExecutor(config.processes, mp_context=get_context("spawn"))
            list(pool.map(_started, range(config.processes)))  # spawned and imported up front
        try:
            levels = [run_level(http, request, config, c, pool) for c in config.concurrency]
        finally:
            if pool is not None:
                pool.shutdown()
    return HttpReport(
        url=config.url,
        layer=config.layer,
        backend=layer.get("backend", "unknown"),
        tokens=config.tokens,
        body="binary" if config.binary else "json",
        processes=config.processes,
        levels=levels,
    )
