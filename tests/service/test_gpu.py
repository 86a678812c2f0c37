"""The service on a GPU with the demo layers: a GPU backend is chosen, /backends shows the
device, and forwards over HTTP match the reference backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fastapi.testclient import TestClient

from kernels.accuracy import relative_error
from kernels.layer import build_layer
from kernels.tensors import ForwardInputs
from service.app import create_app
from service.settings import Settings
from tests.service.conftest import wait_ready
from weights.load import load_layer

pytestmark = pytest.mark.gpu

GPU_READY_TIMEOUT_S = 300.0  # warm-up compiles every tile bucket up to max_batch_tokens
TOLERANCE = {"demo": 2e-2, "demo-fp8": 6e-2}  # bf16 out; fp8 rounds inputs and intermediates


@pytest.fixture(scope="module")
def gpu_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    cache = tmp_path_factory.mktemp("cache")
    with TestClient(create_app(Settings(device="cuda", cache_dir=cache))) as client:
        wait_ready(client.get, GPU_READY_TIMEOUT_S)
        yield client, cache


def test_backends_shows_the_gpu_and_a_gpu_backend_per_layer(gpu_client) -> None:
    client, _ = gpu_client
    backends = client.get("/backends").json()
    assert backends["device"]["type"] == "cuda"
    assert backends["device"]["memory_bytes"] > 0
    assert backends["device"]["compute_capability"]
    for layer in backends["layers"]:
        assert layer["experts"] not in ("reference", "reference-batched"), layer


@pytest.mark.parametrize("tokens", [1, 64, 300], ids=lambda t: f"M={t}")
def test_demo_layers_on_gpu_match_the_reference(gpu_client, tokens: int) -> None:
    client, cache = gpu_client
    for layer in client.get("/backends").json()["layers"]:
        name = layer["layer"]
        loaded = load_layer(cache / name, torch.device("cpu"))
        cpu = torch.device("cpu")
        reference, _ = build_layer(loaded.config, loaded.weights, cpu, "reference")
        hidden = torch.randn(tokens, loaded.config.hidden_size).bfloat16()
        r = client.post(
            f"/v1/layers/{name}/forward",
            content=safetensors.torch.save({"hidden_states": hidden}),
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
        out = safetensors.torch.load(r.content)["output"]
        error = relative_error(out, reference.forward(ForwardInputs(hidden)).output)
        assert error < TOLERANCE[name], f"{name} on {layer['experts']}: {error:.2e}"
