"""The device side of a batch: staged on the host, copied in, run, copied out, with DEPTH (3)
batches in flight so that the next ones are copied in while the current one computes (with two,
the GPU idles between batches whenever the host is late by a few ms; `moe-serve bench service`
shows the GPU's busy time).

    launcher thread:  parts -> the slot's pinned buffer (cast to the layer's dtype, the one host
                      copy; a large part in pinned memory or on a GPU skips it and is cast on
                      the device) -> copy-in stream: H2D, straight into the slot's copy of the
                      layer's graph inputs (then, on expert parallelism's sender, the graph's
                      prologue) -> compute stream: one graph replay (padding, forward, expert
                      counts, finite checks of inputs and output; the eager forward where the
                      layer has no graphs) -> copy-out stream: (the sender's epilogue, then) D2H
                      of the output (into a part's own buffer where it gave one, cast there to
                      its dtype on the device), the routing and the counts -> returns at once
    completer thread: waits for the batch's last event -> per-part results -> frees the slot

The prologue and epilogue are the parts of an expert-parallel forward before its first
collective (router, routing, quantised rows packed for the broadcast) and after its last (the
reduced sums rounded, counts and finite checks; kernels/graph_capture.py). Neither needs
another rank, so they run on the copy streams beside the neighbouring batches' collectives and
experts instead of between them, where every other rank would wait.

Each layer owns DEPTH slots (pinned host and device buffers, reused batch after batch, each with
its own copy of the layer's graphs). The only host sync of a batch is the completer's wait on
its last event; every stage's device time comes from CUDA events around it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...kernels.input_checks import all_finite_on_device, finite_flag
from ...kernels.layer import LayerOutput, expert_tokens
from ...kernels.tensors import ForwardInputs, Routing
from .interface import BatchResult, Pending, ServedLayer, StageTimes

DEPTH = 3  # batches in flight: one computing, the next ones copied in and queued behind it


class BadRouting(RuntimeError):
    """A batch's results came back damaged: none of it is served (a 500 for its requests)."""


@dataclass(frozen=True)
class Finished:
    """A batch that ran synchronously (CPU, expert parallelism)."""

    value: BatchResult

    def done(self) -> bool:
        return True

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


@dataclass(frozen=True)
class _Run:
    """Rows [begin, end) of a batch: one part that is copied alone, or parts that go together."""

    begin: int
    end: int
    parts: list[int]  # indices of the parts
    alone: bool


# A part smaller than this is staged in the slot's pinned buffer even where it could be copied
# to the device in place: a host copy of it costs less than a copy of its own and than asking
# CUDA whether its memory is pinned (under many small requests those per-part calls would take
# much of the engine's event loop; `bench/request_path.py`, engine against engine-pinned).
DIRECT_BYTES = 256 << 10


def copied_in_place(part: ForwardInputs) -> bool:
    """Whether a part's rows go to the device from where they lie: on a GPU, or DIRECT_BYTES
    or more of pinned host memory (one DMA; rows in another dtype than the layer's are cast on
    the device, by the copy)."""
    hidden = part.hidden_states
    if hidden.device.type == "cuda":
        return True
    large = hidden.shape[0] * hidden.shape[1] * hidden.element_size() >= DIRECT_BYTES
    return large and hidden.is_pinned()


def _runs(sizes: Sequence[int], alone: Sequence[bool]) -> list[_Run]:
    """The batch's rows as one run per part whose `alone` is True and one per maximal stretch
    of the other parts."""
    runs: list[_Run] = []
    begin = 0
    for i, (size, own) in enumerate(zip(sizes, alone, strict=True)):
        if not own and runs and not runs[-1].alone:
            last = runs.pop()
            runs.append(_Run(last.begin, begin + size, [*last.parts, i], False))
        else:
            runs.append(_Run(begin, begin + size, [i], own))
        begin += size
    return runs


