"""What Triton's tools ask of a server beyond inference, through the stock tritonclient (HTTP and
gRPC) against one real server: the model configuration, streaming inference, the trace and log
settings, the metrics page."""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.service import tracing
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.service.triton.metrics import GpuCollector, exposition
from tests.service.conftest import wait_ready
from tests.service.layers import NO_ROUTER, TINY, E, H, free_port, running_server, tiny_loader

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def urls() -> Iterator[tuple[str, str]]:
    """(HTTP base URL, gRPC host:port) of one server; its metrics port is METRICS_PORT."""
    port = free_port()
    settings = Settings(
        device="cpu",
        grpc_port=port,
        metrics_port=METRICS_PORT,
        max_batch_tokens=32,
        max_batch_delay_ms=0.5,
        max_queue=8,
    )
    app = create_app(settings, tiny_loader)
    with running_server(app) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield url, f"127.0.0.1:{port}"


@pytest.fixture
def http(urls: tuple[str, str]) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(urls[0].removeprefix("http://")) as client:
        yield client


@pytest.fixture
def grpc(urls: tuple[str, str]) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(urls[1]) as client:
        yield client


def test_model_config_in_tritons_schema_over_http_and_grpc(http, grpc) -> None:
    config = http.get_model_config(TINY)
    assert config == http.get_model_config(TINY, "1")
    assert (config["name"], config["platform"], config["backend"]) == (
        TINY,
        "moe-serve",
        "reference",
    )
    assert config["max_batch_size"] == 32  # rows per forward; dims leave them out
    assert config["input"] == [
        {
            "name": "hidden_states",
            "data_type": "TYPE_FP32",
            "format": "FORMAT_NONE",
            "dims": [H],
            "optional": False,
        },
        {
            "name": "router_logits",
            "data_type": "TYPE_FP32",
            "format": "FORMAT_NONE",
            "dims": [E],
            "optional": True,  # the layer has a router
        },
    ]
    assert config["output"] == [{"name": "output", "data_type": "TYPE_FP32", "dims": [H]}]
    batching = config["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 500
    assert batching["default_queue_policy"]["max_queue_size"] == 8
    assert batching["default_queue_policy"]["allow_timeout_override"] is True
    assert config["instance_group"] == [{"name": TINY, "kind": "KIND_CPU", "count": 1}]
    assert http.get_model_config(NO_ROUTER)["input"][1]["optional"] is False

    message = grpc.get_model_config(TINY, "1").config
    assert (message.name, message.backend, message.max_batch_size) == (TINY, "reference", 32)
    assert [(t.name, list(t.dims), t.optional) for t in message.input] == [
        ("hidden_states", [H], False),
        ("router_logits", [E], True),
    ]
    assert message.dynamic_batching.max_queue_delay_microseconds == 500
    assert message.dynamic_batching.default_queue_policy.max_queue_size == 8
    assert grpc.get_model_config(TINY, as_json=True)["config"]["name"] == TINY


def test_model_config_of_an_unknown_model_or_version_is_not_found(urls, grpc) -> None:
    assert httpx.get(f"{urls[0]}/v2/models/nope/config").status_code == 404
    assert httpx.get(f"{urls[0]}/v2/models/{TINY}/versions/2/config").status_code == 404
    with pytest.raises(grpcclient.InferenceServerException) as err:
        grpc.get_model_config(TINY, "2")
    assert err.value.status() == "StatusCode.NOT_FOUND"


def _rows(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, H)).astype(np.float32)


def _into(answers: queue.Queue) -> Callable[[object, object], None]:
    """A stream callback that queues each (result, error)."""
    return lambda result, error: answers.put((result, error))


