"""Prometheus metrics, one registry per app (so tests can build several apps in one process)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.statistics import Statistics, StatisticsCollector

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Triton's per-model statistics; also shown as its nv_inference_* metrics
        self.statistics = Statistics()
        r.register(StatisticsCollector(self.statistics))
        self.requests = Counter(
            "moe_serve_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "moe_serve_request_seconds",
            "HTTP request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
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
        self.expert_tokens = Counter(
            "moe_serve_expert_tokens",
            "tokens routed to each expert",
            ["layer", "expert"],
            registry=r,
        )

    def add_layer(self, layer: str, num_experts: int) -> None:
        """Start the layer's series at 0, so a cold expert shows up as 0 rather than missing."""
        for expert in range(num_experts):
            self.expert_tokens.labels(layer, str(expert))
        self.queue_depth.labels(layer).set(0)
        self.statistics.add_model(layer)
        for per_layer in (self.tokens, self.batch_tokens, self.batch_requests):
            per_layer.labels(layer)

    def record_forward(
        self,
        layer: str,
        backend: str,
        topk_ids: torch.Tensor,
        seconds: float,
        queued_s: Sequence[float] = (),
    ) -> None:
        """One forward batch: its time, its size and where its tokens went. topk_ids [M, k];
        queued_s: how long each request piece in the batch waited for it."""
        tokens = topk_ids.shape[0]
        self.statistics.record_execution(layer, tokens, seconds, queued_s)
        self.forward_seconds.labels(layer, backend).observe(seconds)
        self.batch_tokens.labels(layer).observe(tokens)
        self.tokens.labels(layer).inc(tokens)
        ids = topk_ids.flatten().long()
        counts = torch.bincount(ids[ids >= 0]).tolist()  # -1: an expert on another rank
        for expert, count in enumerate(counts):
            if count:
                self.expert_tokens.labels(layer, str(expert)).inc(count)