_EVENTS = (
    "h2d_start",
    "h2d_end",
    "inputs_ready",
    "forward_start",
    "forward_end",
    "d2h_start",
    "d2h_end",
)


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of `t`'s memory as integers of its element size (numpy has no bfloat16)."""
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _HostRows:
    """Copies of rows of a slot's pinned result buffers, as new tensors."""

    def __init__(
        self, output: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, stats: torch.Tensor
    ) -> None:
        self._dtype = output.dtype
        self._output, self._ids, self._weights = _bits(output), ids.numpy(), weights.numpy()
        self._stats = stats.numpy()

    def output(self, rows: slice) -> torch.Tensor:
        return torch.from_numpy(self._output[rows].copy()).view(self._dtype)

    def ids(self, rows: slice) -> torch.Tensor:
        return torch.from_numpy(self._ids[rows].copy())

    def weights(self, rows: slice) -> torch.Tensor:
        return torch.from_numpy(self._weights[rows].copy())

    def check_routing(self, rows: int, num_experts: int) -> None:
        """BadRouting unless every routing id of the first `rows` rows names an expert: the
        graph counted its tokens per expert from the same ids, so one that does not was
        overwritten on its way out (as a pool shared across graph copies did), and nothing of
        the batch is served."""
        ids = self._ids[:rows]
        if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
            bad = ids[(ids < 0) | (ids >= num_experts)]
            raise BadRouting(
                f"the forward brought back routing ids that name no expert of {num_experts} "
                f"({bad.size} of {ids.size}, e.g. {int(bad[0])}): its results were overwritten "
                "on the device"
            )

    def stats(self) -> tuple[torch.Tensor, bool, bool]:
        """Tokens per expert [E], whether every output and every input value was finite."""
        return (
            torch.from_numpy(self._stats[:-2].copy()),
            bool(self._stats[-2]),
            bool(self._stats[-1]),
        )


