"""Per-model inference statistics in Triton's schema, and the `nv_inference_*` metrics of them.

One ModelStatistics per served layer holds the counts; `GET /v2/models/{name}/stats` and the
ModelStatistics RPC show them as Triton's statistics extension does, and StatisticsCollector
shows the same numbers to Prometheus under Triton's metric names and types (metrics.py).
Requests are the KServe v2 ones (HTTP and gRPC); executions are every forward of the layer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..errors import (
    ClientDisconnected,
    DeadlineExceeded,
    ForwardFailed,
    NonFiniteOutput,
    Overloaded,
)
from .metrics import COUNTER, GAUGE, family

VERSION = "1"  # every layer is a model with one version


@dataclass
class Duration:
    """Triton's $duration_stat: how many times, and their total nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, times: int = 1) -> None:
        self.count += times
        self.ns += ns

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStatistics:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelStatistics:
    last_inference_ms: int = 0  # when the last request arrived, ms since the epoch
    inference_count: int = 0  # tokens answered (Triton counts each batch row)
    execution_count: int = 0  # forwards
    pending: int = 0  # requests received and not yet answered
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStatistics] = field(default_factory=dict)  # by tokens per forward
    # failed requests by Triton's reason (nv_inference_request_failure's label)
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def to_json(self, name: str) -> dict:
        """Triton's $model_stat."""
        stats = {
            key: getattr(self, key).to_json()
            for key in (
                "success",
                "fail",
                "queue",
                "compute_input",
                "compute_infer",
                "compute_output",
            )
        }
        # there is no response cache
        stats["cache_hit"] = stats["cache_miss"] = Duration().to_json()
        return {
            "name": name,
            "version": VERSION,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": stats,
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": b.compute_input.to_json(),
                    "compute_infer": b.compute_infer.to_json(),
                    "compute_output": b.compute_output.to_json(),
                }
                for size, b in sorted(self.batches.items())
            ],
            "memory_usage": [],
            "response_stats": {},  # for decoupled models; ours answer each request once
        }


REJECTED, CANCELED, BACKEND, OTHER = "REJECTED", "CANCELED", "BACKEND", "OTHER"
REASONS = (REJECTED, CANCELED, BACKEND, OTHER)


def _reason(kind: type[BaseException]) -> str:
    """Triton's reason for a failed request: refused by the queue (full, or its timeout
    passed), withdrawn by its client, failed in the forward, or anything else (bad input)."""
    if issubclass(kind, Overloaded | DeadlineExceeded):
        return REJECTED
    if issubclass(kind, ClientDisconnected | asyncio.CancelledError):
        return CANCELED
    if issubclass(kind, ForwardFailed | NonFiniteOutput):
        return BACKEND
    return OTHER


class RequestTimer:
    """One request of a model, timed as `Statistics.request` describes. A class rather than a
    generator context manager: this runs on every request, on the event loop."""

    __slots__ = ("answered", "lock", "model", "started", "submitted", "tokens")

    def __init__(self, model: ModelStatistics, lock: threading.Lock) -> None:
        self.model, self.lock = model, lock
        self.started = 0  # time.perf_counter_ns(), as every time here
        self.submitted: int | None = None  # inputs ready, handed to the batcher
        self.answered: int | None = None  # the batcher's result is back
        self.tokens = 0

    def submit(self, tokens: int) -> None:
        self.submitted, self.tokens = time.perf_counter_ns(), tokens

    def answer(self) -> None:
        self.answered = time.perf_counter_ns()

    def __enter__(self) -> RequestTimer:
        model = self.model
        with self.lock:
            model.pending += 1
            model.last_inference_ms = int(time.time() * 1e3)
        self.started = time.perf_counter_ns()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        ended, model = time.perf_counter_ns(), self.model
        with self.lock:
            model.pending -= 1
            if kind is not None:
                model.fail.add(ended - self.started)
                model.failures[_reason(kind)] += 1
                return
            model.success.add(ended - self.started)
            model.inference_count += self.tokens
            if self.submitted is not None and self.answered is not None:
                model.compute_input.add(self.submitted - self.started)
                model.compute_output.add(ended - self.answered)


