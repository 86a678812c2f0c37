"""OpenTelemetry tracing: off unless OTEL_* ask; on, a served request over HTTP and over gRPC
shows its request span with queue, forward (layer, backend, tokens) and reply spans inside."""

from __future__ import annotations

import http.server
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from moe_serve.service import tracing
from tests.service.layers import free_port

grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("opentelemetry.sdk")

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0
SPANS_TIMEOUT_S = 30.0


@pytest.mark.parametrize(
    ("environment", "wanted"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "moe"}, False),  # naming the service asks for nothing
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_tracing_is_on_only_when_the_environment_asks(monkeypatch, environment, wanted) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert tracing.requested() is wanted


@pytest.mark.parametrize(
    ("environment", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER 'zipkin'"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "exports traces over grpc or http/protobuf",
        ),
    ],
)
def test_an_exporter_the_server_lacks_is_refused(monkeypatch, environment, message) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        tracing.configure_from_environment()


class _Lines:
    """A pipe read on a thread, so the test can wait for text without blocking forever."""

    def __init__(self, pipe) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.text += line


def _spans(text: str) -> list[dict]:
    """The JSON spans ConsoleSpanExporter printed, one object after another."""
    decoder, spans, i = json.JSONDecoder(), [], text.find("{")
    while i != -1:
        span, end = decoder.raw_decode(text, i)
        spans.append(span)
        i = text.find("{", end)
    return spans


def _trace(spans: list[dict], root_name: str) -> dict[str, dict]:
    """The spans of the trace whose server span is `root_name`, by name."""
    root = next(s for s in spans if s["name"] == root_name)
    trace_id = root["context"]["trace_id"]
    return {s["name"]: s for s in spans if s["context"]["trace_id"] == trace_id}


@pytest.mark.slow
def test_http_and_grpc_requests_are_traced_through_queue_forward_and_reply(tmp_path) -> None:
    port, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "MOE_SERVE_CACHE_DIR": str(tmp_path),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "moe_serve.service.cli", "serve", "--device", "cpu",
         "--port", str(port), "--grpc-port", str(grpc_port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    out = _Lines(server.stdout)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "never ready"
            time.sleep(0.1)
        x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
        body = {
            "inputs": [
                {"name": "hidden_states", "shape": [4, 256], "datatype": "FP32",
                 "data": x.flatten().tolist()}
            ]
        }  # fmt: skip
        assert httpx.post(f"{url}/v2/models/demo/infer", json=body).status_code == 200
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            tensor = grpcclient.InferInput("hidden_states", [4, 256], "FP32")
            tensor.set_data_from_numpy(x)
            client.infer("demo", [tensor])
            answers: queue.Queue = queue.Queue()
            client.start_stream(lambda result, error: answers.put(error))
            client.async_stream_infer("demo", [tensor])
            assert answers.get(timeout=SPANS_TIMEOUT_S) is None
            client.stop_stream()
        deadline = time.monotonic() + SPANS_TIMEOUT_S
        while out.text.count('"name": "reply"') < 3 or 'ModelStreamInfer"' not in out.text:
            assert time.monotonic() < deadline, f"spans never came: {out.text[-2000:]}"
            time.sleep(0.05)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    spans = _spans(out.text)
    for root in ("POST /v2/models/{name}/infer", "/inference.GRPCInferenceService/ModelInfer"):
        trace = _trace(spans, root)
        assert {"queue", "forward", "reply"} <= set(trace), (root, sorted(trace))
        request = trace[root]
        assert request["kind"] == "SpanKind.SERVER"
        for name in ("queue", "forward", "reply"):
            assert trace[name]["parent_id"] == request["context"]["span_id"], (root, name)
        attributes = trace["forward"]["attributes"]
        assert attributes["moe.layer"] == "demo" and attributes["moe.tokens"] == 4
        assert attributes["moe.backend"] == "reference"
        assert trace["queue"]["end_time"] <= trace["forward"]["start_time"]
    # a stream: a span per request it carries, holding that request's
    trace = _trace(spans, "/inference.GRPCInferenceService/ModelStreamInfer")
    message = trace["ModelStreamInfer message"]
    assert (
        message["parent_id"]
        == trace["/inference.GRPCInferenceService/ModelStreamInfer"]["context"]["span_id"]
    )
    for name in ("queue", "forward", "reply"):
        assert trace[name]["parent_id"] == message["context"]["span_id"], name


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver: each POST /v1/traces's span names go to `spans`."""

    spans: queue.Queue

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces":
            request = ExportTraceServiceRequest.FromString(body)
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self.spans.put(span.name)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_spans_go_over_otlp_http_protobuf(tmp_path) -> None:
    _Receiver.spans = queue.Queue()
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    port = free_port()
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "MOE_SERVE_CACHE_DIR": str(tmp_path),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "moe_serve.service.cli", "serve", "--device", "cpu",
         "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "never ready"
            time.sleep(0.1)
        body = {"inputs": [{"name": "hidden_states", "shape": [1, 256], "datatype": "FP32",
                            "data": [0.01] * 256}]}  # fmt: skip
        assert httpx.post(f"{url}/v2/models/demo/infer", json=body).status_code == 200
        names = set()
        while "reply" not in names:
            names.add(_Receiver.spans.get(timeout=SPANS_TIMEOUT_S))
        assert {"queue", "forward"} <= names
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        receiver.shutdown()


def test_only_the_tracing_middleware_makes_request_spans(client, monkeypatch) -> None:
    """FastAPI's own telemetry is off: a tracer provider the app was not instrumented for (it
    came after create_app) gets no span of a request."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    assert tracing.enabled()
    assert client.get("/v1/layers").status_code == 200
    assert (
        client.post("/v1/layers/nope/forward", json={"hidden_states": [[0.0]]}).status_code == 404
    )
    assert exporter.get_finished_spans() == ()
