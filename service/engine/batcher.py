"""DynamicBatcher: per-layer queues merged into few large forwards, several batches in flight.

    submit(layer, inputs, options) -> a request in the layer's queue, at its priority level;
      launched at once instead, as a batch of its own, when nothing of the layer waits and
      nothing runs on its device (one client's request pays no scheduler wake-up), and then
      waited for by the event loop itself (no thread's wake-up, nor the loop's)
    scheduler (one asyncio task per layer): once a forward may start (fewer than
      engine.max_in_flight running on the layer's device) and the batch is full or its oldest
      request has waited max_batch_delay -> rows taken from the queued requests ->
      engine.start on the launcher thread -> the result on the device's completer thread ->
      each request's rows

Requests are taken by priority level (lowest number first), then by turns and age. A request
larger than max_batch_tokens goes in pieces, one per forward, and each piece waits for the
requests that have had fewer: the pieces of different requests interleave, and a 1-token
request waits for at most one piece of a 100k-token one. A request whose queue time passes its
timeout gets DeadlineExceeded and nothing of it runs; one whose client goes away (its `submit`
cancelled) leaves the queue. A full queue raises Overloaded (429) instead of growing; a forward
that raises fails only the requests in its batch. Waits are measured on time.perf_counter_ns:
the event loop's clock (uvloop's) moves in whole milliseconds, and most waits are shorter.

One launcher thread starts every batch, so the devices have one owner and the event loop
never blocks (on a GPU a small batch is staged and enqueued on the loop itself, which costs less
than the hop); a completer thread per device waits for each of its batches' device work to
finish (so that a batch done on one GPU never waits behind a longer one on another). A
synchronous engine (the CPU) runs each batch to its end on the launcher thread, which answers
it from there.

A lone request's batch on a GPU is not handed to the completer: the event loop looks whether
it is done at each of its turns, and turns without sleeping meanwhile (still serving what
arrives), then answers it at once. A loop that slept through a forward of milliseconds woke to
the completer's call late (its core idle deep, its caches cold) and ran the reply's host work
slowly, and the completer, woken and waiting for the GIL, took longer still: one client paid
it on every request (`bench/request_path.py`: batcher-pinned against engine-pinned, which
grows with the forward's time). It costs a core while the batch runs (CUDA's own wait spins
one in the completer otherwise). Only a batch launched while no other is in flight is polled,
and it goes to its completer as soon as another one is launched, on any device, or a request's
host work runs on a thread (service/off_loop.py): a loop that never sleeps holds the GIL for
long stretches, which the launcher, completer and those threads would then wait for. For the
same reason the loop stays awake (service/awake.py) for a moment after a batch is answered only
while nothing is in flight on any device: a client's next request, sent as the reply arrives,
is read at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache, partial
from typing import TypeVar

import torch

from ...kernels.input_checks import InputError, check_values
from ...kernels.layer import LayerOutput
from ...kernels.quant_scheme import ActQuant
from ...kernels.tensors import ForwardInputs, Routing
from .. import off_loop, tracing
from ..awake import Awake
from ..errors import (
    BadInput,
    DeadlineExceeded,
    ForwardFailed,
    NonFiniteOutput,
    NotReady,
    Overloaded,
    ShuttingDown,
    UnknownLayer,
)
from ..interpreter import switch_gil_often
from ..metrics import Metrics
from .interface import BatchResult, Pending, ServedLayer, ServingEngine
from .pipeline import copied_in_place

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
DRAIN_POLL_S = 0.005  # how often remove_layer looks whether a layer's requests are done
T = TypeVar("T")
DEFAULT_PRIORITY = 0  # as KServe/Triton: 0 (or none) is the default level, after every other


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_tokens: int  # rows per forward; a larger request is split into pieces of this
    max_delay_s: float  # how long the oldest request waits for others to join its batch
    max_queue: int  # requests admitted per layer (waiting or running) before Overloaded


@dataclass(frozen=True)
class RequestOptions:
    """Triton's schedule policy for one request."""

    priority: int = DEFAULT_PRIORITY  # 1 goes first, then 2, ...; 0 is the default, after all
    timeout_s: float | None = None  # longest wait in the queue before any of it runs

    def __post_init__(self) -> None:
        if self.priority < 0:
            raise ValueError(f"priority must be >= 0, got {self.priority}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s}")

    @property
    def level(self) -> float:
        """Sort key of the request's priority level: lower goes first."""
        return float("inf") if self.priority == DEFAULT_PRIORITY else self.priority