def _stream(grpc, requests: list[tuple[str, np.ndarray, str]]) -> list[tuple[object, object]]:
    """Send (model, rows, request id) over one stream; the (result, error) of each, in the
    order they came back."""
    answers: queue.Queue = queue.Queue()
    grpc.start_stream(_into(answers))
    try:
        for model, rows, request_id in requests:
            tensor = grpcclient.InferInput("hidden_states", list(rows.shape), "FP32")
            tensor.set_data_from_numpy(rows)
            grpc.async_stream_infer(model, [tensor], request_id=request_id)
        return [answers.get(timeout=20) for _ in requests]
    finally:
        grpc.stop_stream()


def test_stream_infer_answers_each_request_in_order_with_its_own_errors(http, grpc) -> None:
    before = http.get_inference_statistics(TINY)["model_stats"][0]["inference_stats"]
    requests = [(TINY, _rows(rows, rows), f"r{i}") for i, rows in enumerate((1, 3, 40, 2))]
    requests.insert(2, (NO_ROUTER, _rows(2), "no-logits"))  # a request that fails
    requests.insert(3, ("nope", _rows(1), "unknown"))
    answers = _stream(grpc, requests)
    assert len(answers) == len(requests)
    for (model, rows, request_id), (result, error) in zip(requests, answers, strict=True):
        if model != TINY:
            assert result is None and error is not None, request_id
            continue
        assert error is None, error
        response = result.get_response()
        assert (response.id, response.model_name, response.model_version) == (request_id, TINY, "1")
        expected = http.infer(TINY, [_http_input(rows)]).as_numpy("output")
        np.testing.assert_allclose(result.as_numpy("output"), expected, rtol=1e-5, atol=1e-6)
    assert "router_logits" in str(answers[2][1])  # the layer has no router: logits needed
    assert "nope" in str(answers[3][1])
    after = http.get_inference_statistics(TINY)["model_stats"][0]["inference_stats"]
    # the stream's four requests and the four HTTP ones that checked them
    assert after["success"]["count"] - before["success"]["count"] == 8


def test_stream_infer_needs_the_token_and_a_silent_stream_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    token = "stream-test-token-0123456789"
    port = free_port()
    settings = Settings(device="cpu", grpc_port=port, api_token=token, read_timeout_s=0.5)
    app = create_app(settings, tiny_loader)
    caplog.set_level(logging.INFO, logger="moe_serve.service.grpc.interceptors")
    with running_server(app) as url:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as client:
            wait_ready(client.get)
        for headers in ({}, {"authorization": f"Bearer {token}"}):
            with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as grpc:
                answers: queue.Queue = queue.Queue()
                grpc.start_stream(_into(answers), headers=headers)
                tensor = grpcclient.InferInput("hidden_states", [1, H], "FP32")
                tensor.set_data_from_numpy(_rows(1))
                with contextlib.suppress(grpcclient.InferenceServerException):  # refused already
                    grpc.async_stream_infer(TINY, [tensor])
                result, error = answers.get(timeout=20)
                grpc.stop_stream()
            if headers:
                assert error is None and result.as_numpy("output").shape == (1, H)
            else:
                assert result is None and error.status() == "StatusCode.UNAUTHENTICATED"
                # the refused stream is logged as every call is, not only counted
                lines = [r.getMessage() for r in caplog.records]
                assert any(m.startswith("grpc ModelStreamInfer -> UNAUTHENTICATED") for m in lines)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as grpc:
            answers = queue.Queue()
            grpc.start_stream(_into(answers), headers={"authorization": f"Bearer {token}"})
            result, error = answers.get(timeout=20)  # nothing sent
            grpc.stop_stream()
        assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "MOE_SERVE_READ_TIMEOUT_S" in error.message()


