"""`serve --devices cuda:0,cuda:1` on two GPUs: random layers placed over both by memory, each
with its own pipeline and CUDA graphs on its GPU, all behind one endpoint; every layer answers
as the reference does, alone and under requests spread over all layers at once.

Run on a machine with two GPUs:
    python3 -m pytest -q -m gpu tests/service/test_devices_gpu.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from moe_serve.bench.random_layer import random_layer
from moe_serve.kernels.accuracy import BY_DTYPE, SERVED_FP8_LAYER, relative_error
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.layer import MoELayer, build_layer
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.weights.load import load_layer
from moe_serve.weights.manifest import Manifest, Source
from moe_serve.weights.write import write_layer
from tests.service.conftest import wait_ready
from tests.service.layers import running_server

pytestmark = pytest.mark.gpu

READY_TIMEOUT_S = 600.0  # every layer compiles and captures its buckets on its GPU
HIDDEN = 2048
# Distinct sizes (bf16 2048: ~400 MB, fp8 2048: ~200 MB, bf16 768: ~150 MB, fp8 1024: ~100 MB):
# with as much free on each GPU, the two largest go to different GPUs
LAYERS = {
    "bf16-2048": (2048, QuantScheme.NONE),
    "fp8-2048": (2048, QuantScheme.FP8_BLOCK),
    "bf16-768": (768, QuantScheme.NONE),
    "fp8-1024": (1024, QuantScheme.FP8_BLOCK),
}
TOLERANCE = {QuantScheme.NONE: BY_DTYPE[torch.bfloat16], QuantScheme.FP8_BLOCK: SERVED_FP8_LAYER}


def _write_layers(root: Path) -> None:
    for seed, (name, (intermediate, scheme)) in enumerate(LAYERS.items()):
        routing = RoutingConfig(top_k=2)
        cfg = MoEConfig(16, HIDDEN, intermediate, routing, quant=QuantConfig(scheme))
        weights = random_layer(cfg, torch.device("cuda", 0), seed=seed, router=True)
        source = Source(family="bench", model=f"random-{name}", layer=seed)
        manifest = Manifest.from_config(cfg, weights, name=name, source=source)
        write_layer(root / name, weights, manifest)


def _hidden(tokens: int, seed: int) -> torch.Tensor:
    """Values bf16 holds exactly: the service rounds its input to the layer's dtype before
    routing, and a near tie may route float32 input elsewhere."""
    hidden = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return hidden.to(torch.bfloat16).float()


def _references(root: Path) -> dict[str, MoELayer]:
    """Each layer on the exact reference backend, on the CPU."""
    cpu = torch.device("cpu")
    references = {}
    for name in LAYERS:
        source = load_layer(root / name, cpu)
        references[name], _ = build_layer(source.config, source.weights, cpu, "reference")
    return references


def _check(url: str, references: dict[str, MoELayer], name: str, tokens: int, seed: int) -> None:
    hidden = _hidden(tokens, seed)
    r = httpx.post(
        f"{url}/v1/layers/{name}/forward", json={"hidden_states": hidden.tolist()}, timeout=60
    )
    assert r.status_code == 200, r.text
    with torch.inference_mode():
        want = references[name].forward(ForwardInputs(hidden)).output.float()
    got = torch.tensor(r.json()["output"])
    assert relative_error(got, want) < TOLERANCE[LAYERS[name][1]], (name, tokens, seed)


def test_layers_placed_over_two_gpus_answer_as_the_reference_each_on_its_own_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    # Each GPU reports the same free memory: other processes on a shared machine would otherwise
    # decide the placement (place_layers against real free memory is tested in test_devices.py)
    monkeypatch.setattr("moe_serve.service.engine.devices.free_bytes", lambda _device: 64 << 30)
    _write_layers(tmp_path)
    torch.cuda.empty_cache()
    references = _references(tmp_path)
    settings = Settings(
        devices="cuda:0,cuda:1",
        weights=tuple(tmp_path / name for name in LAYERS),
        calibrate="off",
        max_batch_tokens=256,
        cache_dir=tmp_path / "cache",
    )
    app = create_app(settings)
    with running_server(app) as url:
        wait_ready(lambda path: httpx.get(f"{url}{path}"), READY_TIMEOUT_S)
        layers = {la["name"]: la for la in httpx.get(f"{url}/v1/layers").json()["layers"]}
        devices = {name: layer["device"] for name, layer in layers.items()}
        assert devices["bf16-2048"] != devices["fp8-2048"], devices
        assert set(devices.values()) == {"cuda:0", "cuda:1"}, devices

        engine = app.state.runtime.engine
        for name, served in engine.layers.items():  # the weights, graphs and streams are there
            assert str(served.device) == devices[name]
            assert served.layer.router.weight.device == served.device
            assert served.graphs is not None and served.graphs.captured_buckets(), name
            config = httpx.get(f"{url}/v2/models/{name}/config").json()
            assert config["instance_group"][0]["gpus"] == [served.device.index]
        backends = {b["layer"]: b for b in httpx.get(f"{url}/backends").json()["layers"]}
        assert {name: b["device"] for name, b in backends.items()} == devices

        for name in LAYERS:
            for tokens in (1, 37, 256, 300):  # between buckets, the largest, two pieces
                _check(url, references, name, tokens, seed=tokens)
        spread = [(name, 1 + 13 * i, 100 + i) for i in range(6) for name in LAYERS]
        with ThreadPoolExecutor(len(spread)) as pool:  # every layer's GPU busy at once
            for done in [pool.submit(_check, url, references, *args) for args in spread]:
                done.result()