@dataclass(eq=False)
class _Request:
    inputs: ForwardInputs  # [T, H] on the CPU, in its wire dtype
    options: RequestOptions
    arrived_ns: int  # time.perf_counter_ns()
    future: asyncio.Future[LayerOutput]
    trace: tracing.Arrival  # its trace context, for the queue and forward spans
    # [T, H] rows the output is copied straight into (pinned host or GPU memory in a float
    # dtype: the device casts and copies), or None: the output comes back as new tensors
    output_into: torch.Tensor | None = None
    taken: int = 0  # rows handed to forwards so far
    running: int = 0  # pieces launched and not finished
    # made only for a caller that must wait for `running` to reach 0 (one event per request
    # was a measurable share of the engine's loop under load); set once it has
    settled: asyncio.Event | None = None
    pieces_taken: int = 0  # forwards it has rows in
    pieces: list[tuple[int, LayerOutput]] = field(default_factory=list)  # (first row, rows)
    done_rows: int = 0

    @property
    def tokens(self) -> int:
        return self.inputs.hidden_states.shape[0]

    @property
    def waiting(self) -> int:
        """Rows not yet handed to a forward."""
        return self.tokens - self.taken

    @property
    def has_logits(self) -> bool:
        return self.inputs.router_logits is not None

    def lends_memory(self) -> bool:
        """Whether a forward copies from or into the caller's memory on the device's own
        schedule: an output buffer, or inputs on a GPU or in pinned memory."""
        hidden = self.inputs.hidden_states
        return self.output_into is not None or hidden.is_cuda or hidden.is_pinned()

    def finish_piece(self, start: int, out: LayerOutput) -> None:
        """One forward's rows of this request; the request completes with its last piece."""
        into = self.output_into
        if into is not None and out.output is not into:  # a piece, or not written there
            rows = into[start : start + out.output.shape[0]]
            if rows.data_ptr() != out.output.data_ptr():  # the engine did not write it there
                rows.copy_(out.output)
            out = LayerOutput(rows, out.routing)
        self.pieces.append((start, out))
        self.done_rows += out.output.shape[0]
        if self.done_rows < self.tokens or self.future.done():
            return
        if len(self.pieces) == 1:
            self.future.set_result(out)
            return
        parts = [p for _, p in sorted(self.pieces, key=lambda piece: piece[0])]
        whole = self.output_into  # every piece's rows were copied into it
        self.future.set_result(
            LayerOutput(
                torch.cat([p.output for p in parts]) if whole is None else whole,
                Routing(
                    torch.cat([p.routing.topk_ids for p in parts]),
                    torch.cat([p.routing.topk_weights for p in parts]),
                ),
            )
        )


@dataclass(frozen=True)
class _Piece:
    request: _Request
    start: int  # first row of the request in this forward
    rows: int

    @property
    def whole(self) -> bool:
        """The piece is its whole request (no views to make: a torch slice costs microseconds)."""
        return self.rows == self.request.tokens

    def inputs(self) -> ForwardInputs:
        x = self.request.inputs
        if self.whole:
            return x
        rows = slice(self.start, self.start + self.rows)
        logits = x.router_logits
        return ForwardInputs(x.hidden_states[rows], None if logits is None else logits[rows])

    def output_into(self) -> torch.Tensor | None:
        into = self.request.output_into
        if into is None or self.whole:
            return into
        return into[self.start : self.start + self.rows]

    def ended(self) -> None:
        """Its forward finished or failed: the device no longer touches its rows."""
        request = self.request
        request.running -= 1
        if not request.running and request.settled is not None:
            request.settled.set()


@dataclass
class _LayerQueue:
    # False where merging would change results: one fp8 scale over the whole batch
    merge: bool
    levels: dict[float, deque[_Request]] = field(default_factory=dict)
    tokens: int = 0  # rows waiting
    requests: int = 0  # admitted and not finished
    draining: bool = False  # being removed: admits nothing more
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def waiting(self) -> int:
        return sum(len(level) for level in self.levels.values())

    def oldest_ns(self) -> int:
        return min(level[0].arrived_ns for level in self.levels.values() if level)

    def remove(self, request: _Request) -> None:
        """Take a request that has rows waiting out of the queue."""
        level = self.levels[request.options.level]
        level.remove(request)
        self.tokens -= request.waiting
        if not level:
            del self.levels[request.options.level]


