"""Tiny in-memory layers for the service tests, and the unbatched reference forward."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx
import torch
import uvicorn
from fastapi import FastAPI

from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.layer import LayerWeights, RouterWeights, build_layer
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.frontends.supervisor import FrontEnds
from moe_serve.service.http.app import create_app
from moe_serve.service.http.server import listen, server_config
from moe_serve.service.settings import Settings

E, H, INTER, TOP_K = 4, 64, 128, 2
CPU = torch.device("cpu")
TINY = "tiny"  # float32, stored router
NO_ROUTER = "tiny-no-router"  # clients must send router logits
START_TIMEOUT_S = 20.0


@dataclass
class TinyLayer:
    name: str
    config: MoEConfig
    weights: LayerWeights
    device: torch.device = CPU  # where `weights` are


def tiny_layers(seed: int = 0) -> list[TinyLayer]:
    cfg = MoEConfig(E, H, INTER, RoutingConfig(top_k=TOP_K), dtype=torch.float32)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(seed)) / H**0.5
    return [
        TinyLayer(TINY, cfg, LayerWeights(random_expert_weights(cfg, seed), RouterWeights(router))),
        TinyLayer(
            NO_ROUTER, cfg, LayerWeights(random_expert_weights(cfg, seed + 1), RouterWeights())
        ),
    ]


def layers_of_dtypes(
    dtypes: dict[str, torch.dtype],
    device: torch.device,
    shape: tuple[int, int, int] = (E, H, INTER),
) -> list[TinyLayer]:
    """A layer with a stored router per (name, dtype) of `shape` (experts, hidden,
    intermediate), each drawn from its own seed (its position), its weights on `device`: the
    same layers on every device."""
    layers = []
    experts, hidden, _ = shape
    for seed, (name, dtype) in enumerate(dtypes.items()):
        cfg = MoEConfig(*shape, RoutingConfig(top_k=TOP_K), dtype=dtype)
        gen = torch.Generator().manual_seed(seed)
        router = torch.randn(experts, hidden, generator=gen) / hidden**0.5
        weights = LayerWeights(random_expert_weights(cfg, seed), RouterWeights(router))
        on_device = {n: t.to(device) for n, t in weights.tensors().items()}
        layers.append(TinyLayer(name, cfg, LayerWeights.from_tensors(on_device), device))
    return layers


def tiny_loader(settings: object, devices: Sequence[torch.device]) -> list[TinyLayer]:
    return tiny_layers()


def gated_loader(
    release: threading.Event,
) -> Callable[[object, Sequence[torch.device]], list[TinyLayer]]:
    """tiny_loader that waits for `release` (up to 10 s): a server that stays loading."""

    def loader(settings: object, devices: Sequence[torch.device]) -> list[TinyLayer]:
        release.wait(10)
        return tiny_loader(settings, devices)

    return loader


def reference_forward(
    name: str, hidden: torch.Tensor, logits: torch.Tensor | None = None
) -> torch.Tensor:
    """The layer's output for exactly these rows, one unbatched forward on the reference backend."""
    source = next(layer for layer in tiny_layers() if layer.name == name)
    layer, _ = build_layer(source.config, source.weights, torch.device("cpu"), "reference")
    with torch.inference_mode():
        inputs = ForwardInputs(hidden.float(), None if logits is None else logits.float())
        return layer.forward(inputs).output


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for the gRPC listener, which 0 turns off)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app: FastAPI, server: uvicorn.Server | None = None) -> Iterator[str]:
    """A real uvicorn server for `app` on a free 127.0.0.1 port, configured as `moe-serve serve`
    configures it (or `server`, made for `app`); yields its base URL."""
    server = server or uvicorn.Server(server_config(app, app.state.runtime.settings))
    listener = listen("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = listener.getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)


@contextlib.contextmanager
def running_front_ends(
    settings: Settings,
    loader: Callable = tiny_loader,
    start_timeout_s: float = START_TIMEOUT_S,
    started: Callable[[str], bool] | None = None,
) -> Iterator[FrontEnds]:
    """`moe-serve serve --http-workers N` as serve.run sets it up, this process the engine (its
    uvicorn on a thread, on the Unix socket), the front ends real processes on a free
    127.0.0.1 port; yields the FrontEnds (`.listener` has the port) once the service is ready
    (or once `started(url)`)."""
    listener = listen("127.0.0.1", 0)
    front_ends = FrontEnds(settings, listener)
    app = create_app(settings, loader, front_ends=front_ends)
    server = uvicorn.Server(server_config(app, settings, str(front_ends.http_path)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    deadline = time.monotonic() + start_timeout_s
    while not (started or _ready)(url):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the front ends did not start")
        time.sleep(0.05)
    try:
        yield front_ends
    finally:
        # as SIGTERM does (service/serve.py): the front ends drain first, closing their
        # connections to the engine, whose drain would otherwise wait on them
        front_ends.terminate()
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        listener.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready").status_code == 200
    except httpx.TransportError:
        return False
