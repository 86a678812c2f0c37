"""OpenTelemetry tracing, off unless the standard OTEL_* variables ask for it.

Per request: the server span of the FastAPI or gRPC instrumentation (the request), then, for
each piece of it the batcher runs, `queue` (waiting for its forward) and `forward` (the batch's
forward: layer, backend, tokens), then `reply` (encoding the answer). A gRPC stream's span holds
one `ModelStreamInfer message` span per request it carries, and those hold the rest. Spans go
through the OTLP exporter (or the console one) that opentelemetry-sdk configures from the
environment.

Only opentelemetry-api is needed while tracing is off: its tracer is a no-op then.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from opentelemetry import context as otel_context
from opentelemetry import trace

log = logging.getLogger(__name__)

tracer = trace.get_tracer("moe-serve")  # follows the global provider once one is installed
EXPORTERS = ("otlp", "console")


def requested() -> bool:
    """Whether the environment asks for traces: an OTLP endpoint or a traces exporter named,
    and the SDK not disabled."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return exporter not in ("", "none") or (bool(endpoint) and exporter != "none")


def configure_from_environment() -> bool:
    """Install the SDK's tracer provider and exporter when the environment asks; True if so.
    Refuses (ValueError) an exporter or OTLP protocol this server does not ship."""
    if not requested():
        return False
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if exporter_name not in EXPORTERS:
        raise ValueError(f"OTEL_TRACES_EXPORTER {exporter_name!r}: expected one of {EXPORTERS}")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    else:
        protocol = os.environ.get(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        )
        if protocol != "grpc":
            raise ValueError(f"OTLP protocol {protocol!r}: this server exports traces over grpc")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers, TLS: OTEL_EXPORTER_OTLP_*
    # a service.name from OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES wins over ours
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {"service.name": "moe-serve"})
    provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_*
    trace.set_tracer_provider(provider)
    log.info("tracing on: %s exporter", exporter_name)
    return True


def enabled() -> bool:
    """Whether a real tracer provider is installed (by configure_from_environment, or a test)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def instrument_app(app: FastAPI) -> None:
    """The FastAPI instrumentation's request spans, when tracing is on."""
    if enabled():
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, excluded_urls="health,ready,metrics")


def grpc_interceptors() -> list[Any]:
    """The gRPC instrumentation's server interceptor (request spans), when tracing is on."""
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


@dataclass(frozen=True)
class Arrival:
    """A request as the batcher took it in, for its pieces' queue and forward spans."""

    context: otel_context.Context  # the request's, captured when it was submitted
    arrived_ns: int  # time.time_ns()


def current_context() -> otel_context.Context:
    return otel_context.get_current()


def now_ns() -> int:
    return time.time_ns()


def record_forward(
    layer: str,
    backend: str,
    pieces: Sequence[tuple[Arrival, int]],
    started_ns: int,
    ended_ns: int,
) -> None:
    """Each piece's (its request's arrival, its rows) `queue` span (arrival to forward) and
    `forward` span, in its request."""
    batch_tokens = sum(rows for _, rows in pieces)
    for arrival, rows in pieces:
        if not trace.get_current_span(arrival.context).is_recording():
            continue  # no trace for this request
        context = arrival.context
        queue = tracer.start_span("queue", context=context, start_time=arrival.arrived_ns)
        queue.end(end_time=started_ns)
        forward = tracer.start_span(
            "forward",
            context=context,
            start_time=started_ns,
            attributes={
                "moe.layer": layer,
                "moe.backend": backend,
                "moe.tokens": rows,
                "moe.batch_tokens": batch_tokens,
            },
        )
        forward.end(end_time=ended_ns)


@contextmanager
def span(name: str) -> Iterator[None]:
    """A child span of the current one, only in a request that is traced (as record_forward:
    the no-op tracer's span costs more than the encoding of a small reply): `reply` (encoding
    the answer), or one message of a gRPC stream."""
    if not trace.get_current_span().is_recording():
        yield
        return
    with tracer.start_as_current_span(name):
        yield