def _new_queue(served: ServedLayer) -> _LayerQueue:
    return _LayerQueue(merge=served.config.quant.spec.act_quant != ActQuant.TENSOR)


class _Completer:
    """A device's thread that waits for each of its batches to finish, in launch order, and
    hands it to the loop; started with the first batch. A bare queue: an executor's future,
    work item and locks per batch cost the launch more."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # the loop has closed: nothing left to answer
                log.exception("a finished batch could not be handed to the event loop")

    def shutdown(self) -> None:
        """Blocks until every batch submitted is handed over."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()


@dataclass
class _Lane:
    """What the batches of the layers on one device share: how many more may be in flight, the
    thread that waits for them to finish, and how many are in flight."""

    in_flight: asyncio.Semaphore
    completer: _Completer
    busy: int = 0  # batches launched and not finished


@dataclass(frozen=True)
class _Launched:
    """A batch on the device: its layer and pieces, its device's lane, when it was launched
    (its trace spans), how long each piece had waited (ns), and the future `close` waits on
    (done once it is answered)."""

    name: str
    pieces: list[_Piece]
    lane: _Lane
    ns: int
    queued_ns: list[int]
    answered: asyncio.Future[None]


class DynamicBatcher:
    def __init__(self, engine: ServingEngine, policy: BatchPolicy, metrics: Metrics) -> None:
        self.engine = engine
        self.policy = policy
        self.metrics = metrics
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-device")
        self._lanes: dict[torch.device, _Lane] = {}
        self._queues = {name: _new_queue(served) for name, served in engine.layers.items()}
        self._tasks: list[asyncio.Task[None]] = []
        self._running: set[asyncio.Future[None]] = set()  # batches in flight
        self._admitted = 0  # requests in `submit`, every layer's
        self._launching = asyncio.Lock()
        self._closing = False
        # the lone batch the event loop waits for itself (see the module doc), and its result
        self._polled: tuple[_Launched, Pending] | None = None
        self._awake = Awake(allowed=lambda: not any(lane.busy for lane in self._lanes.values()))
        if engine.enqueues:  # process-wide: this process serves the device
            switch_gil_often()

    @property
    def idle(self) -> bool:
        """No request is admitted (queued or running): a caller outside `submit` is the
        server's only request, which may keep larger host work on the event loop
        (service/off_loop.py)."""
        return not self._admitted

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._schedule(name, q), name=f"batcher-{name}")
            for name, q in self._queues.items()
        ]

    async def close(self) -> None:
        """Refuse new requests, run every queued request, then stop the threads."""
        self._closing = True
        for q in self._queues.values():
            q.arrived.set()
        await asyncio.gather(*self._tasks)
        await asyncio.gather(*self._running)
        await asyncio.to_thread(self._launcher.shutdown, wait=True)
        for lane in self._lanes.values():
            await asyncio.to_thread(lane.completer.shutdown)

    async def submit(
        self,
        name: str,
        inputs: ForwardInputs,
        options: RequestOptions | None = None,
        output_into: torch.Tensor | None = None,
    ) -> LayerOutput:
        """inputs [T, H] (+ logits [T, E]) on the CPU (or a GPU: a CUDA shared-memory region), in a
        wire dtype -> the layer's output [T, H] in its dtype (in the request's where that is
        narrower: float16, checked finite after the cast) and the routing, in order. The one
        entry of every transport.

        `output_into`: [T, H] memory the output is written into (and returned as the output):
        on a GPU engine, pinned host memory or GPU memory (a client's CUDA shared memory), in
        any float dtype, is written from the device with no host copy (cast there); elsewhere
        the result is copied in. Cancelling the call (its client went away) takes the request's
        waiting rows out of the queue; with `output_into` the call returns only once its rows
        already on the device are done with its buffers (so also when its inputs lie on a GPU
        or in pinned memory)."""
        self.engine.get(name)  # UnknownLayer before anything is queued
        if self._closing:
            raise ShuttingDown()
        q = self._queues.get(name)
        if q is None or q.draining:
            raise UnknownLayer(f"layer {name!r} is being unloaded")
        if q.requests >= self.policy.max_queue:
            raise Overloaded(
                f"layer {name!r} already has {q.requests} requests queued "
                f"(max_queue={self.policy.max_queue}); retry later",
                {"Retry-After": RETRY_AFTER_S},
            )
        options = options or RequestOptions()
        loop = asyncio.get_running_loop()
        trace = tracing.Arrival(tracing.current_context(), tracing.now_ns())
        arrived_ns = time.perf_counter_ns()
        request = _Request(inputs, options, arrived_ns, loop.create_future(), trace, output_into)
        q.requests += 1
        self._admitted += 1
        expiry = None
        lane = self._idle_lane(name, q, request)
        if lane is not None:
            await self._launch_alone(name, request, lane)
        else:
            q.levels.setdefault(options.level, deque()).append(request)
            q.tokens += request.tokens
            self.metrics.series(self.metrics.queue_depth, name).set(q.waiting())
            if options.timeout_s is not None:
                expiry = loop.call_later(options.timeout_s, self._expire, q, request)
            q.arrived.set()
        try:
            return await request.future
        finally:
            q.requests -= 1
            self._admitted -= 1
            if expiry is not None:
                expiry.cancel()
            if request.waiting:  # cancelled, expired or failed: its other rows need not run
                self._drop(name, q, request)
            if request.running and request.lends_memory():
                # the device may still read its inputs or write `output_into`: the caller
                # must not reuse them before
                request.settled = asyncio.Event()
                await asyncio.shield(request.settled.wait())
            # A failed request's error, raised here, holds this frame in its traceback: the
            # frame must not hold the future that holds the error, a cycle that would keep the
            # request's inputs (and its caller's body) until the collector, run rarely in a
            # serving process, found it
            del request

    def _idle_lane(self, name: str, q: _LayerQueue, request: _Request) -> _Lane | None:
        """The lane of layer `name` when `request` is the scheduler's next batch whole and can
        start at once, without a turn of the loop for the scheduler to wake: nothing of the
        layer waits, nothing runs on its device (requests that arrive with it then merge into
        the next batch, as they do under load), the scheduler would not hold the batch for
        others to join, and it starts on the loop; else None."""
        tokens, budget = request.tokens, self.policy.max_batch_tokens
        if q.tokens or tokens > budget:
            return None
        if q.merge and self.policy.max_delay_s > 0 and tokens < budget:
            return None
        lane = self._lane(name)
        if lane.busy or lane.in_flight.locked():
            return None
        if self.engine.enqueues and self._launching.locked():
            return None  # a launch on the launcher thread goes first
        return lane if self._starts_on_loop([request.inputs]) else None

    async def _launch_alone(self, name: str, request: _Request, lane: _Lane) -> None:
        """Launch `request` as a batch of its own on its idle lane. Nothing here waits (see
        `_idle_lane`), so the caller cannot be cancelled halfway through."""
        await lane.in_flight.acquire()
        request.taken = request.tokens
        request.pieces_taken = 1
        request.running = 1
        piece = _Piece(request, 0, request.tokens)
        if not await self._launch(name, [piece], lane, alone=True):
            lane.in_flight.release()

    def _drop(self, name: str, q: _LayerQueue, request: _Request) -> None:
        """Rows still waiting leave the queue (rows running finish, unheard)."""
        if request in q.levels.get(request.options.level, ()):
            q.remove(request)
            self.metrics.series(self.metrics.queue_depth, name).set(q.waiting())

    def _expire(self, q: _LayerQueue, request: _Request) -> None:
        if request.taken or request.future.done():
            return  # it started in time: a running request is not cut short
        q.remove(request)
        waited_us = (time.perf_counter_ns() - request.arrived_ns) / 1e3
        request.future.set_exception(
            DeadlineExceeded(
                f"request timeout expired: it waited {waited_us:.0f} us in the queue "
                f"(timeout {request.options.timeout_s * 1e6:.0f} us); nothing of it ran"
            )
        )

    def add_layer(self, name: str) -> None:
        """Start batching for layer `name`, newly in the engine (nothing if it has a queue)."""
        if name not in self._queues:
            q = self._queues[name] = _new_queue(self.engine.get(name))
            self._tasks.append(asyncio.create_task(self._schedule(name, q), name=f"batcher-{name}"))

    async def remove_layer(self, name: str) -> None:
        """Stop batching for layer `name`: admit no new request, let those admitted finish
        (their forwards included), then stop its scheduler."""
        q = self._queues[name]
        q.draining = True
        while q.requests:
            await asyncio.sleep(DRAIN_POLL_S)
        task = next(t for t in self._tasks if t.get_name() == f"batcher-{name}")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self._tasks.remove(task)
        del self._queues[name]

    async def on_worker(self, call: Callable[..., T], *args: object) -> T:
        """Run `call(*args)` on the launcher thread, between launches (loading a layer)."""
        async with self._launching:
            return await asyncio.get_running_loop().run_in_executor(self._launcher, call, *args)

    def _lane(self, name: str) -> _Lane:
        """The lane of the device that serves layer `name` now."""
        device = self.engine.get(name).device
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(
                asyncio.Semaphore(self.engine.max_in_flight), _Completer(f"moe-complete-{device}")
            )
        return lane

    async def _schedule(self, name: str, q: _LayerQueue) -> None:
        max_delay_ns = round(self.policy.max_delay_s * 1e9)
        while True:
            while not q.tokens:
                if self._closing:
                    return
                q.arrived.clear()
                await q.arrived.wait()
            lane = self._lane(name)
            await lane.in_flight.acquire()
            launched = False
            try:
                while q.merge and not self._closing and 0 < q.tokens < self.policy.max_batch_tokens:
                    remaining = (q.oldest_ns() + max_delay_ns - time.perf_counter_ns()) / 1e9
                    if remaining <= 0:
                        break
                    q.arrived.clear()
                    try:
                        await asyncio.wait_for(q.arrived.wait(), remaining)
                    except TimeoutError:
                        break
                batch = self._take(q)
                self.metrics.series(self.metrics.queue_depth, name).set(q.waiting())
                if batch:
                    launched = await self._launch(name, batch, lane)
            finally:
                if not launched:
                    lane.in_flight.release()

    def _take(self, q: _LayerQueue) -> list[_Piece]:
        """Rows for one forward: by level; within a level, requests that had fewer pieces
        first, then by age (so pieces of large requests take turns, and a new request goes
        before the next piece of a running one); whole requests while they fit, and a piece of
        one larger than a forward."""
        batch = self._pick(q)
        for level in [level for level, line in q.levels.items() if not line]:
            del q.levels[level]
        return batch

    def _pick(self, q: _LayerQueue) -> list[_Piece]:
        budget = self.policy.max_batch_tokens
        batch: list[_Piece] = []
        tokens = 0
        with_logits: bool | None = None
        for level in sorted(q.levels):
            line = q.levels[level]
            for request in sorted(line, key=lambda r: (r.pieces_taken, r.arrived_ns)):
                if (batch and not q.merge) or tokens == budget:
                    return batch
                if with_logits is not None and request.has_logits != with_logits:
                    continue  # requests with and without router logits go in separate batches
                rows = request.waiting
                if rows > budget - tokens:
                    if rows <= budget and batch:
                        continue  # it fits a forward of its own: not split, its turn is next
                    rows = budget - tokens
                batch.append(_Piece(request, request.taken, rows))
                with_logits = request.has_logits
                tokens += rows
                request.taken += rows
                request.pieces_taken += 1
                request.running += 1
                q.tokens -= rows
                if not request.waiting:
                    line.remove(request)
        return batch

    def _starts_on_loop(self, parts: list[ForwardInputs]) -> bool:
        """Whether `parts` start without leaving the event loop: a synchronous engine's batch is
        handed to the launcher thread as it is; an enqueuing engine stages and enqueues a small
        batch on the loop, which takes less than a thread hop."""
        if not self.engine.enqueues:
            return True
        if self.engine.start_may_wait:
            return False
        # bytes the launch copies on the host: rows on a GPU (a CUDA shared-memory region) or
        # large ones in pinned memory (a system region's copy) are copied by the device (a
        # 64-token DeepSeek-V3 fp32 region took a thread hop for none)
        nbytes = sum(
            p.hidden_states.numel() * p.hidden_states.element_size()
            for p in parts
            if not copied_in_place(p)
        )
        return nbytes <= off_loop.BINARY.on_loop_bytes

    async def _launch(
        self, name: str, batch: list[_Piece], lane: _Lane, alone: bool = False
    ) -> bool:
        """Start `batch` (on the launcher thread unless it starts on the loop; `alone`: a lone
        request's, known to start on the loop, and waited for there); False (and its requests
        failed) if it raised. Its queue metrics are recorded once it is answered."""
        loop = asyncio.get_running_loop()
        now_ns = time.perf_counter_ns()
        queued_ns = [now_ns - piece.request.arrived_ns for piece in batch]
        parts = [piece.inputs() for piece in batch]
        into = [piece.output_into() for piece in batch]
        if self._polled is not None:  # the launch may need the GIL: the loop stops polling
            self._hand_over(loop)
        if not self.engine.enqueues:
            # A synchronous engine (CPU) runs the batch to its end on the launcher thread, which
            # hands the result straight to the loop: an executor future and the completer's hop
            # cost the reply a loop turn and a thread wake-up more
            launched = self._launched(name, batch, lane, queued_ns)
            result_of = lambda: self.engine.start(name, parts, into).result()  # noqa: E731
            self._launcher.submit(self._complete, loop, launched, result_of)
            return True
        try:
            async with self._launching:  # one launch at a time: the streams take them in order
                if alone or self._starts_on_loop(parts):
                    pending = self.engine.start(name, parts, into)
                else:
                    pending = await loop.run_in_executor(
                        self._launcher, self.engine.start, name, parts, into
                    )
        except Exception as err:
            for piece in batch:
                piece.ended()
            self._count_queued(name, batch, queued_ns)
            self._fail(name, batch, err)
            return False
        # polled where nothing else is in flight on any device (no lone launch happens while
        # another launch is under way: nothing was polled meanwhile)
        polls = alone and not any(other.busy for other in self._lanes.values())
        launched = self._launched(name, batch, lane, queued_ns)
        if polls:
            self._polled = (launched, pending)
            loop.call_soon(self._poll, launched)
        else:
            lane.completer.submit(partial(self._complete, loop, launched, pending.result))
        return True

    def _poll(self, launched: _Launched) -> None:
        """At each turn of the loop: answer the lone batch once it is done, else look again
        at the next turn (a callback always ready: the loop polls for I/O, never sleeps)."""
        if self._polled is None or self._polled[0] is not launched:
            return  # handed to the completer
        pending = self._polled[1]
        try:
            done = pending.done()
        except Exception:
            done = True  # the device failed: its result raises it
        if not done:
            loop = asyncio.get_running_loop()
            if off_loop.working():  # a thread would wait on the polling loop for the GIL
                self._hand_over(loop)
            else:
                loop.call_soon(self._poll, launched)
            return
        self._polled = None
        try:
            result: BatchResult | Exception = pending.result()
        except Exception as err:
            result = err
        self._finish(launched, result)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """The lone batch the loop waits for goes to its device's completer (ahead of any batch
        launched after it)."""
        launched, pending = self._polled
        self._polled = None
        launched.lane.completer.submit(partial(self._complete, loop, launched, pending.result))

    def _count_queued(self, name: str, batch: list[_Piece], queued_ns: list[int]) -> None:
        """The queue metrics of a launched batch: each request's wait for its first rows' forward,
        and the pieces merged into it."""
        for piece, waited_ns in zip(batch, queued_ns, strict=True):
            if piece.start == 0:
                self.metrics.observe_stage(name, "queue", waited_ns / 1e9)
        self.metrics.series(self.metrics.batch_requests, name).observe(len(batch))

    def _launched(
        self, name: str, batch: list[_Piece], lane: _Lane, queued_ns: list[int]
    ) -> _Launched:
        """`batch`, launched now: `close` waits until it is answered."""
        answered = asyncio.get_running_loop().create_future()
        launched = _Launched(name, batch, lane, tracing.now_ns(), queued_ns, answered)
        lane.busy += 1
        self._running.add(launched.answered)
        launched.answered.add_done_callback(self._running.discard)
        return launched

    def _complete(
        self,
        loop: asyncio.AbstractEventLoop,
        launched: _Launched,
        result_of: Callable[[], BatchResult],
    ) -> None:
        """On the completer thread (the launcher, for a synchronous engine): wait for the batch,
        then hand it to the loop as one callback (no task to wake: a task and an executor future
        cost the reply two more turns)."""
        try:
            result: BatchResult | Exception = result_of()
        except Exception as err:
            result = err
        loop.call_soon_threadsafe(self._finish, launched, result)

    def _finish(self, launched: _Launched, result: BatchResult | Exception) -> None:
        name, batch = launched.name, launched.pieces
        launched.lane.busy -= 1
        launched.lane.in_flight.release()
        for piece in batch:
            piece.ended()
        launched.answered.set_result(None)
        if isinstance(result, Exception):
            self._count_queued(name, batch, launched.queued_ns)
            self._fail(name, batch, result)
            return
        served = self.engine.get(name)
        # before the requests answer: a request's span records children only until it ends
        pieces = [(piece.request.trace, piece.rows) for piece in batch]
        tracing.record_forward(name, served.backend, pieces, launched.ns, tracing.now_ns())
        dtype = served.config.dtype
        nonfinite = False  # any piece's output, as its request gets it, holds NaN or Inf
        for piece, out in zip(batch, result.outputs, strict=True):
            if not result.inputs_finite and _fail_bad_values(piece, dtype):
                continue
            narrower = _narrower(piece.request.inputs.hidden_states.dtype, dtype)
            if narrower is not None and out.output.dtype != narrower:
                out = LayerOutput(out.output.to(narrower), out.routing)  # checked, then served
            if (not result.finite or narrower) and _fail_nonfinite(name, piece, out, narrower):
                nonfinite = True
                continue
            piece.request.finish_piece(piece.start, out)
        # the requests answer first (their tasks are woken before this): the metrics are off
        # their path
        record = partial(self._record, launched, served.backend, result, nonfinite)
        asyncio.get_running_loop().call_soon(record)
        if self.engine.enqueues:
            self._awake.linger()

    def _record(
        self, launched: _Launched, backend: str, result: BatchResult, nonfinite: bool
    ) -> None:
        name = launched.name
        self._count_queued(name, launched.pieces, launched.queued_ns)
        tokens = sum(piece.rows for piece in launched.pieces)
        self.metrics.record_batch(
            name, backend, tokens, result.expert_tokens, result.times, launched.queued_ns
        )
        if nonfinite:
            self.metrics.nonfinite_forwards.labels(name).inc()

    def _fail(self, name: str, batch: list[_Piece], err: Exception) -> None:
        tokens = sum(piece.rows for piece in batch)
        log.error(
            "forward of layer %s failed on a batch of %d tokens",
            name,
            tokens,
            exc_info=(type(err), err, err.__traceback__),
        )
        failure = (
            err  # the engine cannot serve at all (a lost expert-parallel rank): 503
            if isinstance(err, NotReady)
            else ForwardFailed(f"forward of layer {name!r} failed: {type(err).__name__}: {err}")
        )
        for piece in batch:
            if not piece.request.future.done():
                piece.request.future.set_exception(failure)