class Statistics:
    """Every model's statistics; written from the event loop and the device worker thread."""

    def __init__(self) -> None:
        self.models: dict[str, ModelStatistics] = {}
        self.lock = threading.Lock()

    def add_model(self, name: str) -> None:
        """Start (or restart, on a reload) the model's statistics at zero."""
        with self.lock:
            self.models[name] = ModelStatistics()

    def remove_model(self, name: str) -> None:
        with self.lock:
            self.models.pop(name, None)

    def request(self, name: str) -> RequestTimer:
        """Time one inference request of model `name` (`with statistics.request(name) as
        timer`): an exception out of the block is a failure. compute_input is the time before
        `timer.submit`, compute_output after `timer.answer`."""
        with self.lock:
            model = self.models.setdefault(name, ModelStatistics())
        return RequestTimer(model, self.lock)

    def record_execution(
        self,
        name: str,
        tokens: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        queued_ns: Sequence[int],
    ) -> None:
        """One forward of `tokens` rows: its inputs took `input_ns` onto the device, the forward
        `infer_ns` and the output `output_ns` back (0 where nothing is copied: the CPU), for
        requests (pieces) that had waited `queued_ns` each."""
        with self.lock:
            model = self.models.setdefault(name, ModelStatistics())
            model.execution_count += 1
            model.compute_infer.add(infer_ns * len(queued_ns), len(queued_ns))
            for wait in queued_ns:
                model.queue.add(wait)
            batch = model.batches.setdefault(tokens, BatchStatistics())
            batch.compute_input.add(input_ns)
            batch.compute_infer.add(infer_ns)
            batch.compute_output.add(output_ns)

    def to_json(self, names: Sequence[str]) -> dict:
        """Triton's $stats_model_response for `names`."""
        with self.lock:
            return {"model_stats": [self.models[n].to_json(n) for n in names if n in self.models]}


# Triton's metric name -> what it reads (cumulative: a counter, named without `_total` as
# Triton names it)
_CUMULATIVE = {
    "nv_inference_request_success": (
        "Number of successful inference requests, all batch sizes",
        lambda m: m.success.count,
    ),
    "nv_inference_count": (
        "Number of inferences performed (tokens: a request's rows)",
        lambda m: m.inference_count,
    ),
    "nv_inference_exec_count": (
        "Number of model executions performed (forwards)",
        lambda m: m.execution_count,
    ),
    "nv_inference_request_duration_us": (
        "Cumulative inference request duration in microseconds",
        lambda m: (m.success.ns + m.fail.ns) // 1000,
    ),
    "nv_inference_queue_duration_us": (
        "Cumulative inference queuing duration in microseconds",
        lambda m: m.queue.ns // 1000,
    ),
    "nv_inference_compute_input_duration_us": (
        "Cumulative compute input duration in microseconds",
        lambda m: m.compute_input.ns // 1000,
    ),
    "nv_inference_compute_infer_duration_us": (
        "Cumulative compute inference duration in microseconds",
        lambda m: m.compute_infer.ns // 1000,
    ),
    "nv_inference_compute_output_duration_us": (
        "Cumulative inference compute output duration in microseconds",
        lambda m: m.compute_output.ns // 1000,
    ),
}


class StatisticsCollector(Collector):
    """The nv_inference_* metrics, labelled model and version (and a failure's reason), read
    from Statistics."""

    def __init__(self, statistics: Statistics) -> None:
        self.statistics = statistics

    def collect(self) -> Iterator[Metric]:
        families = [
            family(name, help_text, COUNTER) for name, (help_text, _) in _CUMULATIVE.items()
        ]
        failure = family(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
            COUNTER,
        )
        pending = family(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            GAUGE,
        )
        with self.statistics.lock:
            for name, model in self.statistics.models.items():
                labels = {"model": name, "version": VERSION}
                for metric, (_, read) in zip(families, _CUMULATIVE.values(), strict=True):
                    metric.add_sample(metric.name, labels, read(model))
                for reason, count in model.failures.items():
                    failure.add_sample(failure.name, {**labels, "reason": reason}, count)
                pending.add_sample(pending.name, labels, model.pending)
        yield from families
        yield failure
        yield pending
