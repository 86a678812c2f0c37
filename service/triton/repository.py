"""The model repository (--model-repository DIR): each subdirectory is a layer directory, served
as the model of the subdirectory's name. Triton's repository extension loads and unloads them
at run time, over HTTP (service/http/routes/repository.py) and gRPC.

A load reads the directory onto a device off the event loop (of several, the one with the most
memory free that holds it: service/engine/devices.py), then builds and warms the layer on the
device worker between forwards and only then serves it (ServingEngine.load): a failed load
leaves the running version serving. An unload first lets the layer's admitted requests finish.
One load or unload runs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ...weights.load import LoadedLayer, load_layer, read_manifest, weight_bytes
from ..engine.batcher import DynamicBatcher
from ..engine.devices import place_directories
from ..engine.interface import ServingEngine
from ..errors import BadInput, UnknownLayer
from ..metrics import Metrics
from .statistics import VERSION

log = logging.getLogger(__name__)

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"


@dataclass(frozen=True)
class ModelIndex:
    """One entry of Triton's repository index."""

    name: str
    state: str
    reason: str = ""
    version: str = ""

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v}


class Serving(Protocol):
    """What the repository loads models into (service.core.runtime.Runtime): a load or unload
    needs the engine and the batcher, which a server that is not ready yet lacks."""

    engine: ServingEngine | None
    batcher: DynamicBatcher | None
    metrics: Metrics
    warm_up_tokens: list[int]


def check_load_parameters(parameters: dict[str, Any]) -> None:
    """Triton can load a model from a config or files sent with the request; we load only the
    repository's directories."""
    overrides = sorted(k for k in parameters if k == "config" or k.startswith("file:"))
    if overrides:
        raise BadInput(f"load parameters {overrides} are not supported: models load from disk")


class Repository:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.busy: dict[str, str] = {}  # model -> LOADING or UNLOADING, while it runs
        self.reasons: dict[str, str] = {}  # model -> why it is not serving (failed load, unload)
        self._lock = asyncio.Lock()

    def names(self) -> list[str]:
        """The repository's models: its subdirectories."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.name[0] != ".")

    def path(self, name: str) -> Path:
        """The directory of model `name`; 404 for a name that is not one of them."""
        if name not in self.names():  # never a path built from the name alone
            raise UnknownLayer(f"the model repository has no model named {name!r}")
        return self.root / name

    def index(self, serving: Serving, ready_only: bool = False) -> list[ModelIndex]:
        served = serving.engine.layers if serving.engine is not None else {}
        entries = []
        for name in self.names():
            if name in self.busy:
                entry = ModelIndex(name, self.busy[name])
            elif name in served:
                entry = ModelIndex(name, READY, version=VERSION)
            else:
                entry = ModelIndex(name, UNAVAILABLE, self.reasons.get(name, "not loaded"))
            if entry.state == READY or not ready_only:
                entries.append(entry)
        return entries

    async def load_all(self, serving: Serving) -> None:
        """At start: every model of the repository; one that fails is logged and left out.
        Over several devices the largest go first, each where the most memory is free then."""
        names = self.names()
        if len(serving.engine.devices) > 1:
            names.sort(key=lambda name: -self._weight_bytes(name))
        for name in names:
            with contextlib.suppress(BadInput):  # logged, and its reason is in the index
                await self.load(serving, name)

    def _weight_bytes(self, name: str) -> int:
        """Model `name`'s weights in bytes; 0 where its manifest is unreadable (its load fails
        and says why)."""
        try:
            return weight_bytes(read_manifest(self.root / name))
        except ValueError:
            return 0

    async def load(self, serving: Serving, name: str) -> None:
        """Serve model `name` from its directory, replacing the running version if any."""
        path = self.path(name)
        async with self._lock:
            self.busy[name] = LOADING
            try:
                loaded = await asyncio.to_thread(_load_placed, path, serving.engine.devices)
                source = dataclasses.replace(loaded, name=name)  # the directory names the model
                tokens = serving.warm_up_tokens
                served = await serving.batcher.on_worker(serving.engine.load, source, tokens)
            except Exception as err:
                kept = name in serving.engine.layers
                keeps = " (the running version keeps serving)" if kept else ""
                why = str(err) or type(err).__name__  # MemoryError() says nothing itself
                self.reasons[name] = f"load failed: {why}"
                log.warning("loading model %s failed%s: %s", name, keeps, why)
                raise BadInput(f"failed to load model {name!r}{keeps}: {why}") from None
            finally:
                del self.busy[name]
            serving.metrics.add_layer(name, served.config.num_experts)
            serving.batcher.add_layer(name)
            self.reasons.pop(name, None)
        log.info("model %s loaded from %s (%s)", name, path, served.backend)

    async def unload(self, serving: Serving, name: str) -> None:
        """Stop serving model `name` once its admitted requests are answered."""
        async with self._lock:
            serving.engine.get(name)  # 404 for a model not being served
            self.busy[name] = UNLOADING
            try:
                await serving.batcher.remove_layer(name)
                await serving.batcher.on_worker(serving.engine.remove, name)
            finally:
                del self.busy[name]
            serving.metrics.statistics.remove_model(name)
            self.reasons[name] = "unloaded"
        log.info("model %s unloaded", name)


def _load_placed(path: Path, devices: tuple[torch.device, ...]) -> LoadedLayer:
    """Layer directory `path` loaded onto its device of `devices`."""
    (device,) = place_directories([path], devices)
    return load_layer(path, device)
