"""The running service's parts, whatever the transport: the settings, the metrics, and once the
layers are loaded and warm the engine and its batcher; how they start (`start_up`: load, warm up,
then serve) and stop and the check every request makes first (`ready`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from ...kernels.calibrate import Calibration
from ..codecs import json_device
from ..engine.batcher import BatchPolicy, DynamicBatcher
from ..engine.devices import place_directories
from ..engine.engine import Engine
from ..engine.interface import LayerSource, ServingEngine
from ..ep.engine import EPEngine
from ..errors import BadInput
from ..metrics import Metrics
from ..settings import Settings
from ..triton.repository import Repository
from ..triton.shared_memory import SharedMemory
from .probes import ProbeState, not_ready_error

log = logging.getLogger(__name__)

# A loader turns settings into layers, each with its weights on one of the devices.
LayerLoader = Callable[[Settings, Sequence[torch.device]], Sequence[LayerSource]]


@dataclass
class Runtime:
    """The app's moving parts; engine and batcher appear once the layers are loaded and warm."""

    settings: Settings
    metrics: Metrics
    engine: ServingEngine | None = None
    batcher: DynamicBatcher | None = None
    not_ready: str | None = "loading layers"  # None once ready
    degraded: str | None = None  # ready, but on fewer expert-parallel ranks (why)
    start_failed: bool = False  # loading or warming up the layers raised
    # What a failed start does besides answering 503: `moe-serve serve` stops the server.
    on_start_failure: Callable[[], None] = lambda: None
    shared_memory: SharedMemory = field(default_factory=lambda: SharedMemory(allowed=False))
    repository: Repository | None = None  # --model-repository
    warm_up_tokens: list[int] = field(default_factory=list)  # token counts a new layer runs
    # Set on SIGTERM (drain): the time.monotonic() by which in-flight requests must be done.
    drain_deadline: float | None = None
    # Called (on any thread) when what the probes answer changes: --http-workers publishes the
    # probe state to the front ends (service/frontends/engine_state.py)
    on_change: Callable[[], None] = lambda: None

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name in _PROBED and "on_change" in self.__dict__:
            self.on_change()

    def probe_state(self) -> ProbeState:
        """What the probes answer now."""
        return ProbeState(
            not_ready=self.not_ready,
            degraded=self.degraded,
            draining=self.drain_deadline is not None,
            models=() if self.engine is None else tuple(self.engine.layers),
        )

    def drain(self) -> None:
        """SIGTERM came: in-flight requests have drain_timeout_s to finish. From now on gRPC
        answers not ready and refuses new calls (uvicorn closes HTTP's listener). Idempotent."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.settings.drain_timeout_s


# The fields the probes answer from, besides the engine's layers (published on each beat)
_PROBED = frozenset({"not_ready", "degraded", "drain_deadline", "engine"})


def ready(runtime: Runtime) -> Runtime:
    """`runtime` once it can serve (engine and batcher set); NotReady (503) before."""
    if runtime.not_ready is not None:
        raise not_ready_error(runtime.not_ready)
    return runtime


def repository_of(runtime: Runtime) -> Repository:
    """The model repository (--model-repository); 400 for a server started without one."""
    if runtime.repository is None:
        raise BadInput("this server has no model repository: start it with --model-repository")
    return runtime.repository


def layer_paths(settings: Settings) -> list[Path]:
    """The layers named by --weights, or the demo layers (generated into the cache once)."""
    from ...weights.demo import ensure_demo_layers

    if settings.weights or settings.model_repository is not None:
        return list(settings.weights)
    return ensure_demo_layers(settings.cache_dir)


def load_from_disk(settings: Settings, devices: Sequence[torch.device]) -> list[LayerSource]:
    """The layers of `layer_paths`, each loaded onto its device of `devices` (placed by
    memory where there are several)."""
    from ...weights.load import load_layer

    paths = layer_paths(settings)
    return [load_layer(p, d) for p, d in zip(paths, place_directories(paths, devices), strict=True)]


def warm_up_tokens(max_batch_tokens: int, device: torch.device) -> list[int]:
    """On a GPU 1, 2, 4, ... up to and with max_batch_tokens: a batch of any size then finds its
    kernels' tile bucket compiled (and small batches their CUDA graphs captured). On the CPU
    nothing compiles: one token checks that each layer runs."""
    if device.type != "cuda":
        return [1]
    powers = [1 << i for i in range(max_batch_tokens.bit_length()) if 1 << i < max_batch_tokens]
    return [*powers, max_batch_tokens]


def _build_engine(
    settings: Settings, loader: LayerLoader, metrics: Metrics, status: Callable[[str], None]
) -> ServingEngine:
    """The engine with its layers loaded and warm; `status` hears what a layer waits for
    (its calibration's progress)."""
    engine: ServingEngine
    if settings.ep > 1:  # this process is rank 0; each rank loads only its experts from disk
        engine = EPEngine(settings, layer_paths(settings), metrics)
        sources = engine.load()
    else:
        devices = settings.layer_devices()
        engine = Engine(
            devices,
            settings.backend,
            settings.max_batch_tokens,
            cuda_graphs=settings.cuda_graphs,
            batch_invariant=settings.batch_invariant,
            calibration=Calibration(
                settings.calibrate, settings.calibrate_budget_s, settings.cache_dir
            ),
        )
        engine.on_status = status
        sources = loader(settings, devices)
    try:
        for source in sources:
            served = engine.add(source)
            metrics.add_layer(served.name, served.config.num_experts)
        if not engine.layers and settings.model_repository is None:
            raise ValueError("no layers to serve")
        engine.warm_up(warm_up_tokens(settings.max_batch_tokens, engine.devices[0]))
        dtypes = {s.config.dtype for s in engine.layers.values()}
        for device in engine.devices:  # where large JSON bodies are read and printed
            if device.type == "cuda":
                json_device.warm_up(device, dtypes)
    except BaseException:
        engine.close()  # expert parallelism's ranks are up: stop them, or nothing will
        raise
    return engine


async def start_up(runtime: Runtime, loader: LayerLoader) -> None:
    """Load and warm the layers off the event loop, start the batcher, load the model
    repository's models; then the runtime is ready. A failure leaves it not ready, saying why."""
    settings = runtime.settings
    try:
        status = partial(setattr, runtime, "not_ready")
        engine = await asyncio.to_thread(_build_engine, settings, loader, runtime.metrics, status)
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
    # a lost expert-parallel rank whose experts have copies: serve on, degraded
    engine.on_degraded = partial(setattr, runtime, "degraded")
    runtime.batcher = DynamicBatcher(engine, policy, runtime.metrics)
    runtime.batcher.start()
    runtime.engine = engine
    runtime.warm_up_tokens = warm_up_tokens(settings.max_batch_tokens, engine.devices[0])
    if runtime.repository is not None:
        await runtime.repository.load_all(runtime)
    engine.on_status = lambda _status: None  # a layer loaded from now on leaves /ready as it is
    runtime.not_ready = None
    log.info("ready: %s", ", ".join(f"{s.name} on {s.device}" for s in engine.layers.values()))


async def shut_down(runtime: Runtime) -> None:
    """After the transports have drained: the batcher answers what it holds, then the shared
    memory regions and the engine close."""
    if runtime.batcher is not None:
        await runtime.batcher.close()
    runtime.shared_memory.close()
    if runtime.engine is not None:
        await asyncio.to_thread(runtime.engine.close)
