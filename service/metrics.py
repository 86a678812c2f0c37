"""Prometheus metrics, one registry per app (so tests can build several apps in one process),
and Triton's (service/triton/metrics.py) beside them on the same page (`Metrics.page`)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence

import numpy as np
import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily
from prometheus_client.registry import Collector

from .engine.interface import StageTimes
from .triton.metrics import GpuCollector, HostCollector, exposition
from .triton.statistics import Statistics, StatisticsCollector

Metric = Counter | Gauge | Histogram
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# stages take from microseconds (a decode, a copy) to seconds (a queue under load)
_STAGE_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
)  # fmt: skip
# Where a request's time goes, in order. Per request: queue (arrival to its first rows' launch),
# decode (body -> checked tensors), encode (output -> reply body). Per batch: stage (host copy
# into pinned memory), h2d, forward, d2h (device time from CUDA events; forward is host time
# off the GPU, and the copies are absent there).
STAGES = ("queue", "decode", "stage", "h2d", "forward", "d2h", "encode")
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, CPU seconds
        # Triton's per-model statistics, also shown as its nv_inference_* metrics, and its host
        # and GPU metrics: printed as Triton prints them
        self.statistics = Statistics()
        self.triton = (StatisticsCollector(self.statistics), HostCollector(), GpuCollector())
        self.requests = Counter(
            "moe_serve_requests",
            "Requests (HTTP and gRPC) by route and status",
            ["route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "moe_serve_request_seconds",
            "Request (HTTP and gRPC) latency",
            ["route"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        # --http-workers: front-end processes started again after dying (their requests are
        # counted above, as the engine process's own)
        self.front_end_restarts = Counter(
            "moe_serve_front_end_restarts", "HTTP front-end processes restarted", registry=r
        )
        self.batch_tokens = Histogram(
            "moe_serve_batch_tokens",
            "tokens per forward batch",
            ["layer"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "moe_serve_batch_requests",
            "request pieces merged into one forward",
            ["layer"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "moe_serve_queue_depth",
            "request pieces waiting for a forward",
            ["layer"],
            registry=r,
        )
        self.tokens = Counter("moe_serve_tokens", "tokens processed", ["layer"], registry=r)
        self.forward_seconds = Histogram(
            "moe_serve_forward_seconds",
            "device time of one forward batch",
            ["layer", "backend"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.nonfinite_forwards = Counter(
            "moe_serve_nonfinite_forwards",
            "forwards whose output held NaN or Inf (the requests with such rows got 422)",
            ["layer"],
            registry=r,
        )
        self.expert_tokens = ExpertTokens()
        r.register(self.expert_tokens)
        self.stage_seconds = Histogram(
            "moe_serve_stage_seconds",
            f"time per stage ({', '.join(STAGES)}); queue, decode and encode per request, "
            "the others per batch, h2d/forward/d2h device time on a GPU",
            ["layer", "stage"],
            buckets=_STAGE_BUCKETS_S,
            registry=r,
        )
        # --ep N: expert parallelism's health and balance
        self.ep_balancedness = Gauge(
            "moe_serve_ep_balancedness",
            "expert parallelism: mean over max tokens per rank of the layer's last forward "
            "(1: even)",
            ["layer"],
            registry=r,
        )
        self.ep_live_ranks = Gauge(
            "moe_serve_ep_live_ranks", "expert-parallel ranks serving (0: down)", registry=r
        )
        self.ep_degraded = Gauge(
            "moe_serve_ep_degraded",
            "1 while expert parallelism serves on fewer ranks than it started with, or is down",
            registry=r,
        )
        # labelled series looked up once, for what is observed per request
        self._series: dict[tuple, Counter | Histogram] = {}
        # awaited before a scrape: what other processes hold back comes in (--http-workers:
        # the requests the front ends answered, service/frontends/channel_server.py)
        self.settle: Callable[[], Awaitable[None]] = _settled

    def page(self) -> bytes:
        """The Prometheus text page: ours, then Triton's."""
        return generate_latest(self.registry) + exposition(self.triton)

    async def scrape(self) -> bytes:
        """The page once what is held back elsewhere has come in (`settle`)."""
        await self.settle()
        return self.page()

    def add_layer(self, layer: str, num_experts: int) -> None:
        """Start the layer's series at 0, so a cold expert shows up as 0 rather than missing."""
        self.expert_tokens.add_layer(layer, num_experts)
        self.queue_depth.labels(layer).set(0)
        self.statistics.add_model(layer)
        for per_layer in (
            self.tokens,
            self.batch_tokens,
            self.batch_requests,
            self.nonfinite_forwards,
        ):
            per_layer.labels(layer)
        for stage in STAGES:
            self.stage_seconds.labels(layer, stage)

    def record_batch(
        self,
        layer: str,
        backend: str,
        tokens: int,
        expert_tokens: torch.Tensor,  # [E] pairs per expert
        times: StageTimes,
        queued_ns: Sequence[int] = (),
    ) -> None:
        """One forward batch: its time per stage, its size and where its tokens went;
        queued_ns: how long each request piece in the batch waited for it."""
        self.statistics.record_execution(
            layer,
            tokens,
            _ns(times.stage_s + (times.h2d_s or 0.0)),  # inputs onto the device
            _ns(times.forward_s),
            _ns(times.d2h_s or 0.0),  # the output off it
            queued_ns,
        )
        self.series(self.forward_seconds, layer, backend).observe(times.forward_s)
        self.series(self.batch_tokens, layer).observe(tokens)
        self.series(self.tokens, layer).inc(tokens)
        for stage in ("stage", "h2d", "forward", "d2h"):
            seconds = getattr(times, f"{stage}_s")
            if seconds is not None:
                self.series(self.stage_seconds, layer, stage).observe(seconds)
        self.expert_tokens.add(layer, expert_tokens.numpy())

    def observe_stage(self, layer: str, stage: str, seconds: float) -> None:
        self.series(self.stage_seconds, layer, stage).observe(seconds)

    def observe_request(self, route: str, status: str, seconds: float) -> None:
        self.series(self.requests, route, status).inc()
        self.series(self.request_seconds, route).observe(seconds)

    def series(self, metric: Metric, *labels: str) -> Metric:
        """`metric.labels(*labels)`, kept: prometheus_client takes a lock and builds the key on
        every call, a few microseconds each on the request path."""
        key = (id(metric), *labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(*labels)
        return series


async def _settled() -> None:
    """Nothing is held back elsewhere."""


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


class ExpertTokens(Collector):
    """moe_serve_expert_tokens_total{layer, expert}: tokens routed to each expert, kept as one
    array per layer and turned into series only when scraped. A batch adds its counts in one
    numpy call: a Counter per expert cost hundreds of increments per DeepSeek-V3 batch (E=256)
    on the event loop, more than the rest of the batch's metrics together."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, np.ndarray] = {}

    def page(self) -> bytes:
        """The Prometheus text page: ours, then Triton's."""
        return generate_latest(self.registry) + exposition(self.triton)

    def add_layer(self, layer: str, num_experts: int) -> None:
        """Start the layer's series at 0 (a cold expert shows up as 0 rather than missing)."""
        with self._lock:
            self._totals.setdefault(layer, np.zeros(num_experts, dtype=np.int64))

    def add(self, layer: str, counts: np.ndarray) -> None:
        with self._lock:
            totals = self._totals.get(layer)
            if totals is None or totals.shape != counts.shape:  # a layer reloaded with new E
                totals = self._totals[layer] = np.zeros(counts.shape, dtype=np.int64)
            totals += counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "moe_serve_expert_tokens", "tokens routed to each expert", labels=["layer", "expert"]
        )
        with self._lock:
            snapshot = {layer: totals.tolist() for layer, totals in self._totals.items()}
        for layer, totals in snapshot.items():
            for expert, count in enumerate(totals):
                family.add_metric([layer, str(expert)], count)
        yield family
