"""KServe v2 with the stock tritonclient (JSON and binary tensors) against a real server."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch

from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import (
    NO_ROUTER,
    TINY,
    E,
    H,
    reference_forward,
    running_server,
    tiny_loader,
)

# a test dependency; the GPU machine lacks it (its CPU twin runs these in CI)
triton = pytest.importorskip("tritonclient.http")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    app = create_app(Settings(device="cpu", max_batch_delay_ms=1.0), tiny_loader)
    with running_server(app) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield url


@pytest.fixture
def triton_client(server_url: str) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(server_url.removeprefix("http://"))
    yield client
    client.close()


def _input(name: str, array: np.ndarray, binary: bool) -> triton.InferInput:
    datatype = {np.float32: "FP32", np.float16: "FP16"}[array.dtype.type]
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_tritonclient_infer_matches_the_reference(triton_client, binary: bool, dtype) -> None:
    x = np.random.default_rng(0).standard_normal((5, H)).astype(dtype)
    result = triton_client.infer(
        TINY,
        [_input("hidden_states", x, binary)],
        outputs=[triton.InferRequestedOutput("output", binary_data=binary)],
        request_id="req-7",
    )
    out = result.as_numpy("output")
    assert out.dtype == dtype and out.shape == (5, H)
    expected = reference_forward(TINY, torch.from_numpy(x)).to(torch.from_numpy(x).dtype)
    torch.testing.assert_close(torch.tensor(out), expected)
    assert result.get_response()["id"] == "req-7"


def test_tritonclient_sends_router_logits(triton_client) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, H)).astype(np.float32)
    logits = rng.standard_normal((3, E)).astype(np.float32)
    inputs = [_input("hidden_states", x, True), _input("router_logits", logits, True)]
    out = triton_client.infer(NO_ROUTER, inputs).as_numpy("output")  # no outputs: all binary
    expected = reference_forward(NO_ROUTER, torch.from_numpy(x), torch.from_numpy(logits))
    torch.testing.assert_close(torch.tensor(out), expected)


def test_tritonclient_health_and_metadata(triton_client) -> None:
    assert triton_client.is_server_live()
    assert triton_client.is_server_ready()
    assert triton_client.is_model_ready(TINY)
    assert not triton_client.is_model_ready("nope")
    assert "binary_tensor_data" in triton_client.get_server_metadata()["extensions"]
    meta = triton_client.get_model_metadata(TINY)
    assert meta["inputs"][0] == {"name": "hidden_states", "datatype": "FP32", "shape": [-1, H]}
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, H]}]


def test_tritonclient_sees_a_wrong_shape_named(triton_client) -> None:
    x = np.zeros((2, H + 3), dtype=np.float32)
    with pytest.raises(
        triton.InferenceServerException, match="hidden_states has 67 columns"
    ) as err:
        triton_client.infer(TINY, [_input("hidden_states", x, True)])
    assert err.value.status() == "400"


def test_infer_with_an_unknown_output_returns_400(server_url: str) -> None:
    body = {
        "inputs": [
            {"name": "hidden_states", "shape": [1, H], "datatype": "FP32", "data": [0.0] * H}
        ],
        "outputs": [{"name": "logits"}],
    }
    r = httpx.post(f"{server_url}/v2/models/{TINY}/infer", json=body)
    assert r.status_code == 400
    assert r.json() == {"error": "unknown output 'logits'; model 'tiny' has 'output'"}


def test_infer_with_an_output_requested_twice_returns_400(server_url: str) -> None:
    """Two entries for the one output (each may name its own place or binary_data): a 400, not
    one of them chosen."""
    body = {
        "inputs": [
            {"name": "hidden_states", "shape": [1, H], "datatype": "FP32", "data": [0.0] * H}
        ],
        "outputs": [{"name": "output"}, {"name": "output", "parameters": {"binary_data": True}}],
    }
    r = httpx.post(f"{server_url}/v2/models/{TINY}/infer", json=body)
    assert r.status_code == 400
    assert r.json() == {"error": "output output is requested twice"}


def test_infer_asking_for_classification_returns_400(server_url: str) -> None:
    """The classification extension is not offered: asking for it is a 400, not a tensor
    answered as if it had not been asked."""
    body = {
        "inputs": [
            {"name": "hidden_states", "shape": [1, H], "datatype": "FP32", "data": [0.0] * H}
        ],
        "outputs": [{"name": "output", "parameters": {"classification": 3}}],
    }
    r = httpx.post(f"{server_url}/v2/models/{TINY}/infer", json=body)
    assert r.status_code == 400
    assert r.json() == {"error": "output output: classification is not supported (the tensor only)"}
    body["outputs"] = [{"name": "output", "parameters": {"classification": 0}}]  # not asked
    assert httpx.post(f"{server_url}/v2/models/{TINY}/infer", json=body).status_code == 200


@pytest.mark.parametrize(
    "length", [b"x", b"-1", b"\xb2"], ids=["letter", "negative", "superscript"]
)
def test_a_header_length_that_is_not_a_byte_count_returns_400(server_url: str, length) -> None:
    r = httpx.post(
        f"{server_url}/v2/models/{TINY}/infer",
        content=b"{}",
        headers={"Content-Type": "application/json", "Inference-Header-Content-Length": length},
    )
    assert r.status_code == 400
    assert r.json()["error"].startswith("Inference-Header-Content-Length must be a byte count")


def test_a_json_part_over_the_json_limit_returns_413(server_url: str) -> None:
    r = httpx.post(
        f"{server_url}/v2/models/{TINY}/infer",
        content=b"{}",
        headers={"Content-Type": "application/json", "Inference-Header-Content-Length": "9" * 9},
    )
    assert r.status_code == 413
    error = r.json()["error"]
    assert error.startswith("the JSON part of 999999999 bytes exceeds the 16777216-byte")


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_requests_are_inflated(triton_client, algorithm: str) -> None:
    x = np.random.default_rng(2).standard_normal((4, H)).astype(np.float32)
    result = triton_client.infer(
        TINY, [_input("hidden_states", x, True)], request_compression_algorithm=algorithm
    )
    expected = reference_forward(TINY, torch.from_numpy(x))
    torch.testing.assert_close(torch.tensor(result.as_numpy("output")), expected)


def test_tritonclient_naming_the_version_works(triton_client) -> None:
    x = np.random.default_rng(3).standard_normal((2, H)).astype(np.float32)
    result = triton_client.infer(TINY, [_input("hidden_states", x, True)], model_version="1")
    expected = reference_forward(TINY, torch.from_numpy(x))
    torch.testing.assert_close(torch.tensor(result.as_numpy("output")), expected)
    assert triton_client.is_model_ready(TINY, "1")
    assert triton_client.get_model_metadata(TINY, "1")["versions"] == ["1"]


def test_tritonclient_naming_a_missing_version_gets_404(triton_client) -> None:
    x = np.zeros((1, H), dtype=np.float32)
    refused = triton.InferenceServerException
    with pytest.raises(refused, match="model 'tiny' has version 1 only, not '2'") as err:
        triton_client.infer(TINY, [_input("hidden_states", x, True)], model_version="2")
    assert err.value.status() == "404"
    assert not triton_client.is_model_ready(TINY, "2")
