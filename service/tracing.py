"""OpenTelemetry tracing, off unless the standard OTEL_* variables ask for it.

Per request: the server span of the FastAPI or gRPC instrumentation (the request), then, for
each piece of it the batcher runs, `queue` (waiting for its forward) and `forward` (the batch's
forward: layer, backend, tokens), then `reply` (encoding the answer). A gRPC stream's span holds
one `ModelStreamInfer message` span per request it carries, and those hold the rest. Spans go
through the OTLP exporter (or the console one) that opentelemetry-sdk configures from the
environment.

Triton's trace settings (TraceSettings: global, and per model) decide which requests are traced:
`trace_level` OFF traces none, TIMESTAMPS traces them; `trace_rate` N traces one request in N;
`trace_count` is how many more are traced (-1: no end). SettingsSampler applies them to each
request's server span, before the sampler that OTEL_TRACES_SAMPLER names. The model is known
from an HTTP request's path; a gRPC call names its model in its message, after its span has
begun, so gRPC follows the global settings.

Only opentelemetry-api is needed while tracing is off: its tracer is a no-op then.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from opentelemetry import context as otel_context
from opentelemetry import trace

from .errors import BadInput

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
        ).strip()
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError(
                f"OTLP protocol {protocol!r}: this server exports traces over grpc or http/protobuf"
            )
        exporter = OTLPSpanExporter()  # endpoint, headers, TLS: OTEL_EXPORTER_OTLP_*
    # a service.name from OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES wins over ours
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    resource = Resource.create({} if named else {"service.name": "moe-serve"})
    from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

    # the trace settings first, then OTEL_TRACES_SAMPLER's sampler
    sampler = SettingsSampler(SETTINGS, _get_from_env_or_default())
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_*
    trace.set_tracer_provider(provider)
    SETTINGS.reset()  # tracing is on now
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


OFF, TIMESTAMPS = "OFF", "TIMESTAMPS"
MODE = "opentelemetry"
# a request path that names a model: KServe's /v2/models/{name}/..., and /v1/layers/{name}/...
_MODEL_PATH = re.compile(r"/v2/models/([^/]+)|/v1/layers/([^/]+)")


@dataclass
class _Scope:
    """One set of trace settings (the global ones, or a model's) and its running tally."""

    level: str
    rate: int
    count: int  # traces left; -1: no end
    seen: int = 0  # requests since the last one traced

    def sample(self) -> bool:
        if self.level == OFF or self.count == 0:
            return False
        self.seen += 1
        if self.seen < self.rate:
            return False
        self.seen = 0
        if self.count > 0:
            self.count -= 1
        return True


class TraceSettings:
    """Triton's trace settings over our OpenTelemetry tracing: the global ones, and the models'
    own, each setting of a model following the global one until it is set. Values are strings,
    as Triton's (`trace_level` a list). trace_file, log_frequency and trace_mode are for
    Triton's own trace files and can only be what FIXED says: spans go to the exporter."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.scopes: dict[str, _Scope] = {}  # "" is the global one
        self.own: dict[str, dict[str, Any]] = {}  # model -> the _Scope fields set for it
        self.reset()

    def reset(self) -> None:
        """As at start: every request traced while tracing is on, none while it is off."""
        with self.lock:
            self.scopes = {"": _Scope(TIMESTAMPS if enabled() else OFF, 1, -1)}
            self.own = {}

    def get(self, model: str = "") -> dict[str, Any]:
        with self.lock:
            scope = self.scopes.get(model, self.scopes[""])
            return {
                "trace_level": [scope.level],
                "trace_rate": str(scope.rate),
                "trace_count": str(scope.count),
                **FIXED,
            }

    def update(self, changes: Mapping[str, Any], model: str = "") -> dict[str, Any]:
        """Set (or, for a model, clear with None) the settings in `changes`; the settings after.
        BadInput names a setting that is unknown or out of range, and changes nothing. The
        tallies of trace_rate start again."""
        parsed = dict(_parse_setting(key, value, bool(model)) for key, value in changes.items())
        parsed = {field: v for field, v in parsed.items() if field in _SCOPE_FIELDS.values()}
        if parsed.get("level", OFF) != OFF and not enabled():
            raise BadInput(
                "tracing is off: start the server with OpenTelemetry's variables "
                "(OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER) to trace requests"
            )
        with self.lock:
            overall = self.scopes[""]
            if model:
                own = self.own.setdefault(model, {})
                for field, value in parsed.items():
                    if value is None:
                        own.pop(field, None)
                    else:
                        own[field] = value
                if not own:
                    del self.own[model]
            else:
                for field, value in parsed.items():
                    setattr(overall, field, value)
            overall.seen = 0
            self.scopes = {"": overall} | {
                name: _Scope(**{f: own.get(f, getattr(overall, f)) for f in _SCOPE_FIELDS.values()})
                for name, own in self.own.items()
            }
        return self.get(model)

    def sample(self, model: str | None) -> bool:
        """Whether to trace a request (of `model`, where known), counting it."""
        with self.lock:
            return self.scopes.get(model or "", self.scopes[""]).sample()


# Triton's settings that set a _Scope field, and those that can only be one value here
_SCOPE_FIELDS = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count"}
FIXED = {"log_frequency": "0", "trace_file": "", "trace_mode": MODE}


def _parse_setting(key: str, value: Any, for_model: bool) -> tuple[str, Any]:
    """A setting of Triton's, as a string (or a list of one, as gRPC sends it; trace_level a
    list) -> (the _Scope field, or the key of a FIXED one; its value); None clears a model's
    own."""
    if key not in _SCOPE_FIELDS and key not in FIXED:
        raise BadInput(f"unknown trace setting {key!r}; the settings are {', '.join(KEYS)}")
    if value is None or value == []:
        if not for_model:
            raise BadInput(f"trace setting {key}: only a model's own settings can be cleared")
        return _SCOPE_FIELDS.get(key, key), None
    values = value if isinstance(value, list) else [value]
    if len(values) != 1 or not isinstance(values[0], str | int) or isinstance(values[0], bool):
        raise BadInput(f"trace setting {key} takes one value, got {value!r}")
    text = str(values[0])
    if key in FIXED:
        if text != FIXED[key]:
            raise BadInput(
                f"trace setting {key} can only be {FIXED[key]!r} here: spans go to the "
                "OpenTelemetry exporter that the OTEL_* variables configure"
            )
        return key, text
    if key == "trace_level":
        if text not in (OFF, TIMESTAMPS):
            raise BadInput(f"trace_level {text!r}: expected OFF or TIMESTAMPS (no TENSORS here)")
        return "level", text
    least = 1 if key == "trace_rate" else -1
    if not (text.lstrip("-").isdigit() and least <= int(text) < 2**63):
        raise BadInput(f"{key} must be an integer from {least}, got {text!r}")
    return _SCOPE_FIELDS[key], int(text)


KEYS = (*_SCOPE_FIELDS, *FIXED)


def model_of(attributes: Mapping[str, Any] | None) -> str | None:
    """The model an HTTP server span's request path names, if any."""
    path = (attributes or {}).get("url.path") or (attributes or {}).get("http.target")
    found = _MODEL_PATH.match(path) if isinstance(path, str) else None
    return None if found is None else found.group(1) or found.group(2)


class SettingsSampler:
    """A request's server span (no parent in this process) is traced only if the trace
    settings say so, and the spans within it only if it is; then as `delegate` decides."""

    def __init__(self, settings: TraceSettings, delegate: Any) -> None:
        self.settings = settings
        self.delegate = delegate

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Any] | None = None,
        trace_state: Any = None,
    ) -> Any:
        from opentelemetry.sdk.trace.sampling import Decision, SamplingResult

        parent = trace.get_current_span(parent_context).get_span_context()
        if not parent.is_valid or parent.is_remote:  # a request entering the server
            if not self.settings.sample(model_of(attributes)):
                return SamplingResult(Decision.DROP)
        elif not parent.trace_flags.sampled:  # within a request left untraced
            return SamplingResult(Decision.DROP)
        return self.delegate.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"TraceSettings{{{self.delegate.get_description()}}}"


SETTINGS = TraceSettings()  # the process's, as its tracer provider is
