"""The device side of a batch: staged on the host, copied in, run, copied out, with two batches
in flight so that the next one is copied in while the current one computes.

    launcher thread:  parts -> the slot's pinned buffer (cast to the layer's dtype, the one host
                      copy) -> copy-in stream: H2D (parts already on a GPU: D2D) -> compute
                      stream: forward (graph replay where the layer has graphs) -> copy-out
                      stream: D2H of the output, the routing and the expert counts (and D2D of
                      the output rows a part sends into a GPU buffer) -> returns at once
    completer thread: waits for the batch's last event -> per-part results -> frees the slot

Each layer owns two slots (pinned host and device buffers, reused batch after batch). The only
host sync of a batch is the completer's wait on its last event; every stage's device time comes
from CUDA events around it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kernels.layer import LayerOutput, expert_tokens
from kernels.tensors import ForwardInputs, Routing
from service.device_io import (
    copy_device_rows,
    copy_outputs,
    device_parts,
    output_sinks,
    stage_host_rows,
)

if TYPE_CHECKING:
    from service.engine import ServedLayer

DEPTH = 2  # batches in flight: one computing while the next is copied in


@dataclass(frozen=True)
class StageTimes:
    """Where one batch's time went."""

    forward_s: float  # device time from CUDA events on a GPU; host time elsewhere
    stage_s: float = 0.0  # host: copying the parts into the pinned staging buffer
    h2d_s: float | None = None  # device: host-to-device copy (None off the GPU)
    d2h_s: float | None = None  # device: device-to-host copy (None off the GPU)


@dataclass(frozen=True)
class BatchResult:
    outputs: list[LayerOutput]  # one per part, on the CPU, output in the layer's dtype
    expert_tokens: torch.Tensor  # [E] int64 pairs per expert over the batch, on the CPU
    times: StageTimes
    # every output value is finite: one reduction where the forward ran, copied out with the
    # output; only when False are the parts' rows looked at (service.batcher)
    finite: bool


class Pending(Protocol):
    def result(self) -> BatchResult:
        """Block until the batch is done; raises what its forward raised."""


@dataclass(frozen=True)
class Finished:
    """A batch that ran synchronously (CPU, expert parallelism)."""

    value: BatchResult

    def result(self) -> BatchResult:
        return self.value


def split_rows(whole: LayerOutput, sizes: Sequence[int]) -> list[LayerOutput]:
    """A batch's output [M, ...] -> one LayerOutput per part of `sizes` rows (views)."""
    parts, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        routing = Routing(whole.routing.topk_ids[rows], whole.routing.topk_weights[rows])
        parts.append(LayerOutput(whole.output[rows], routing))
        start += size
    return parts


def _gather(rows: Sequence[torch.Tensor], into: torch.Tensor) -> None:
    """Concatenate `rows` into `into` (the one host copy of a batch), casting to its dtype."""
    if all(r.dtype == into.dtype for r in rows):
        torch.cat(rows, out=into)
        return
    start = 0
    for r in rows:
        into[start : start + r.shape[0]].copy_(r)
        start += r.shape[0]


_EVENTS = ("h2d_start", "h2d_end", "forward_start", "forward_end", "d2h_start", "d2h_end")


