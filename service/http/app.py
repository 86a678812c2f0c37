"""create_app(settings): the FastAPI app. Its lifespan loads the layers in the background,
warms each one, then starts the batcher; /ready turns 200 only after that."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import torch
from fastapi import FastAPI

from ... import __version__
from .. import tracing
from ..codecs import json_device
from ..engine.batcher import BatchPolicy, DynamicBatcher
from ..engine.engine import Engine, LayerSource
from ..ep.engine import EPEngine
from ..errors import install_handlers
from ..frontends.supervisor import FrontEnds
from ..grpc.servicer import start_grpc_server
from ..metrics import Metrics
from ..settings import Settings
from ..triton.repository import Repository
from ..triton.shared_memory import SharedMemory
from . import docs
from .deps import Runtime, pinned_body_sink
from .fast_path import ForwardFastPath, forward_route
from .kserve_fast_path import KServeInferFastPath
from .middleware import OPEN_PATHS, RequestMiddleware
from .routes import (
    forward,
    health,
    introspect,
    kserve,
    metrics,
    placement,
    repository,
    shared_memory,
)

log = logging.getLogger(__name__)

# A loader turns settings into layers whose weights are on `device`.
LayerLoader = Callable[[Settings, torch.device], Sequence[LayerSource]]


def layer_paths(settings: Settings) -> list[Path]:
    """The layers named by --weights, or the demo layers (generated into the cache once)."""
    from ...weights.demo import ensure_demo_layers

    if settings.weights or settings.model_repository is not None:
        return list(settings.weights)
    return ensure_demo_layers(settings.cache_dir)


def load_from_disk(settings: Settings, device: torch.device) -> list[LayerSource]:
    from ...weights.load import load_layer

    return [load_layer(path, device) for path in layer_paths(settings)]


def warm_up_tokens(max_batch_tokens: int, device: torch.device) -> list[int]:
    """On a GPU 1, 2, 4, ... up to and with max_batch_tokens: a batch of any size then finds its
    kernels' tile bucket compiled (and small batches their CUDA graphs captured). On the CPU
    nothing compiles: one token checks that each layer runs."""
    if device.type != "cuda":
        return [1]
    powers = [1 << i for i in range(max_batch_tokens.bit_length()) if 1 << i < max_batch_tokens]
    return [*powers, max_batch_tokens]


def _build_engine(settings: Settings, loader: LayerLoader, metrics: Metrics) -> Engine:
    device = settings.torch_device()
    if settings.ep > 1:  # this process is rank 0; each rank loads only its experts from disk
        engine = EPEngine(settings, layer_paths(settings), metrics)
        sources = engine.load()
    else:
        engine = Engine(
            device,
            settings.backend,
            settings.max_batch_tokens,
            cuda_graphs=settings.cuda_graphs,
            batch_invariant=settings.batch_invariant,
        )
        sources = loader(settings, device)
    try:
        for source in sources:
            served = engine.add(source)
            metrics.add_layer(served.name, served.config.num_experts)
        if not engine.layers and settings.model_repository is None:
            raise ValueError("no layers to serve")
        engine.warm_up(warm_up_tokens(settings.max_batch_tokens, device))
        if engine.device.type == "cuda":  # where large JSON bodies are read and printed
            json_device.warm_up(engine.device, {s.config.dtype for s in engine.layers.values()})
    except BaseException:
        if isinstance(engine, EPEngine):  # its ranks are up: stop them, or nothing will
            engine.close()
        raise
    return engine


async def _start(runtime: Runtime, loader: LayerLoader) -> None:
    settings = runtime.settings
    try:
        engine = await asyncio.to_thread(_build_engine, settings, loader, runtime.metrics)
    except Exception as err:
        # a bad layer file names itself; anything else is a bug, worth its traceback
        log.error("loading the layers failed: %s", err, exc_info=not isinstance(err, ValueError))
        runtime.not_ready = f"loading the layers failed: {err}"
        runtime.start_failed = True
        runtime.on_start_failure()
        return
    # one chunk size: batches of at most the tokens the layers' workspaces were reserved for
    policy = BatchPolicy(
        engine.chunk_tokens, settings.max_batch_delay_ms / 1000, settings.max_queue
    )
    # a device fault (or a lost expert-parallel rank) turns /ready and every request into 503
    engine.on_failure = partial(setattr, runtime, "not_ready")
    if isinstance(engine, EPEngine):  # a lost rank whose experts have copies: serve on
        engine.on_degraded = partial(setattr, runtime, "degraded")
    runtime.batcher = DynamicBatcher(engine, policy, runtime.metrics)
    runtime.batcher.start()
    runtime.engine = engine
    runtime.warm_up_tokens = warm_up_tokens(settings.max_batch_tokens, engine.device)
    if runtime.repository is not None:
        await runtime.repository.load_all(runtime)
    runtime.not_ready = None
    log.info("ready: %s on %s", ", ".join(engine.layers), engine.device)


def create_app(
    settings: Settings,
    loader: LayerLoader = load_from_disk,
    front_ends: FrontEnds | None = None,
) -> FastAPI:
    """The app; with `front_ends` (--http-workers) it serves them, on a Unix socket."""
    root = settings.model_repository
    runtime = Runtime(
        settings,
        Metrics(),
        shared_memory=SharedMemory(
            allowed=settings.allow_shared_memory, key_prefix=settings.shared_memory_prefix
        ),
        repository=None if root is None else Repository(root),
        front_ends=front_ends,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            grpc_server = await start_grpc_server(runtime) if settings.grpc_port else None
        except OSError:
            runtime.start_failed = True  # uvicorn stops; `moe-serve serve` exits 1
            raise
        starting = asyncio.create_task(_start(runtime, loader))
        if runtime.front_ends is not None:
            await runtime.front_ends.start(runtime)
        yield
        runtime.not_ready = "shutting down"
        if runtime.front_ends is not None:  # their requests finish first
            await runtime.front_ends.stop(settings.drain_timeout_s)
        if grpc_server is not None:  # in-flight RPCs finish first
            await grpc_server.stop(settings.drain_timeout_s)
        await starting  # a load in progress finishes before the process exits
        if runtime.batcher is not None:
            await runtime.batcher.close()
        runtime.shared_memory.close()
        if isinstance(runtime.engine, EPEngine):
            await asyncio.to_thread(runtime.engine.close)

    app = docs.offline_app(
        title="moe-serve",
        version=__version__,
        summary="Mixture-of-Experts layers over HTTP: JSON, safetensors and KServe v2",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.body_sink = pinned_body_sink(runtime)  # the server's connections read into it
    install_handlers(app)
    routers = (health, metrics, introspect, forward, kserve, shared_memory, repository, placement)
    for module in routers:
        app.include_router(module.router)
    # innermost: the tracing middleware and RequestMiddleware wrap them as they wrap the routes
    route = forward_route(forward.router.routes)
    app.add_middleware(ForwardFastPath, runtime=runtime, route=route)
    app.add_middleware(KServeInferFastPath, runtime=runtime, routes=kserve.router.routes)
    tracing.instrument_app(app)
    token = settings.api_token_bytes()
    if token is not None:
        docs.declare_bearer(app, OPEN_PATHS)
    app.add_middleware(
        RequestMiddleware,
        metrics=runtime.metrics,
        token=token,
        max_connections=settings.max_connections,
    )
    return app