def _http_input(rows: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput("hidden_states", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)
    return tensor


# Triton's metrics and their types
TRITON_METRICS = {
    **dict.fromkeys(
        [
            "nv_inference_request_success",
            "nv_inference_request_failure",
            "nv_inference_count",
            "nv_inference_exec_count",
            "nv_inference_request_duration_us",
            "nv_inference_queue_duration_us",
            "nv_inference_compute_input_duration_us",
            "nv_inference_compute_infer_duration_us",
            "nv_inference_compute_output_duration_us",
        ],
        "counter",
    ),
    "nv_inference_pending_request_count": "gauge",
    "nv_cpu_utilization": "gauge",
    "nv_cpu_memory_total_bytes": "gauge",
    "nv_cpu_memory_used_bytes": "gauge",
}


def test_metrics_port_serves_tritons_metrics_with_tritons_names_and_types(urls, http) -> None:
    http.infer(TINY, [_http_input(_rows(2))])
    page = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(page.text)}
    assert {name: families[name].type for name in TRITON_METRICS} == TRITON_METRICS
    for name, kind in TRITON_METRICS.items():
        if kind == "counter":  # named as Triton names them: no _total
            assert f"# TYPE {name} counter" in page.text and f"\n{name}{{" in page.text, name
    success = families["nv_inference_request_success"].samples
    assert {"model": TINY, "version": "1"} in [s.labels for s in success]
    assert 0 <= families["nv_cpu_utilization"].samples[0].value <= 1
    memory = {
        n: families[n].samples[0].value
        for n in ("nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes")
    }
    assert 0 < memory["nv_cpu_memory_used_bytes"] < memory["nv_cpu_memory_total_bytes"]
    assert "moe_serve_tokens_total" in page.text  # the same page as on the HTTP port
    assert "nv_inference_request_success" in httpx.get(f"{urls[0]}/metrics").text
    assert httpx.get(f"http://127.0.0.1:{METRICS_PORT}/other").status_code == 404


class _FakeNvml:
    """pynvml's calls the GPU collector makes, for two GPUs; the second has no power reading."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-{handle}".encode()

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=50 + handle)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=80 << 30, used=(handle + 1) << 30)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle:
            raise self.NVMLError("not supported")
        return 250_000  # mW

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return 5_000_000  # mJ


def test_gpu_metrics_are_labelled_by_uuid_in_tritons_units() -> None:
    collector = GpuCollector()
    collector.nvml = _FakeNvml()
    page = exposition([collector]).decode()
    families = {f.name: f for f in text_string_to_metric_families(page)}
    values = {(f.name, s.labels["gpu_uuid"]): s.value for f in families.values() for s in f.samples}
    assert values[("nv_gpu_utilization", "GPU-1")] == 0.51
    assert values[("nv_gpu_memory_used_bytes", "GPU-0")] == 1 << 30
    assert values[("nv_gpu_power_usage", "GPU-0")] == 250.0
    assert ("nv_gpu_power_usage", "GPU-1") not in values  # not supported: left out
    assert values[("nv_energy_consumption", "GPU-0")] == 5000.0
    assert families["nv_energy_consumption"].type == "counter"
    assert families["nv_gpu_memory_total_bytes"].type == "gauge"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_http_infer_replies_name_the_model_version(urls, http, binary) -> None:
    output = httpclient.InferRequestedOutput("output", binary_data=binary)
    for version in ("", "1"):
        result = http.infer(TINY, [_http_input(_rows(1))], model_version=version, outputs=[output])
        assert result.get_response()["model_version"] == "1"


@pytest.fixture
def log_level() -> Iterator[None]:
    """The root logger's level, put back after the test changes it through the API."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


def test_log_settings_over_http_and_grpc_change_the_level(http, grpc, log_level) -> None:
    root = logging.getLogger()
    settings = http.update_log_settings({"log_verbose_level": 1})
    assert root.level == logging.DEBUG
    assert settings == {
        "log_file": "",
        "log_verbose_level": 1,
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_format": "text",
    }
    grpc.update_log_settings({"log_verbose_level": 0, "log_info": False})
    assert root.level == logging.WARNING
    assert http.get_log_settings()["log_info"] is False
    message = grpc.get_log_settings().settings
    assert (message["log_info"].bool_param, message["log_warning"].bool_param) == (False, True)
    assert message["log_verbose_level"].uint32_param == 0
    for bad, why in (
        ({"log_info": True, "log_error": False}, "log_info on shows log_error"),  # a threshold
        ({"log_file": "/tmp/x.log"}, "stderr"),
        ({"log_colour": True}, "unknown log settings"),
    ):
        with pytest.raises(httpclient.InferenceServerException) as err:
            http.update_log_settings(bad)
        assert err.value.status() == "400" and why in err.value.message(), bad
        with pytest.raises(grpcclient.InferenceServerException) as err:
            grpc.update_log_settings(bad)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", bad
    assert root.level == logging.WARNING  # refused changes change nothing


