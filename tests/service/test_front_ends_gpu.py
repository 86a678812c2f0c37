"""`--http-workers` on a GPU: bodies in a front end's arena are copied to the device from where
they lie and outputs straight back into the arena (registered with CUDA). Replies match the
reference for merged, padded and split batches, in the layer's dtype (the direct path) and in
another (cast, then copied), a NaN body is still a 400, and a large JSON body is read on the
device from the arena."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.codecs import json_device
from moe_serve.service.codecs.safetensors_wire import decode_safetensors, encode_safetensors
from moe_serve.service.settings import Settings
from tests.service.layers import H, TinyLayer, layers_of_dtypes, running_front_ends

pytestmark = pytest.mark.gpu

BINARY = {"Content-Type": "application/octet-stream"}
MAX_BATCH = 64  # a 150-row request goes in three pieces
LAYERS = {"f32": torch.float32, "bf16": torch.bfloat16}


def _layers(device: torch.device) -> list[TinyLayer]:
    return layers_of_dtypes(LAYERS, device)


def _reference(name: str, x: torch.Tensor) -> torch.Tensor:
    layer = next(t for t in _layers(torch.device("cpu")) if t.name == name)
    model, _ = build_layer(layer.config, layer.weights, torch.device("cpu"), "reference")
    return model.forward(ForwardInputs(x.to(layer.config.dtype))).output


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


ENGINE_LOG = _Records()  # what the engine's end of the channel logged


@pytest.fixture(scope="module")
def url():
    settings = Settings(device="cuda", http_workers=2, grpc_port=0, max_batch_tokens=MAX_BATCH)
    loader = lambda _settings, devices: _layers(devices[0])  # noqa: E731
    logger = logging.getLogger("moe_serve.service.frontends.channel_server")
    logger.addHandler(ENGINE_LOG)
    logger.setLevel(logging.INFO)
    try:
        with running_front_ends(settings, loader, start_timeout_s=300) as front_ends:
            yield f"http://127.0.0.1:{front_ends.listener.getsockname()[1]}"
    finally:
        logger.removeHandler(ENGINE_LOG)


@pytest.mark.parametrize("name", list(LAYERS))
def test_concurrent_forwards_through_the_arena_match_the_reference(url: str, name: str) -> None:
    dtype = LAYERS[name]
    sizes = (1, 5, 64, 3, 150, 2, 33)
    inputs = [torch.randn(t, H, generator=torch.Generator().manual_seed(t)) for t in sizes]
    bodies = [x.to(dtype) for x in inputs] + [x.to(torch.float16) for x in inputs]

    def post(x: torch.Tensor) -> httpx.Response:
        blob = encode_safetensors({"hidden_states": x}, {})
        return httpx.post(f"{url}/v1/layers/{name}/forward", content=blob, headers=BINARY)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(post, bodies * 3))
    for x, reply in zip(bodies * 3, replies, strict=True):
        assert reply.status_code == 200, reply.text
        out = decode_safetensors(reply.content)["output"]
        assert out.dtype == x.dtype and out.shape == x.shape
        error = relative_error(out.float(), _reference(name, x).float())
        assert error < 2e-2, f"{name}: {len(x)} rows of {x.dtype}: {error:.2e}"
    # the direct path ran: each arena that served was registered with CUDA, once
    registered = [m for m in ENGINE_LOG.messages if "registered with CUDA" in m]
    assert registered and all(" not registered" not in m for m in registered), registered
    assert len(registered) == len(set(registered)) <= 2, registered


def test_a_nan_body_is_refused_by_name(url: str) -> None:
    x = torch.randn(4, H).bfloat16()
    x[2, 5] = float("nan")
    blob = encode_safetensors({"hidden_states": x}, {})
    reply = httpx.post(f"{url}/v1/layers/bf16/forward", content=blob, headers=BINARY)
    assert reply.status_code == 400
    assert "row 2, column 5" in reply.text


@pytest.mark.parametrize("tokens", [3, 900], ids=["decoded-by-the-front-end", "read-on-the-gpu"])
def test_json_forwards_match_the_reference_on_either_side_of_the_front_ends_json_size(
    url: str, tokens: int
) -> None:
    """A large JSON body goes to the engine as its text, through the front end's arena; the
    engine reads it and prints its output on the GPU (service/codecs/json_device.py; in pieces
    here: MAX_BATCH rows at a time)."""
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    body = json.dumps({"hidden_states": x.float().tolist()}).encode()
    assert json_device.worth_it(len(body)) == (tokens > 3)
    reply = httpx.post(
        f"{url}/v1/layers/bf16/forward",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    out = torch.tensor(reply.json()["output"])
    assert out.shape == x.shape
    assert relative_error(out, _reference("bf16", x).float()) < 2e-2
