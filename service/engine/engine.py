"""Engine: layer name -> MoE layer built on its device; `start` runs one batch of one layer.

Each layer sits whole on one of the engine's devices (`--devices`: service/engine/devices.py
places them). The batcher's launcher thread calls `start` for every batch, so the layers of one
device can share its Workspace (their forwards never overlap: the device's one compute stream
runs them in order). On a GPU, `start` stages the batch and enqueues it on the device pipeline
of the layer's GPU (service/engine/pipeline.py) and returns at once; elsewhere it runs the
forward before returning. Layers whose backend allows it run from whole-layer CUDA graphs,
captured at warm-up (kernels/layer_graphs.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from ...kernels.calibrate import NOT_CALIBRATED, Calibration, calibrated_rules
from ...kernels.input_checks import all_finite, all_finite_on_device
from ...kernels.layer import LayerOutput, MoELayer, build_layer, expert_tokens
from ...kernels.layer_graphs import LayerGraphs, can_capture
from ...kernels.modular import DEFAULT_CHUNK_TOKENS
from ...kernels.placement import Placement
from ...kernels.selection import RuleTable, Selection
from ...kernels.tensors import ForwardInputs, Routing
from ...kernels.workspace import Workspace
from ..errors import Conflict, NotReady, no_layer
from .interface import (
    BatchResult,
    LayerSource,
    NonFiniteRows,
    Pending,
    ServedLayer,
    ServingEngine,
    StageTimes,
)
from .pipeline import DEPTH, DevicePipeline, Finished, split_rows

log = logging.getLogger(__name__)

_NO_PLACEMENTS = "placements exist only with expert parallelism (--ep N, N > 1)"


def on_device(device: torch.device) -> AbstractContextManager:
    """`device` current within: Triton launches its kernels on the current GPU, whichever
    GPU their tensors are on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class Engine(ServingEngine):
    """One process's engine: every layer whole on one of `devices` (all GPUs, or the CPU)."""

    def __init__(
        self,
        devices: Sequence[torch.device],
        backend: str = "auto",
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        cuda_graphs: bool = True,
        batch_invariant: bool = False,
        calibration: Calibration = NOT_CALIBRATED,
    ) -> None:
        self.devices = tuple(devices)
        self.backend = backend
        self.chunk_tokens = chunk_tokens  # the largest batch (--max-batch-tokens): never split
        self.cuda_graphs = cuda_graphs  # False: never capture (--no-cuda-graphs)
        self.batch_invariant = batch_invariant  # --batch-invariant
        self.calibration = calibration  # --calibrate: auto's rules measured here
        # shared by the layers of each device
        self.workspaces = {device: Workspace(device) for device in self.devices}
        self.layers: dict[str, ServedLayer] = {}
        self.failure: str | None = None  # why this engine can serve no more; None while it can
        self.on_failure: Callable[[str], None] = lambda _reason: None  # the app turns unready
        self.on_degraded: Callable[[str], None] = lambda _reason: None  # expert parallelism's
        # what a layer being built is waiting for (a calibration's progress): the app's /ready
        self.on_status: Callable[[str], None] = lambda _status: None
        self.pipelines = {
            device: DevicePipeline(device, chunk_tokens)
            for device in self.devices
            if device.type == "cuda"
        }

    @property
    def enqueues(self) -> bool:
        """True: `start` only stages and enqueues device work, returning before it is done."""
        return bool(self.pipelines)

    @property
    def captures(self) -> bool:
        """Whether layers run from CUDA graphs where their backend allows."""
        return self.enqueues and self.cuda_graphs

    @property
    def max_in_flight(self) -> int:
        """Batches `start` may have running at once on one device."""
        return DEPTH if self.enqueues else 1

    @property
    def start_may_wait(self) -> bool:
        """Whether `start` may wait for something other than its own copies (expert
        parallelism: a regroup or a capture in progress); the batcher then never calls it on
        the event loop."""
        return False

    def add(self, source: LayerSource) -> ServedLayer:
        """Build `source`'s modular kernel on its device (backend chosen per layer)."""
        if source.name in self.layers:
            raise ValueError(f"two layers are named {source.name!r}; layer names must be unique")
        device = source.device
        if device not in self.workspaces:
            served_on = ", ".join(map(str, self.devices))
            raise ValueError(f"layer {source.name!r} is on {device}, not on one of {served_on}")
        with on_device(device):
            layer, selection = self.build(source)
            graphs = self.layer_graphs(source.name, layer, device) if self.captures else None
        served = ServedLayer(
            source.name, source.config, layer, selection, source.weights.nbytes(), device, graphs
        )
        self.layers[source.name] = served
        log.info(
            "layer %s on %s: %s + %s (%s)",
            source.name,
            device,
            selection.prepare_finalize.name,
            selection.experts.name,
            selection.reason,
        )
        return served

    def layer_graphs(self, name: str, layer: MoELayer, device: torch.device) -> LayerGraphs | None:
        """Uncaptured graphs for `layer` (captured at warm-up), or None where its backend
        cannot be captured. A backend that syncs above some size (the batched formats) is
        captured up to it and runs eagerly above."""
        limit = layer.kernel.prepare_finalize.max_capture_tokens or self.chunk_tokens
        graph_tokens = min(self.chunk_tokens, limit)
        support = can_capture(layer, device, graph_tokens)
        if not support:
            log.info("layer %s runs without CUDA graphs: %s", name, support.reason)
            return None
        # routed layers take no client logits in graphs; one copy per batch in flight (each
        # pipeline slot replays its own)
        with_logits = layer.router.weight is None
        return LayerGraphs(
            layer, device, graph_tokens, with_logits, self.max_in_flight, self.chunk_tokens
        )

    def load(self, source: LayerSource, token_counts: Sequence[int]) -> ServedLayer:
        """Add layer `source`, or replace the one of its name, warmed up at `token_counts`.
        Atomic: if building or warming fails, the layers are as they were (the old one serves).
        Call it where forwards run (the batcher's worker), so that none runs meanwhile."""
        old = self.layers.pop(source.name, None)
        try:
            served = self.add(source)
            self.warm_up(token_counts, [source.name])
        except BaseException:
            self.layers.pop(source.name, None)
            if old is not None:
                self.layers[source.name] = old
            raise
        return served

    def remove(self, name: str) -> ServedLayer:
        """Stop serving layer `name` (its device memory goes with the last reference)."""
        served = self.get(name)
        del self.layers[name]
        log.info("layer %s removed", name)
        return served

    def build(self, source: LayerSource) -> tuple[MoELayer, Selection]:
        """`source`'s layer on its device (expert parallelism composes its own); under auto,
        by the rule calibrated for it where --calibrate measures or caches one."""
        return build_layer(
            source.config,
            source.weights,
            source.device,
            self.backend,
            self.workspaces[source.device],
            self.chunk_tokens,
            batch_invariant=self.batch_invariant,
            rules=self.calibrated(source),
        )

    def calibrated(self, source: LayerSource) -> RuleTable | None:
        """The rules calibrated for `source` (kernels/calibrate.py), or None: not auto, batch
        invariance (one backend at every size), or nothing calibrated."""
        if self.backend != "auto" or self.batch_invariant:
            return None

        measured = []

        def progress(done: int, total: int) -> None:
            measured.append(done)
            self.on_status(f"calibrating layer {source.name}: {done}/{total}")

        rules = calibrated_rules(
            source.name,
            source.config,
            source.weights,
            source.device,
            self.calibration,
            self.chunk_tokens,
            self.captures,
            progress,
        )
        if measured:
            self.on_status(f"loading layers (layer {source.name} calibrated)")
        return rules

    def get(self, name: str) -> ServedLayer:
        try:
            return self.layers[name]
        except KeyError:
            raise no_layer(name, self.layers) from None

    def forward(self, name: str, inputs: ForwardInputs) -> LayerOutput:
        """One batch [M, H] of layer `name` (CPU tensors) -> output [M, H] and routing, on CPU.

        The one path from a batch to the device and back: expert parallelism replaces this.
        """
        if self.failure is not None:
            raise NotReady(self.failure)
        served = self.get(name)
        logits = inputs.router_logits
        device = served.device
        there = ForwardInputs(
            inputs.hidden_states.to(device), None if logits is None else logits.to(device)
        )
        try:
            with torch.inference_mode(), on_device(device):
                result = served.layer.forward(there)
                # one reduction on the device, read once the output has come back below
                finite = all_finite_on_device(result.output)
        except torch.AcceleratorError as err:
            raise self._device_failed(err) from err
        routing = result.routing
        output = LayerOutput(
            result.output.cpu(), Routing(routing.topk_ids.cpu(), routing.topk_weights.cpu())
        )
        if not finite.item():
            raise NonFiniteRows(name, output)
        return output

    def placement(self, name: str) -> dict:  # noqa: ARG002 (ServingEngine's signature)
        raise Conflict(_NO_PLACEMENTS)

    def rebalance(
        self,
        name: str,  # noqa: ARG002 (ServingEngine's signature)
        ranks: Sequence[Sequence[int]] | None,  # noqa: ARG002
        redundant: int | None = None,  # noqa: ARG002
    ) -> Placement:
        raise Conflict(_NO_PLACEMENTS)

    def close(self) -> None:
        """Nothing to stop: the layers' device memory goes with the engine."""

    def _device_failed(self, err: torch.AcceleratorError) -> NotReady:
        # A device fault (illegal address, ECC) leaves the CUDA context unusable: every later
        # forward would fail too, so stop serving and let the orchestrator replace us.
        self.failure = f"the device failed: {err}"
        self.on_failure(self.failure)
        return NotReady(self.failure)

    def start(
        self,
        name: str,
        parts: Sequence[ForwardInputs],
        into: Sequence[torch.Tensor | None] | None = None,
    ) -> Pending:
        """Begin one batch of layer `name`: `parts` [t_i, H] on the CPU or a GPU (views of a
        client's CUDA shared memory), in any wire dtype (cast once, to the layer's), all with
        router logits or none. Its result holds one output per part, in the layer's dtype. On a
        GPU this returns once the batch is enqueued, and a part's output is copied straight into
        its `into` tensor ([t_i, H]: pinned host memory or GPU memory, cast there to its dtype
        on the device) where one is given; elsewhere `into` is ignored (the batcher copies)."""
        if self.failure is not None:
            raise NotReady(self.failure)
        served = self.get(name)
        if not self.enqueues:
            return self._run_now(served, parts)
        try:
            with torch.inference_mode():
                pending = self.pipelines[served.device].launch(served, parts, into)
                return _Guarded(self, pending)
        except torch.AcceleratorError as err:
            raise self._device_failed(err) from err

    def _run_now(self, served: ServedLayer, parts: Sequence[ForwardInputs]) -> Finished:
        cfg = served.config
        logits = [p.router_logits for p in parts]
        inputs = ForwardInputs(  # parts on a GPU (CUDA shared memory) come to the host here
            torch.cat([p.hidden_states.cpu() for p in parts]).to(cfg.dtype),
            None if logits[0] is None else torch.cat([t.cpu() for t in logits]).float(),
        )
        started = time.perf_counter()
        tensors = (inputs.hidden_states, inputs.router_logits)
        inputs_finite = all(all_finite(t) for t in tensors if t is not None)
        try:
            whole, finite = self.forward(served.name, inputs), True
        except NonFiniteRows as err:
            whole, finite = err.result, False
        seconds = time.perf_counter() - started
        counts = expert_tokens(whole.routing.topk_ids, cfg.num_experts)
        sizes = [p.hidden_states.shape[0] for p in parts]
        outputs = split_rows(whole, sizes)
        times = StageTimes(seconds)
        return Finished(BatchResult(outputs, counts, times, finite, inputs_finite))

    def warm_up(self, token_counts: Sequence[int], names: Sequence[str] | None = None) -> None:
        """Capture every layer's (or those named) CUDA graphs, then run each at every one of
        `token_counts` through `start`, so no request pays for a kernel's first compile, a
        capture or a workspace allocation (a JIT compile mid-load stalls its batch for seconds)."""
        names = list(self.layers) if names is None else list(names)
        for name in names:
            served = self.layers[name]
            if served.graphs is None:
                continue
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    served.graphs.capture()
            except Exception:  # a backend that claims it captures but does not: run it eagerly
                log.exception("layer %s: CUDA graph capture failed; it runs uncaptured", name)
                self.layers[name] = dataclasses.replace(served, graphs=None)
                continue
            log.info(
                "layer %s: %d CUDA graphs captured (buckets %s) in %.1f s",
                name,
                len(served.graphs.captured_buckets()) * served.graphs.copies,
                ",".join(map(str, served.graphs.buckets)),
                time.perf_counter() - started,
            )
        generator = torch.Generator().manual_seed(0)
        for name in names:
            served = self.layers[name]
            cfg = served.config
            for tokens in token_counts:
                hidden = torch.randn(tokens, cfg.hidden_size, generator=generator)
                logits = None if served.has_router else torch.zeros(tokens, cfg.num_experts)
                if not self.start(name, [ForwardInputs(hidden, logits)]).result().finite:
                    raise RuntimeError(f"warm-up forward of layer {name!r} produced NaN or Inf")


@dataclass(frozen=True)
class _Guarded:
    """A pipelined batch whose device fault, surfacing when it is waited for, stops the engine."""

    engine: Engine
    pending: Pending

    def done(self) -> bool:
        return self.pending.done()  # a device fault raises: `result` then stops the engine

    def result(self) -> BatchResult:
        try:
            return self.pending.result()
        except torch.AcceleratorError as err:
            raise self.engine._device_failed(err) from err
