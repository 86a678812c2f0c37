"""What Triton's tools ask of a server beyond inference, through the stock tritonclient (HTTP and
gRPC) against one real server: the model configuration, streaming inference, the trace and log
settings, the metrics page."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import NO_ROUTER, TINY, E, H, free_port, running_server, tiny_loader

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")


@pytest.fixture(scope="module")
def urls() -> Iterator[tuple[str, str]]:
    """(HTTP base URL, gRPC host:port) of one server."""
    port = free_port()
    settings = Settings(
        device="cpu", grpc_port=port, max_batch_tokens=32, max_batch_delay_ms=0.5, max_queue=8
    )
    app = create_app(settings, tiny_loader)
    with running_server(app) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield url, f"127.0.0.1:{port}"


@pytest.fixture
def http(urls: tuple[str, str]) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(urls[0].removeprefix("http://"))


@pytest.fixture
def grpc(urls: tuple[str, str]) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(urls[1]) as client:
        yield client


def test_model_config_in_tritons_schema_over_http_and_grpc(http, grpc) -> None:
    config = http.get_model_config(TINY)
    assert config == http.get_model_config(TINY, "1")
    assert (config["name"], config["platform"], config["backend"]) == (TINY, "moe-serve", "reference")
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
