"""KServe v2 with the stock tritonclient (JSON and binary tensors) against a real server, and
the codec's round trips and refusals."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from service.app import create_app
from service.errors import BadInput
from service.kserve_codec import decode_request, encode_response
from service.settings import Settings
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
    with pytest.raises(InferenceServerException, match="hidden_states has 67 columns") as err:
        triton_client.infer(TINY, [_input("hidden_states", x, True)])
    assert err.value.status() == "400"


# ---- codec -----------------------------------------------------------------------------------


def _binary_request(tensor: torch.Tensor, size: int | None = None) -> tuple[bytes, int]:
    raw = tensor.numpy().tobytes()
    header = {
        "inputs": [
            {
                "name": "hidden_states",
                "shape": list(tensor.shape),
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(raw) if size is None else size},
            }
        ],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
    }
    text = json.dumps(header).encode()
    return text + raw, len(text)


def test_codec_round_trips_binary_tensors() -> None:
    x = torch.randn(3, 4)
    request, tensors = decode_request(*_binary_request(x))
    assert torch.equal(tensors["hidden_states"], x)
    encoded = encode_response("m", request, {"output": x.half()})
    header = json.loads(encoded.body[: encoded.header_length])
    assert header["outputs"][0] == {
        "name": "output",
        "shape": [3, 4],
        "datatype": "FP16",
        "parameters": {"binary_data_size": 24},
    }
    back = torch.frombuffer(bytearray(encoded.body[encoded.header_length :]), dtype=torch.float16)
    assert torch.equal(back.reshape(3, 4), x.half())


def test_codec_json_tensors_accept_flat_and_nested_data() -> None:
    for data in ([1, 2, 3, 4], [[1, 2], [3, 4]]):
        body = {"inputs": [{"name": "a", "shape": [2, 2], "datatype": "FP32", "data": data}]}
        _, tensors = decode_request(json.dumps(body).encode(), None)
        assert tensors["a"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


CODEC_ERRORS = {
    "size mismatch": (
        lambda: _binary_request(torch.zeros(2, 4), size=16),
        "16 binary bytes for shape [2, 4]",
    ),
    "header longer than body": (lambda: (b"{}", 10), "Inference-Header-Content-Length is 10"),
    "trailing bytes": (
        lambda: (
            _binary_request(torch.zeros(1, 2))[0] + b"xx",
            _binary_request(torch.zeros(1, 2))[1],
        ),
        "2 binary bytes follow",
    ),
    "unknown datatype": (
        lambda: (
            json.dumps(
                {"inputs": [{"name": "a", "shape": [1], "datatype": "STRING", "data": ["x"]}]}
            ).encode(),
            None,
        ),
        "datatype 'STRING' is not supported",
    ),
    "too few values": (
        lambda: (
            json.dumps(
                {"inputs": [{"name": "a", "shape": [2, 2], "datatype": "FP32", "data": [1]}]}
            ).encode(),
            None,
        ),
        "1 values do not fill shape [2, 2]",
    ),
    "no data": (
        lambda: (
            json.dumps({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32"}]}).encode(),
            None,
        ),
        "neither data nor parameters.binary_data_size",
    ),
    "not a request": (lambda: (b'{"inputs": 3}', None), "inputs"),
}


@pytest.mark.parametrize("case", CODEC_ERRORS, ids=str)
def test_codec_refuses_malformed_requests_naming_the_problem(case: str) -> None:
    make, message = CODEC_ERRORS[case]
    with pytest.raises(BadInput, match=re.escape(message)):
        decode_request(*make())


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
