"""create_app(settings): the FastAPI app. Its lifespan starts the runtime in the background
(service/core/runtime.py: the layers loaded and warmed, then the batcher), gRPC, the metrics port
and the front ends; /ready turns 200 only once the runtime is ready."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ... import __version__
from .. import tracing
from ..core.probes import SHUTTING_DOWN
from ..core.runtime import LayerLoader, Runtime, load_from_disk, shut_down, start_up
from ..errors import install_handlers
from ..frontends.supervisor import FrontEnds
from ..grpc.server import GrpcServer
from ..metrics import Metrics
from ..settings import Settings
from ..triton.repository import Repository
from ..triton.shared_memory import SharedMemory
from . import docs
from .endpoints import Endpoints
from .forward_body import forward_body_sink
from .metrics_port import MetricsPort
from .middleware import OPEN_PATHS, RequestMiddleware
from .route_methods import route_methods
from .routes import (
    forward,
    health,
    introspect,
    kserve,
    metrics,
    placement,
    repository,
    shared_memory,
    trace_logging,
)


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
            allowed=settings.allow_shared_memory,
            key_prefix=settings.shared_memory_prefix,
            max_regions=settings.max_shared_memory_regions,
            max_copied_bytes=settings.max_shared_memory_copy_bytes,
        ),
        repository=None if root is None else Repository(root),
    )

    @asynccontextmanager
    async def lifespan(served: FastAPI) -> AsyncIterator[None]:
        grpc_server = GrpcServer(runtime) if settings.grpc_port else None
        metrics_port = MetricsPort(settings, runtime.metrics) if settings.metrics_port else None
        try:
            if grpc_server is not None:
                await grpc_server.start()
            if metrics_port is not None:
                await metrics_port.start()
        except OSError:
            runtime.start_failed = True  # uvicorn stops; `moe-serve serve` exits 1
            raise
        starting = asyncio.create_task(start_up(runtime, loader))
        if front_ends is not None:
            await front_ends.start(runtime, route_methods(served.routes))
        yield
        runtime.not_ready = SHUTTING_DOWN
        if front_ends is not None:  # their requests finish first
            await front_ends.stop(settings.drain_timeout_s)
        if grpc_server is not None:  # in-flight calls finish first, by the drain's deadline
            await grpc_server.stop()
        await starting  # a load in progress finishes before the process exits
        await shut_down(runtime)
        if metrics_port is not None:  # scraped to the end
            await metrics_port.stop()

    app = docs.offline_app(
        title="moe-serve",
        version=__version__,
        summary="Mixture-of-Experts layers over HTTP: JSON, safetensors and KServe v2",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.body_sink = forward_body_sink(runtime)  # the server's connections read into it
    install_handlers(app)
    routers = (
        health,
        metrics,
        introspect,
        forward,
        kserve,
        shared_memory,
        repository,
        placement,
        trace_logging,
    )
    for module in routers:
        app.include_router(module.router)
    # innermost: the tracing middleware and RequestMiddleware wrap them as they wrap the routes
    endpoints = [forward.ForwardEndpoint(runtime), kserve.InferEndpoint(runtime)]
    app.add_middleware(Endpoints, endpoints=endpoints)
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