def _fail_bad_values(piece: _Piece, layer_dtype: torch.dtype) -> bool:
    """Fail the piece's request with a 400 naming its piece's first value that is NaN, Inf or
    beyond the layer's dtype (a host look at the piece's rows, at most a batch of them, only for
    a batch whose input flag is down); whether it did. Its rows ran, but their output is never
    served."""
    request = piece.request
    if request.future.done():  # failed by another of its pieces
        return True
    try:
        check_values(piece.inputs(), layer_dtype, first_row=piece.start)
    except InputError as err:
        request.future.set_exception(BadInput(str(err)))
        return True
    return False


@cache  # asked for every piece of every batch, of a handful of dtype pairs
def _narrower(wire: torch.dtype, layer: torch.dtype) -> torch.dtype | None:
    """The request's dtype where the output's cast into it can overflow (float16 against a
    bfloat16 or float32 layer), else None."""
    narrows = wire.is_floating_point and torch.finfo(wire).max < torch.finfo(layer).max
    return wire if narrows else None


def _fail_nonfinite(
    name: str, piece: _Piece, out: LayerOutput, narrower: torch.dtype | None
) -> bool:
    """Fail the piece's request if its rows of the output, as the request gets them (cast to
    the `narrower` dtype of the request where there is one), hold NaN or Inf (a look at the
    rows, only for a batch whose device check failed or a narrowing cast); whether it did."""
    bad = ~torch.isfinite(out.output).all(dim=1)
    if not bad.any():
        return False
    row = piece.start + int(bad.nonzero()[0])
    log.warning("layer %s: NaN or Inf in the output at row %d of a request", name, row)
    why = "inputs this large overflow the layer's arithmetic"
    if narrower is not None:
        dtype = str(narrower).removeprefix("torch.")
        why = (
            f"inputs this large overflow the layer's arithmetic or its output exceeds {dtype} "
            f"(largest {torch.finfo(narrower).max:g}); send the request in bfloat16 or float32"
        )
    if not piece.request.future.done():
        piece.request.future.set_exception(
            NonFiniteOutput(
                f"the output of layer {name!r} holds NaN or Inf at row {row} of this request: {why}"
            )
        )
    return True