def test_trace_settings_over_http_and_grpc_global_and_per_model(http, grpc) -> None:
    """Tracing is off in this process (no OTEL_* variables): the rate and count still change,
    and a model's own settings follow the global ones until set."""
    try:
        assert http.get_trace_settings() == {
            "trace_level": ["OFF"],
            "trace_rate": "1",
            "trace_count": "-1",
            "log_frequency": "0",
            "trace_file": "",
            "trace_mode": "opentelemetry",
        }
        http.update_trace_settings(settings={"trace_rate": "10"})
        grpc.update_trace_settings(TINY, {"trace_count": "5"})
        assert http.get_trace_settings(TINY)["trace_rate"] == "10"  # the global one
        assert http.get_trace_settings(TINY)["trace_count"] == "5"  # its own
        assert http.get_trace_settings(NO_ROUTER)["trace_count"] == "-1"
        http.update_trace_settings(settings={"trace_rate": "4"})
        message = grpc.get_trace_settings(TINY).settings
        assert list(message["trace_rate"].value) == ["4"]
        assert list(message["trace_count"].value) == ["5"]
        http.update_trace_settings(TINY, {"trace_count": None})  # back to the global one
        assert grpc.get_trace_settings(TINY, as_json=True)["settings"]["trace_count"] == {
            "value": ["-1"]
        }
        for bad, why in (
            ({"trace_level": ["TIMESTAMPS"]}, "tracing is off"),
            ({"trace_rate": "0"}, "trace_rate must be an integer from 1"),
            ({"trace_file": "trace.json"}, "OpenTelemetry exporter"),
            ({"trace_sampler": "1"}, "unknown trace setting"),
        ):
            with pytest.raises(httpclient.InferenceServerException) as err:
                http.update_trace_settings(settings=bad)
            assert err.value.status() == "400" and why in err.value.message(), bad
            with pytest.raises(grpcclient.InferenceServerException) as err:
                grpc.update_trace_settings(settings=bad)
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT", bad
        with pytest.raises(httpclient.InferenceServerException) as err:
            http.get_trace_settings("nope")
        assert err.value.status() == "404"
    finally:
        tracing.SETTINGS.reset()


def test_trace_settings_decide_which_requests_are_traced(monkeypatch) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    monkeypatch.setattr(tracing, "enabled", lambda: True)
    settings = tracing.TraceSettings()
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing.SettingsSampler(settings, ALWAYS_ON))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    def requests(path: str, n: int) -> int:
        """How many of n requests to `path` were traced (each with a child span)."""
        exporter.clear()
        for _ in range(n):
            with tracer.start_as_current_span("request", attributes={"url.path": path}):
                tracer.start_span("queue").end()
        traced = exporter.get_finished_spans()
        return sum(span.name == "request" for span in traced)

    assert requests("/v2/models/a/infer", 4) == 4  # on, as at start
    settings.update({"trace_rate": "3"})
    assert requests("/v2/models/a/infer", 6) == 2
    settings.update({"trace_count": "1"}, "b")
    assert requests("/v2/models/b/infer", 6) == 1  # b's count; the global rate
    assert settings.get("b")["trace_count"] == "0"
    assert requests("/v1/layers/a/forward", 3) == 1
    settings.update({"trace_level": "OFF"})
    assert requests("/v2/models/a/infer", 3) == 0
    assert len(exporter.get_finished_spans()) == 0  # their children too