class _Slot:
    """Pinned host and device buffers for one batch of up to `capacity` tokens of one layer."""

    def __init__(self, served: ServedLayer, device: torch.device, capacity: int) -> None:
        cfg = served.config
        self.capacity = capacity
        h, e, k = cfg.hidden_size, cfg.num_experts, cfg.top_k

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.empty(shape, dtype=dtype, pin_memory=True)
            return host, torch.empty(shape, dtype=dtype, device=device)

        self.hidden = pair((capacity, h), cfg.dtype)
        self.logits = pair((capacity, e), torch.float32)
        self.output = pair((capacity, h), cfg.dtype)
        self.topk_ids = pair((capacity, k), torch.int32)
        self.topk_weights = pair((capacity, k), torch.float32)
        self.expert_tokens = pair((e,), torch.int64)
        self.finite = pair((), torch.bool)
        self.events = {name: torch.cuda.Event(enable_timing=True) for name in _EVENTS}

    def results(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(host, device) buffers of what a forward returns per row."""
        return self.output, self.topk_ids, self.topk_weights

    def seconds(self, start: str, end: str) -> float:
        return self.events[start].elapsed_time(self.events[end]) / 1e3


class DevicePipeline:
    """Three CUDA streams (copy-in, compute, copy-out) shared by every layer of one device."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity  # tokens per batch (--max-batch-tokens)
        self.copy_in = torch.cuda.Stream(device)
        self.compute = torch.cuda.Stream(device)
        self.copy_out = torch.cuda.Stream(device)
        self._free: dict[str, queue.SimpleQueue[_Slot]] = {}

    def _slot(self, served: ServedLayer, tokens: int) -> _Slot:
        free = self._free.get(served.name)
        if free is None:
            free = self._free[served.name] = queue.SimpleQueue()
            for _ in range(DEPTH):
                free.put(_Slot(served, self.device, self.capacity))
        slot = free.get()  # the batcher keeps at most DEPTH in flight: this never waits long
        if tokens > slot.capacity:  # only callers past --max-batch-tokens (tests)
            slot = _Slot(served, self.device, tokens)
        return slot

    def _release(self, name: str, slot: _Slot) -> None:
        self._free[name].put(slot)

    def launch(self, served: ServedLayer, parts: Sequence[ForwardInputs]) -> Pending:
        """Stage `parts` (rows of any wire dtype, on the CPU or a GPU: service/device_io.py;
        all with router logits or none) and enqueue the batch on the device; returns without
        waiting for it."""
        sizes = [p.hidden_states.shape[0] for p in parts]
        m = sum(sizes)
        with_logits = parts[0].router_logits is not None
        slot = self._slot(served, m)
        try:
            started = time.perf_counter()
            on_gpu = device_parts(parts)
            if on_gpu:
                stage_host_rows(parts, slot.hidden[0], slot.logits[0] if with_logits else None)
            else:
                _gather([p.hidden_states for p in parts], slot.hidden[0][:m])
                if with_logits:
                    _gather([p.router_logits for p in parts], slot.logits[0][:m])
            stage_s = time.perf_counter() - started
            self._enqueue(served, slot, m, with_logits, on_gpu, output_sinks(parts))
        except BaseException:
            self._release(served.name, slot)
            raise
        return _InFlight(self, served.name, slot, sizes, stage_s)

    def _enqueue(
        self,
        served: ServedLayer,
        slot: _Slot,
        m: int,
        with_logits: bool,
        on_gpu: list[tuple[slice, ForwardInputs]],
        sinks: list[tuple[slice, torch.Tensor]],
    ) -> None:
        ev = slot.events
        inputs = [slot.hidden] + ([slot.logits] if with_logits else [])
        with torch.cuda.stream(self.copy_in):
            ev["h2d_start"].record()
            if sum(rows.stop - rows.start for rows, _ in on_gpu) < m:  # some rows are staged
                for host, dev in inputs:
                    dev[:m].copy_(host[:m], non_blocking=True)
            copy_device_rows(on_gpu, slot.hidden[1], slot.logits[1] if with_logits else None)
            ev["h2d_end"].record()
        with torch.cuda.stream(self.compute):
            self.compute.wait_event(ev["h2d_end"])
            ev["forward_start"].record()
            logits = slot.logits[1][:m] if with_logits else None
            x = ForwardInputs(slot.hidden[1][:m], logits)
            graphs = served.graphs
            if graphs is not None and graphs.with_logits == with_logits and m <= graphs.max_tokens:
                replay = graphs.forward(x)
                out, counts = replay.output, replay.expert_tokens
            else:
                out = served.layer.forward(x)
                counts = expert_tokens(out.routing.topk_ids, served.config.num_experts)
            results = (out.output, out.routing.topk_ids, out.routing.topk_weights)
            for (_, dev), value in zip(slot.results(), results, strict=True):
                dev[:m].copy_(value)
            slot.expert_tokens[1].copy_(counts)
            torch.all(torch.isfinite(slot.output[1][:m]), out=slot.finite[1])
            ev["forward_end"].record()
        with torch.cuda.stream(self.copy_out):
            self.copy_out.wait_event(ev["forward_end"])
            ev["d2h_start"].record()
            for host, dev in slot.results():
                host[:m].copy_(dev[:m], non_blocking=True)
            slot.expert_tokens[0].copy_(slot.expert_tokens[1], non_blocking=True)
            slot.finite[0].copy_(slot.finite[1], non_blocking=True)
            copy_outputs(sinks, slot.output[1])  # done when d2h_end is: before any reply
            ev["d2h_end"].record()


class _InFlight:
    def __init__(
        self,
        pipeline: DevicePipeline,
        name: str,
        slot: _Slot,
        sizes: list[int],
        stage_s: float,
    ) -> None:
        self.pipeline = pipeline
        self.name = name
        self.slot = slot
        self.sizes = sizes
        self.stage_s = stage_s

    def result(self) -> BatchResult:
        slot = self.slot
        try:
            slot.events["d2h_end"].synchronize()  # the batch's one host sync
            m = sum(self.sizes)
            host = LayerOutput(
                slot.output[0][:m], Routing(slot.topk_ids[0][:m], slot.topk_weights[0][:m])
            )
            # copies: the pinned buffers serve the batch after next
            outputs = [
                LayerOutput(
                    part.output.clone(),
                    Routing(part.routing.topk_ids.clone(), part.routing.topk_weights.clone()),
                )
                for part in split_rows(host, self.sizes)
            ]
            times = StageTimes(
                forward_s=slot.seconds("forward_start", "forward_end"),
                stage_s=self.stage_s,
                h2d_s=slot.seconds("h2d_start", "h2d_end"),
                d2h_s=slot.seconds("d2h_start", "d2h_end"),
            )
            finite = bool(slot.finite[0])
            return BatchResult(outputs, slot.expert_tokens[0].clone(), times, finite)
        finally:
            self.pipeline._release(self.name, slot)