class _Slot:
    """Pinned host and device buffers for one batch of up to `capacity` tokens of one layer.

    With `copy`, the slot's device inputs are that copy of the layer's graph inputs
    (kernels/layer_graphs.py), so a batch is copied straight into them and replayed; the eager
    path (no graphs, or a batch they do not take) runs on the slot's own device buffers."""

    def __init__(
        self, served: ServedLayer, device: torch.device, capacity: int, copy: int | None
    ) -> None:
        cfg = served.config
        self.capacity = capacity
        self.copy = copy
        self.graphs = served.graphs if copy is not None else None
        h, e, k = cfg.hidden_size, cfg.num_experts, cfg.top_k

        def pair(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.empty(shape, dtype=dtype, pin_memory=True)
            return host, torch.empty(shape, dtype=dtype, device=device)

        self.hidden = pair((capacity, h), cfg.dtype)
        self.logits = pair((capacity, e), torch.float32)
        self.valid_rows = torch.empty((), dtype=torch.int64, pin_memory=True)
        if self.graphs is not None:  # rows go straight into the graphs' static inputs
            static = self.graphs.inputs[copy]
            self.hidden = (self.hidden[0], static.hidden)
            if static.logits is not None:
                self.logits = (self.logits[0], static.logits)
        self.output = pair((capacity, h), cfg.dtype)
        self.topk_ids = pair((capacity, k), torch.int32)
        self.topk_weights = pair((capacity, k), torch.float32)
        self.stats = pair((e + 2,), torch.int64)  # tokens per expert, output, inputs finite
        self.events = {name: torch.cuda.Event(enable_timing=True) for name in _EVENTS}
        self.host = _HostRows(self.output[0], self.topk_ids[0], self.topk_weights[0], self.stats[0])

    def results(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(host, device) buffers of what a forward returns per row."""
        return self.output, self.topk_ids, self.topk_weights

    def seconds(self, start: str, end: str) -> float:
        return self.events[start].elapsed_time(self.events[end]) / 1e3


@dataclass(frozen=True)
class _Slots:
    """A layer's free slots, made for one ServedLayer (a reloaded layer gets new ones)."""

    served: ServedLayer
    free: queue.SimpleQueue[_Slot]


class DevicePipeline:
    """Three CUDA streams (copy-in, compute, copy-out) shared by every layer of one device."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity  # tokens per batch (--max-batch-tokens)
        self.copy_in = torch.cuda.Stream(device)
        self.compute = torch.cuda.Stream(device)
        self.copy_out = torch.cuda.Stream(device)
        self.default = torch.cuda.default_stream(device)
        self._slots: dict[str, _Slots] = {}
        # Called as each batch's forward is enqueued, in order, with (layer, rows, the graph
        # bucket replayed or None for the eager forward, the slot's graph copy): expert
        # parallelism tells its other ranks to run the same forward (service/ep/engine.py)
        self.on_forward: Callable[[ServedLayer, int, int | None, int | None], None] | None = None

    def _slot(self, served: ServedLayer, tokens: int) -> _Slot:
        slots = self._slots.get(served.name)
        if slots is None or slots.served is not served:
            slots = self._slots[served.name] = _Slots(served, queue.SimpleQueue())
            for copy in range(DEPTH):
                graph_copy = copy if served.graphs is not None else None
                slots.free.put(_Slot(served, self.device, self.capacity, graph_copy))
        slot = slots.free.get()  # the batcher keeps at most DEPTH in flight: this never waits long
        if tokens > slot.capacity:  # only callers past --max-batch-tokens (tests)
            slots.free.put(slot)
            slot = _Slot(served, self.device, tokens, None)
        return slot

    def _release(self, served: ServedLayer, slot: _Slot) -> None:
        slots = self._slots.get(served.name)
        if slots is not None and slots.served is served and slot.capacity == self.capacity:
            slots.free.put(slot)

    def launch(
        self,
        served: ServedLayer,
        parts: Sequence[ForwardInputs],
        into: Sequence[torch.Tensor | None] | None = None,
    ) -> Pending:
        """Stage `parts` (rows of any wire dtype; all with router logits or none) and enqueue
        the batch on the device; returns without waiting for it. A part on a GPU (a client's
        CUDA shared memory) or a large one in pinned memory is copied to the device from where
        it lies, cast there to the layer's dtype; the others through the slot's pinned buffer.
        A part with an `into` tensor (pinned host memory or GPU memory, in any float dtype) gets
        its output rows copied straight there, cast on the device. Both must stay untouched
        until the result is in."""
        sizes = [p.hidden_states.shape[0] for p in parts]
        m = sum(sizes)
        with_logits = parts[0].router_logits is not None
        into = list(into) if into is not None else [None] * len(parts)
        slot = self._slot(served, m)
        try:
            started = time.perf_counter()
            direct = [copied_in_place(p) for p in parts]
            h2d = []  # (rows of the batch, their hidden states, their logits or None)
            for run in _runs(sizes, direct):
                rows = slice(run.begin, run.end)
                if run.alone:
                    part = parts[run.parts[0]]
                    h2d.append((rows, part.hidden_states, part.router_logits))
                    continue
                _gather([parts[i].hidden_states for i in run.parts], slot.hidden[0][rows])
                logits = None
                if with_logits:
                    logits = slot.logits[0][rows]
                    _gather([parts[i].router_logits for i in run.parts], logits)
                h2d.append((rows, slot.hidden[0][rows], logits))
            slot.valid_rows.fill_(m)
            stage_s = time.perf_counter() - started
            d2h = [  # (rows, their target: a part's own `into`, else the slot's buffer)
                (run, into[run.parts[0]] if run.alone else slot.output[0][run.begin : run.end])
                for run in _runs(sizes, [t is not None for t in into])
            ]
            self._enqueue(served, slot, m, with_logits, h2d, d2h)
        except BaseException:
            self._release(served, slot)
            raise
        return _InFlight(self, served, slot, sizes, stage_s, into)

    def _enqueue(
        self,
        served: ServedLayer,
        slot: _Slot,
        m: int,
        with_logits: bool,
        h2d: list[tuple[slice, torch.Tensor, torch.Tensor | None]],
        d2h: list[tuple[_Run, torch.Tensor]],
    ) -> None:
        # Streams are set directly, not through `torch.cuda.stream()`, whose enter and exit
        # cost more host time than the copies they order.
        ev = slot.events
        graphs = slot.graphs
        replays = (
            graphs is not None and graphs.with_logits == with_logits and m <= graphs.max_tokens
        )
        try:
            torch.cuda.set_stream(self.copy_in)
            ev["h2d_start"].record(self.copy_in)
            # host to device, or device to device; a non-blocking copy between dtypes casts on
            # the device (torch's copy makes the temporary there, on this stream)
            for rows, hidden, logits in h2d:
                slot.hidden[1][rows].copy_(hidden, non_blocking=True)
                if logits is not None:
                    slot.logits[1][rows].copy_(logits, non_blocking=True)
            if replays:
                graphs.inputs[slot.copy].valid_rows.copy_(slot.valid_rows, non_blocking=True)
            ev["h2d_end"].record(self.copy_in)
            if replays:  # expert parallelism's sender: the part before the first collective
                graphs.replay_prologue(m, slot.copy)  # beside the previous batch's forward
            ev["inputs_ready"].record(self.copy_in)

            if self.on_forward is not None:
                self.on_forward(served, m, graphs.bucket(m) if replays else None, slot.copy)
            torch.cuda.set_stream(self.compute)
            self.compute.wait_event(ev["inputs_ready"])
            ev["forward_start"].record(self.compute)
            if replays:  # one launch: padding, forward, counts and the finite checks
                replay = graphs.replay(m, slot.copy, ends=False)
                out, stats = replay.output, replay.stats
            else:
                out, stats = self._eager(served, slot, m, with_logits)
            ev["forward_end"].record(self.compute)

            torch.cuda.set_stream(self.copy_out)
            self.copy_out.wait_event(ev["forward_end"])
            if replays:  # expert parallelism's sender: all after the last collective
                graphs.replay_epilogue(m, slot.copy)  # beside the next batch's broadcast
            ev["d2h_start"].record(self.copy_out)
            for run, target in d2h:
                target.copy_(out.output[run.begin : run.end], non_blocking=True)
            slot.topk_ids[0][:m].copy_(out.routing.topk_ids, non_blocking=True)
            slot.topk_weights[0][:m].copy_(out.routing.topk_weights, non_blocking=True)
            slot.stats[0].copy_(stats, non_blocking=True)
            ev["d2h_end"].record(self.copy_out)
        finally:
            torch.cuda.set_stream(self.default)

    def _eager(
        self, served: ServedLayer, slot: _Slot, m: int, with_logits: bool
    ) -> tuple[LayerOutput, torch.Tensor]:
        """The uncaptured forward on the compute stream, its results in the slot's device
        buffers (they outlive the forward's own tensors until the copy out)."""
        logits = slot.logits[1][:m] if with_logits else None
        out = served.layer.forward(ForwardInputs(slot.hidden[1][:m], logits))
        e = served.config.num_experts
        stats = slot.stats[1]
        stats[:e].copy_(expert_tokens(out.routing.topk_ids, e))
        stats[e].copy_(all_finite_on_device(out.output))
        stats[e + 1].copy_(finite_flag(ForwardInputs(slot.hidden[1][:m], logits)))
        values = (out.output, out.routing.topk_ids, out.routing.topk_weights)
        for (_, dev), value in zip(slot.results(), values, strict=True):
            dev[:m].copy_(value)
        ids, weights = slot.topk_ids[1][:m], slot.topk_weights[1][:m]
        return LayerOutput(slot.output[1][:m], Routing(ids, weights)), stats


class _InFlight:
    def __init__(
        self,
        pipeline: DevicePipeline,
        served: ServedLayer,
        slot: _Slot,
        sizes: list[int],
        stage_s: float,
        into: list[torch.Tensor | None],
    ) -> None:
        self.pipeline = pipeline
        self.served = served
        self.slot = slot
        self.sizes = sizes
        self.stage_s = stage_s
        self.into = into

    def done(self) -> bool:
        return self.slot.events["d2h_end"].query()

    def result(self) -> BatchResult:
        slot = self.slot
        try:
            slot.events["d2h_end"].synchronize()  # the batch's one host sync
            # Copies of each part's rows (the pinned buffers serve the batch after next), taken
            # through numpy: a torch slice or clone costs several times a numpy one, and a batch
            # makes a few per part on the path of every request.
            host = slot.host
            host.check_routing(sum(self.sizes), self.served.config.num_experts)
            outputs, begin = [], 0
            for size, target in zip(self.sizes, self.into, strict=True):
                rows = slice(begin, begin + size)
                begin += size
                output = target if target is not None else host.output(rows)
                outputs.append(LayerOutput(output, Routing(host.ids(rows), host.weights(rows))))
            times = StageTimes(
                forward_s=slot.seconds("forward_start", "forward_end"),
                stage_s=self.stage_s,
                h2d_s=slot.seconds("h2d_start", "h2d_end"),
                d2h_s=slot.seconds("d2h_start", "d2h_end"),
            )
            counts, finite, inputs_finite = host.stats()
            return BatchResult(outputs, counts, times, finite, inputs_finite)
        finally:
            self.pipeline._release(self.served, slot)
