"""DynamicBatcher: per-layer queues merged into few large forwards on one device worker.

    submit(layer, inputs) -> chunks of <= max_batch_tokens -> the layer's queue
    scheduler (one asyncio task per layer): wait until the batch is full or its oldest chunk
      has waited max_batch_delay -> concatenate -> Engine.forward on the worker thread -> split

One worker thread runs every forward, so the device has one owner and the event loop never
blocks. A full queue raises Overloaded (429) instead of growing; a forward that raises fails
only the requests in its batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from kernels.layer import LayerOutput
from kernels.quant_scheme import ActQuant
from kernels.tensors import ForwardInputs, Routing
from service import tracing
from service.engine import Engine, ServedLayer
from service.errors import ForwardFailed, NotReady, Overloaded, ShuttingDown, UnknownLayer
from service.metrics import Metrics

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
DRAIN_POLL_S = 0.005  # how often remove_layer looks whether a layer's requests are done
T = TypeVar("T")


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_tokens: int  # rows per forward; a larger request is split into chunks of this
    max_delay_s: float  # how long the oldest chunk waits for others to join its batch
    max_queue: int  # requests admitted per layer (waiting or running) before Overloaded


@dataclass
class _Chunk:
    inputs: ForwardInputs  # [t, H] float32 on CPU, t <= max_batch_tokens
    future: asyncio.Future[LayerOutput]
    arrived: float  # event-loop time
    trace: tracing.Piece  # its request's trace context, for the queue and forward spans

    @property
    def tokens(self) -> int:
        return self.inputs.hidden_states.shape[0]


@dataclass
class _LayerQueue:
    # False where merging would change results: one fp8 scale over the whole batch
    merge: bool
    chunks: deque[_Chunk] = field(default_factory=deque)
    tokens: int = 0  # rows waiting in `chunks`
    requests: int = 0  # admitted and not finished
    draining: bool = False  # being removed: admits nothing more
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


def _new_queue(served: ServedLayer) -> _LayerQueue:
    return _LayerQueue(merge=served.config.quant.spec.act_quant != ActQuant.TENSOR)


def _split(inputs: ForwardInputs, size: int) -> list[ForwardInputs]:
    logits = inputs.router_logits
    return [
        ForwardInputs(
            inputs.hidden_states[start : start + size],
            None if logits is None else logits[start : start + size],
        )
        for start in range(0, inputs.hidden_states.shape[0], size)
    ]


def _concat(parts: list[LayerOutput]) -> LayerOutput:
    return LayerOutput(
        torch.cat([p.output for p in parts]),
        Routing(
            torch.cat([p.routing.topk_ids for p in parts]),
            torch.cat([p.routing.topk_weights for p in parts]),
        ),
    )


class DynamicBatcher:
    def __init__(self, engine: Engine, policy: BatchPolicy, metrics: Metrics) -> None:
        self.engine = engine
        self.policy = policy
        self.metrics = metrics
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-device")
        self._queues = {name: _new_queue(served) for name, served in engine.layers.items()}
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._schedule(name, q), name=f"batcher-{name}")
            for name, q in self._queues.items()
        ]

    async def close(self) -> None:
        """Refuse new requests, run every queued chunk, then stop the worker."""
        self._closing = True
        for q in self._queues.values():
            q.arrived.set()
        await asyncio.gather(*self._tasks)
        await asyncio.to_thread(self._worker.shutdown, wait=True)

    async def submit(self, name: str, inputs: ForwardInputs) -> LayerOutput:
        """inputs [T, H] (float32, CPU) -> the layer's output [T, H] and routing, in order."""
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
        q.requests += 1
        try:
            loop = asyncio.get_running_loop()
            context, arrived_ns = tracing.current_context(), tracing.now_ns()
            chunks = [
                _Chunk(
                    part,
                    loop.create_future(),
                    loop.time(),
                    tracing.Piece(context, arrived_ns, part.hidden_states.shape[0]),
                )
                for part in _split(inputs, self.policy.max_batch_tokens)
            ]
            q.chunks.extend(chunks)
            q.tokens += inputs.hidden_states.shape[0]
            self.metrics.queue_depth.labels(name).set(len(q.chunks))
            q.arrived.set()
            results = await asyncio.gather(*(c.future for c in chunks), return_exceptions=True)
        finally:
            q.requests -= 1
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return _concat(results)

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
        """Run `call(*args)` on the device worker, between forwards (loading a layer)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, call, *args)

    async def _schedule(self, name: str, q: _LayerQueue) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not q.chunks:
                if self._closing:
                    return
                q.arrived.clear()
                await q.arrived.wait()
            deadline = q.chunks[0].arrived + self.policy.max_delay_s
            while q.merge and not self._closing and q.tokens < self.policy.max_batch_tokens:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                q.arrived.clear()
                try:
                    await asyncio.wait_for(q.arrived.wait(), remaining)
                except TimeoutError:
                    break
            batch = self._take(q)
            self.metrics.queue_depth.labels(name).set(len(q.chunks))
            if batch:
                await self._run(name, batch)

    def _take(self, q: _LayerQueue) -> list[_Chunk]:
        """The oldest chunks that fit the token budget and agree on sending router logits."""
        batch: list[_Chunk] = []
        tokens = 0
        while q.chunks:
            chunk = q.chunks[0]
            if batch and (
                not q.merge
                or tokens + chunk.tokens > self.policy.max_batch_tokens
                or (chunk.inputs.router_logits is None) != (batch[0].inputs.router_logits is None)
            ):
                break
            q.chunks.popleft()
            q.tokens -= chunk.tokens
            if not chunk.future.done():  # done: its client went away
                batch.append(chunk)
                tokens += chunk.tokens
        return batch

    async def _run(self, name: str, batch: list[_Chunk]) -> None:
        logits = [c.inputs.router_logits for c in batch]
        inputs = ForwardInputs(
            torch.cat([c.inputs.hidden_states for c in batch]),
            None if logits[0] is None else torch.cat(logits),
        )
        self.metrics.batch_requests.labels(name).observe(len(batch))
        loop = asyncio.get_running_loop()
        queued_s = [loop.time() - c.arrived for c in batch]
        try:
            result, started_ns, ended_ns = await loop.run_in_executor(
                self._worker, self._forward, name, inputs, queued_s
            )
        except Exception as err:
            tokens = inputs.hidden_states.shape[0]
            log.exception("forward of layer %s failed on a batch of %d tokens", name, tokens)
            failure = (
                err  # the engine cannot serve at all (a lost expert-parallel rank): 503
                if isinstance(err, NotReady)
                else ForwardFailed(f"forward of layer {name!r} failed: {type(err).__name__}: {err}")
            )
            for c in batch:
                if not c.future.done():
                    c.future.set_exception(failure)
            return
        backend = self.engine.get(name).backend
        tracing.record_forward(name, backend, [c.trace for c in batch], started_ns, ended_ns)
        start = 0
        for c in batch:
            rows = slice(start, start + c.tokens)
            start += c.tokens
            if not c.future.done():
                part = Routing(result.routing.topk_ids[rows], result.routing.topk_weights[rows])
                c.future.set_result(LayerOutput(result.output[rows], part))

    def _forward(
        self, name: str, inputs: ForwardInputs, queued_s: list[float]
    ) -> tuple[LayerOutput, int, int]:
        """On the worker thread: the forward and its metrics; also its start and end (ns)."""
        started_ns, started = tracing.now_ns(), time.perf_counter()
        result = self.engine.forward(name, inputs)  # returns on CPU, so the device is done
        seconds = time.perf_counter() - started
        served = self.engine.get(name)
        self.metrics.record_forward(
            name, served.backend, result.routing.topk_ids, seconds, queued_s
        )
        return result, started_ns, tracing.now_ns()
