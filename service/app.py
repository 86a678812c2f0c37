"""create_app(settings): the FastAPI app. Its lifespan loads the layers in the background,
warms each one, then starts the batcher; /ready turns 200 only after that."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import torch
from fastapi import FastAPI, Request, Response

from service import __version__, logs
from service.batcher import BatchPolicy, DynamicBatcher
from service.deps import Runtime
from service.engine import Engine, LayerSource
from service.ep import EPEngine
from service.errors import error_response, install_handlers
from service.metrics import Metrics
from service.routes import forward, health, introspect, kserve, metrics
from service.settings import Settings

log = logging.getLogger(__name__)

# A loader turns settings into layers whose weights are on `device`.
LayerLoader = Callable[[Settings, torch.device], Sequence[LayerSource]]

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's id is echoed and logged

# Probes and scrapes answer without the bearer token: orchestrators and Prometheus hold none.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready"})


def layer_paths(settings: Settings) -> list[Path]:
    """The layers named by --weights, or the demo layers (generated into the cache once)."""
    from weights.demo import ensure_demo_layers

    return list(settings.weights) or ensure_demo_layers(settings.cache_dir)


def load_from_disk(settings: Settings, device: torch.device) -> list[LayerSource]:
    from weights.load import load_layer

    return [load_layer(path, device) for path in layer_paths(settings)]


def _build_engine(settings: Settings, loader: LayerLoader, metrics: Metrics) -> Engine:
    device = settings.torch_device()
    if settings.ep > 1:  # this process is rank 0; each rank loads only its experts from disk
        engine = EPEngine(settings, layer_paths(settings))
        sources = engine.load()
    else:
        engine = Engine(device, settings.backend)
        sources = loader(settings, device)
    for source in sources:
        served = engine.add(source)
        metrics.add_layer(served.name, served.config.num_experts)
    if not engine.layers:
        raise ValueError("no layers to serve")
    engine.warm_up(sorted({1, settings.max_batch_tokens}))
    return engine


async def _start(runtime: Runtime, loader: LayerLoader) -> None:
    settings = runtime.settings
    try:
        engine = await asyncio.to_thread(_build_engine, settings, loader, runtime.metrics)
    except Exception as err:
        log.exception("loading the layers failed")
        runtime.not_ready = f"loading the layers failed: {err}"
        return
    policy = BatchPolicy(
        settings.max_batch_tokens, settings.max_batch_delay_ms / 1000, settings.max_queue
    )
    if isinstance(engine, EPEngine):  # a lost rank turns /ready and every request into 503
        engine.on_failure = partial(setattr, runtime, "not_ready")
    runtime.batcher = DynamicBatcher(engine, policy, runtime.metrics)
    runtime.batcher.start()
    runtime.engine = engine
    runtime.not_ready = None
    log.info("ready: %s on %s", ", ".join(engine.layers), engine.device)


def _authorized(request: Request, token: bytes) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token)


def _observe(runtime: Runtime) -> Callable[[Request, Callable], Awaitable[Response]]:
    """Middleware: request id, bearer auth, one log line and the request metrics."""
    secret = runtime.settings.api_token
    token = secret.get_secret_value().encode() if secret is not None else None
    m = runtime.metrics

    async def observe(request: Request, call_next: Callable) -> Response:
        given = request.headers.get("x-request-id", "")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex  # no log injection
        reset = logs.request_id.set(rid)
        started = time.perf_counter()
        try:
            if (
                token is not None
                and request.url.path not in OPEN_PATHS
                and not _authorized(request, token)
            ):
                response = error_response(
                    401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
                )
            else:
                response = await call_next(request)
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            response = error_response(500, f"internal error; request id {rid}")
        seconds = time.perf_counter() - started
        route = request.scope.get("route")
        label = getattr(route, "path", "unmatched")
        m.requests.labels(label, str(response.status_code)).inc()
        m.request_seconds.labels(label).observe(seconds)
        response.headers["X-Request-ID"] = rid
        log.info(
            "%s %s -> %d in %.1f ms",
            request.method,
            request.url.path,
            response.status_code,
            seconds * 1e3,
        )
        logs.request_id.reset(reset)
        return response

    return observe


def create_app(settings: Settings, loader: LayerLoader = load_from_disk) -> FastAPI:
    runtime = Runtime(settings, Metrics())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.create_task(_start(runtime, loader))
        yield
        runtime.not_ready = "shutting down"
        await starting  # a load in progress finishes before the process exits
        if runtime.batcher is not None:
            await runtime.batcher.close()
        if isinstance(runtime.engine, EPEngine):
            await asyncio.to_thread(runtime.engine.close)

    app = FastAPI(
        title="moe-serve",
        version=__version__,
        summary="Mixture-of-Experts layers over HTTP: JSON, safetensors and KServe v2",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    install_handlers(app)
    app.middleware("http")(_observe(runtime))
    for module in (health, metrics, introspect, forward, kserve):
        app.include_router(module.router)
    return app
