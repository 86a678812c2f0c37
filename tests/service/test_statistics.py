"""Per-model statistics in Triton's schema (HTTP /stats and the ModelStatistics RPC, through
the stock tritonclient) and the nv_inference_* metrics beside moe_serve_*."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import NO_ROUTER, TINY, H, free_port, running_server, tiny_loader

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")


@pytest.fixture
def urls() -> Iterator[tuple[str, str]]:
    """A fresh server per test (statistics start at zero): (HTTP URL, gRPC address)."""
    port = free_port()
    app = create_app(Settings(device="cpu", grpc_port=port), tiny_loader)
    with running_server(app) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield url, f"127.0.0.1:{port}"


def _infer(client: httpclient.InferenceServerClient, rows: int, model: str = TINY) -> None:
    tensor = httpclient.InferInput("hidden_states", [rows, H], "FP32")
    tensor.set_data_from_numpy(np.zeros((rows, H), np.float32))
    client.infer(model, [tensor])


def test_stats_count_requests_tokens_and_failures_in_tritons_schema(urls) -> None:
    client = httpclient.InferenceServerClient(urls[0].removeprefix("http://"))
    _infer(client, 3)
    _infer(client, 5)
    with pytest.raises(httpclient.InferenceServerException):
        _infer(client, 2, NO_ROUTER)  # no router logits: a failure of that model
    stats = client.get_inference_statistics(TINY)
    (tiny,) = stats["model_stats"]
    assert (tiny["name"], tiny["version"]) == (TINY, "1")
    assert tiny["inference_count"] == 8  # tokens, as Triton counts batch rows
    assert tiny["execution_count"] == 2  # one forward each (warm-up forwards do not count)
    inference = tiny["inference_stats"]
    assert inference["success"]["count"] == 2 and inference["success"]["ns"] > 0
    assert inference["fail"] == {"count": 0, "ns": 0}
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[phase]["count"] == 2, phase
    assert sorted(b["batch_size"] for b in tiny["batch_stats"]) == [3, 5]
    assert tiny["last_inference"] > 1.7e12  # ms since the epoch
    failed = client.get_inference_statistics(NO_ROUTER, "1")["model_stats"][0]
    assert failed["inference_stats"]["fail"]["count"] == 1
    assert failed["inference_count"] == 0
    every = client.get_inference_statistics()["model_stats"]
    assert sorted(m["name"] for m in every) == sorted([TINY, NO_ROUTER])


def test_grpc_model_statistics_match_http(urls) -> None:
    _infer(httpclient.InferenceServerClient(urls[0].removeprefix("http://")), 4)
    with grpcclient.InferenceServerClient(urls[1]) as c:
        stats = c.get_inference_statistics(TINY, as_json=True)["model_stats"][0]
    http = httpx.get(f"{urls[0]}/v2/models/{TINY}/stats").json()["model_stats"][0]
    assert int(stats["inference_count"]) == http["inference_count"] == 4
    assert int(stats["inference_stats"]["success"]["count"]) == 1


def test_stats_of_an_unknown_model_or_version_are_404(urls) -> None:
    assert httpx.get(f"{urls[0]}/v2/models/nope/stats").status_code == 404
    r = httpx.get(f"{urls[0]}/v2/models/{TINY}/versions/2/stats")
    assert r.status_code == 404 and "version 1 only" in r.json()["error"]
    with (
        grpcclient.InferenceServerClient(urls[1]) as c,
        pytest.raises(grpcclient.InferenceServerException) as err,
    ):
        c.get_inference_statistics("nope")
    assert err.value.status() == "StatusCode.NOT_FOUND"


def _samples(url: str, metric: str, label: str = "") -> dict[str, float]:
    """{model: value} of one metric's samples labelled version="1" (and `label`)."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(metric + "{") and label in line:
            labels, value = line[len(metric) + 1 :].split("} ")
            fields = dict(kv.split("=") for kv in labels.split(","))
            assert fields["version"] == '"1"'
            values[fields["model"].strip('"')] = float(value)
    return values


def test_nv_inference_metrics_beside_moe_serve_ones(urls) -> None:
    url = urls[0]
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    _infer(client, 3)
    _infer(client, 3)
    with pytest.raises(httpclient.InferenceServerException):
        _infer(client, 1, NO_ROUTER)
    assert _samples(url, "nv_inference_request_success") == {TINY: 2, NO_ROUTER: 0}
    failures = _samples(url, "nv_inference_request_failure", 'reason="OTHER"')
    assert failures == {TINY: 0, NO_ROUTER: 1}  # bad input
    assert _samples(url, "nv_inference_request_failure", 'reason="BACKEND"') == {
        TINY: 0,
        NO_ROUTER: 0,
    }
    assert _samples(url, "nv_inference_count")[TINY] == 6
    assert _samples(url, "nv_inference_exec_count")[TINY] == 2
    assert _samples(url, "nv_inference_pending_request_count") == {TINY: 0, NO_ROUTER: 0}
    stats = httpx.get(f"{url}/v2/models/{TINY}/stats").json()["model_stats"][0]
    inference = stats["inference_stats"]
    durations = {  # the same numbers as /stats, in microseconds
        "nv_inference_request_duration_us": inference["success"]["ns"] + inference["fail"]["ns"],
        "nv_inference_queue_duration_us": inference["queue"]["ns"],
        "nv_inference_compute_input_duration_us": inference["compute_input"]["ns"],
        "nv_inference_compute_infer_duration_us": inference["compute_infer"]["ns"],
        "nv_inference_compute_output_duration_us": inference["compute_output"]["ns"],
    }
    for metric, ns in durations.items():
        assert _samples(url, metric)[TINY] == ns // 1000, metric
    assert _samples(url, "nv_inference_compute_infer_duration_us")[TINY] > 0  # two forwards
    assert "moe_serve_forward_seconds" in httpx.get(f"{url}/metrics").text


def test_times_are_measured_in_nanoseconds_for_sequential_requests(urls) -> None:
    """Each sequential request adds its own queue, compute and request time, on a clock finer
    than the event loop's milliseconds; every forward fills its batch size's three phases."""
    client = httpclient.InferenceServerClient(urls[0].removeprefix("http://"))
    phases = ("success", "queue", "compute_input", "compute_infer", "compute_output")
    seen = []
    for rows in (1, 2, 1, 2):
        _infer(client, rows)
        stats = client.get_inference_statistics(TINY)["model_stats"][0]
        seen.append({p: stats["inference_stats"][p]["ns"] for p in phases})
    for earlier, later in itertools.pairwise(seen):
        for phase in phases:
            assert later[phase] > earlier[phase], phase
    assert any(ns % 1_000_000 for ns in (s["queue"] for s in seen))
    for batch in stats["batch_stats"]:
        counts = {
            p: batch[p]["count"] for p in ("compute_input", "compute_infer", "compute_output")
        }
        assert set(counts.values()) == {2}, batch  # two forwards of each size
    (usage,) = stats["memory_usage"]  # the layer's weights
    assert usage["type"] == "CPU" and usage["byte_size"] > 0
    with grpcclient.InferenceServerClient(urls[1]) as c:
        message = c.get_inference_statistics(TINY).model_stats[0]
    assert message.memory_usage[0].byte_size == stats["memory_usage"][0]["byte_size"]
    assert message.batch_stats[0].compute_input.count == 2
