"""The batcher's schedule policy on a real CPU engine: priority levels, queue timeouts, pieces of
large requests interleaving with small ones, withdrawn requests, and the disconnect watch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.core.forward import submit_unless_withdrawn
from moe_serve.service.engine.batcher import BatchPolicy, DynamicBatcher, RequestOptions
from moe_serve.service.errors import ClientDisconnected, DeadlineExceeded
from moe_serve.service.http.server import client_gone
from moe_serve.service.metrics import Metrics
from tests.service.layers import TINY, reference_forward, tiny_layers
from tests.service.test_batcher import WAIT_S, RecordingEngine, rows, run
from tests.service.test_output_into import EnqueuingEngine


class OrderEngine(RecordingEngine):
    """Also records each batch's first row, to tell which request went first."""

    def __init__(self) -> None:
        super().__init__(tiny_layers())
        self.first_rows: list[torch.Tensor] = []

    def forward(self, name: str, inputs: ForwardInputs):
        self.first_rows.append(inputs.hidden_states[0].clone())
        return super().forward(name, inputs)

    def order_of(self, *requests: torch.Tensor) -> list[int]:
        """For each batch, which of `requests` its first row came from."""
        return [
            next(i for i, x in enumerate(requests) if (x == first).all(dim=1).any())
            for first in self.first_rows
        ]


async def _busy(batcher: DynamicBatcher, engine: RecordingEngine, x: torch.Tensor) -> asyncio.Task:
    """Hold the device with a request of `x` whose forward waits on the engine's gate."""
    engine.gate.clear()
    task = asyncio.create_task(batcher.submit(TINY, ForwardInputs(x)))
    await _on_the_device(engine)
    return task


async def _on_the_device(engine: RecordingEngine) -> None:
    """Returns once a forward has begun on the engine's thread."""
    assert await asyncio.to_thread(engine.entered.wait, WAIT_S), "no forward began"
    engine.entered.clear()


async def _admitted(batcher: DynamicBatcher, requests: int) -> None:
    """Yields to the event loop (where submitting tasks and the scheduler run) until the layer
    has `requests` admitted and not finished: an order of events, not a span of time."""
    for _ in range(10_000):
        if batcher._queues[TINY].requests == requests:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never {requests} requests admitted")


def test_a_higher_priority_request_goes_before_an_earlier_default_one() -> None:
    engine = OrderEngine()
    busy, default, urgent, later = rows(8, 0), rows(8, 1), rows(8, 2), rows(8, 3)

    async def body(batcher):
        first = await _busy(batcher, engine, busy)
        tasks = [
            asyncio.create_task(batcher.submit(TINY, ForwardInputs(default))),
            asyncio.create_task(batcher.submit(TINY, ForwardInputs(later), RequestOptions(2))),
            asyncio.create_task(batcher.submit(TINY, ForwardInputs(urgent), RequestOptions(1))),
        ]
        await _admitted(batcher, 4)
        engine.gate.set()
        return await asyncio.gather(first, *tasks)

    results = run(engine, BatchPolicy(8, 0.0, 16), body)
    assert engine.order_of(busy, default, urgent, later) == [0, 2, 3, 1]
    for x, result in zip((busy, default, later, urgent), results, strict=True):
        torch.testing.assert_close(result.output, reference_forward(TINY, x))


def test_a_request_still_queued_at_its_timeout_fails_and_none_of_it_runs() -> None:
    engine = OrderEngine()
    busy, late = rows(8, 0), rows(3, 1)

    async def body(batcher):
        first = await _busy(batcher, engine, busy)
        with pytest.raises(DeadlineExceeded, match=r"timeout 20000 us.*nothing of it ran"):
            await batcher.submit(TINY, ForwardInputs(late), RequestOptions(timeout_s=0.02))
        engine.gate.set()
        return await first

    run(engine, BatchPolicy(8, 0.0, 16), body)
    assert engine.batch_sizes == [8]  # the expired request never reached a forward


def test_a_request_that_starts_in_time_is_not_cut_short_by_its_timeout() -> None:
    engine = OrderEngine()
    x = rows(20, 0)

    async def body(batcher):
        engine.gate.clear()
        task = asyncio.create_task(
            batcher.submit(TINY, ForwardInputs(x), RequestOptions(timeout_s=0.5))
        )
        await _on_the_device(engine)  # its first piece runs ...
        await asyncio.sleep(0.6)  # ... and its timeout passes
        engine.gate.set()
        return await task

    result = run(engine, BatchPolicy(8, 0.0, 16), body)
    assert engine.batch_sizes == [8, 8, 4]
    torch.testing.assert_close(result.output, reference_forward(TINY, x))


def test_a_small_request_waits_one_piece_of_a_large_one_not_all_of_it() -> None:
    engine = OrderEngine()
    large, small = rows(40, 0), rows(1, 1)
    finished: list[str] = []

    async def submit(label: str, x: torch.Tensor):
        out = await batcher_ref[0].submit(TINY, ForwardInputs(x))
        finished.append(label)
        return out

    batcher_ref: list[DynamicBatcher] = []

    async def body(batcher):
        batcher_ref.append(batcher)
        engine.gate.clear()
        big = asyncio.create_task(submit("large", large))
        await _on_the_device(engine)  # its first piece
        little = asyncio.create_task(submit("small", small))
        await _admitted(batcher, 2)
        engine.gate.set()
        return await asyncio.gather(big, little)

    big, little = run(engine, BatchPolicy(8, 0.0, 16), body)
    assert engine.batch_sizes == [8, 8, 8, 8, 8, 1]
    assert engine.order_of(large, small)[:2] == [0, 1]  # the second forward starts with it
    assert finished == ["small", "large"]
    torch.testing.assert_close(big.output, reference_forward(TINY, large))
    torch.testing.assert_close(little.output, reference_forward(TINY, small))


def test_pieces_of_two_large_requests_take_turns() -> None:
    engine = OrderEngine()
    a, b = rows(24, 0), rows(24, 1)

    async def body(batcher):
        return await asyncio.gather(
            batcher.submit(TINY, ForwardInputs(a)), batcher.submit(TINY, ForwardInputs(b))
        )

    first, second = run(engine, BatchPolicy(16, 0.0, 16), body)
    assert engine.batch_sizes == [16, 16, 16]
    assert engine.order_of(a, b) == [0, 1, 0]  # a's 16, then b's 16, then a's 8 + b's 8
    torch.testing.assert_close(first.output, reference_forward(TINY, a))
    torch.testing.assert_close(second.output, reference_forward(TINY, b))


class _SizesEngine(EnqueuingEngine):
    """Also records each batch's rows as it is launched."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def start(self, name, parts, into=None):
        self.sizes.append(sum(p.hidden_states.shape[0] for p in parts))
        return super().start(name, parts, into)


def test_a_request_that_finds_its_layer_idle_is_launched_before_the_loop_turns() -> None:
    """Nothing of the layer waits and nothing runs on its device: `submit` launches the request
    itself in its first step (no turn for the scheduler to wake), and its queue metrics are
    counted as any batch's."""
    engine = EnqueuingEngine()
    metrics = Metrics()
    x = rows(3, 0)

    async def main():
        batcher = DynamicBatcher(engine, BatchPolicy(8, 0.0, 16), metrics)
        batcher.start()
        try:
            work = asyncio.create_task(batcher.submit(TINY, ForwardInputs(x)))
            await asyncio.sleep(0)  # one turn of the loop: the task's first step
            launched = engine.launched.is_set()
            return launched, await asyncio.wait_for(work, WAIT_S)
        finally:
            await batcher.close()

    launched, result = asyncio.run(main())
    assert launched
    torch.testing.assert_close(result.output, reference_forward(TINY, x))
    sample = metrics.registry.get_sample_value
    assert sample("moe_serve_stage_seconds_count", {"layer": TINY, "stage": "queue"}) == 1
    assert sample("moe_serve_batch_requests_count", {"layer": TINY}) == 1
    assert sample("moe_serve_batch_tokens_sum", {"layer": TINY}) == 3


def test_requests_that_arrive_with_one_launched_at_once_merge_into_the_next_batch() -> None:
    """The first of requests arriving together on an idle device goes at once; the others wait
    for the scheduler, which takes them together, by priority, while the first still runs."""
    engine = _SizesEngine()
    engine.gate.clear()  # the batches stay on the "device"
    first, default, urgent = rows(2, 0), rows(3, 1), rows(1, 2)

    async def body(batcher):
        tasks = [
            asyncio.create_task(batcher.submit(TINY, ForwardInputs(first))),
            asyncio.create_task(batcher.submit(TINY, ForwardInputs(default))),
            asyncio.create_task(batcher.submit(TINY, ForwardInputs(urgent), RequestOptions(1))),
        ]
        await _admitted(batcher, 3)
        while len(engine.sizes) < 2:  # the scheduler's turn: an order of events
            await asyncio.sleep(0)
        engine.gate.set()
        return await asyncio.gather(*tasks)

    results = run(engine, BatchPolicy(8, 0.0, 16), body)
    assert engine.sizes == [2, 4]
    for x, result in zip((first, default, urgent), results, strict=True):
        torch.testing.assert_close(result.output, reference_forward(TINY, x))


def test_a_withdrawn_request_leaves_the_queue_and_the_others_are_served() -> None:
    engine = OrderEngine()
    busy, gone, kept = rows(8, 0), rows(5, 1), rows(2, 2)

    async def body(batcher):
        first = await _busy(batcher, engine, busy)
        withdrawn = asyncio.create_task(batcher.submit(TINY, ForwardInputs(gone)))
        stays = asyncio.create_task(batcher.submit(TINY, ForwardInputs(kept)))
        await _admitted(batcher, 3)
        withdrawn.cancel()
        await _admitted(batcher, 2)
        engine.gate.set()
        return await asyncio.gather(first, stays)

    _, result = run(engine, BatchPolicy(8, 0.0, 16), body)
    assert engine.batch_sizes == [8, 2]
    torch.testing.assert_close(result.output, reference_forward(TINY, kept))


class _LeavingClient:
    """A request whose client disconnects once `leaves` is set."""

    def __init__(self) -> None:
        self.leaves = asyncio.Event()

    async def receive(self) -> dict:
        await self.leaves.wait()
        return {"type": "http.disconnect"}


async def submit_while_connected(client, batcher, name, inputs, options):
    """batcher.submit as the HTTP routes call it: withdrawn once the client has gone."""
    watch = asyncio.ensure_future(client_gone(client.receive))
    try:
        return await submit_unless_withdrawn(batcher, name, inputs, options, watch)
    finally:
        watch.cancel()


def test_a_client_that_disconnects_has_its_queued_rows_dropped() -> None:
    engine = OrderEngine()
    busy, gone = rows(8, 0), rows(6, 1)

    async def body(batcher):
        first = await _busy(batcher, engine, busy)
        client = _LeavingClient()
        leaving = asyncio.create_task(
            submit_while_connected(client, batcher, TINY, ForwardInputs(gone), RequestOptions())
        )
        await _admitted(batcher, 2)  # queued behind the busy one
        client.leaves.set()
        with pytest.raises(ClientDisconnected, match="withdrawn"):
            await leaving
        engine.gate.set()
        return await first

    run(engine, BatchPolicy(8, 0.0, 16), body)
    assert engine.batch_sizes == [8]


def test_a_request_cancelled_from_elsewhere_stays_cancelled_and_leaves_the_queue() -> None:
    """The drain at shutdown cancels a request still waiting: a cancellation (the middleware
    answers 503 to it), not a disconnect, and its rows do not run."""
    engine = OrderEngine()
    busy, cut = rows(8, 0), rows(6, 1)

    async def body(batcher):
        first = await _busy(batcher, engine, busy)
        waiting = asyncio.create_task(
            submit_while_connected(
                _LeavingClient(), batcher, TINY, ForwardInputs(cut), RequestOptions()
            )
        )
        await _admitted(batcher, 2)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        engine.gate.set()
        return await first

    run(engine, BatchPolicy(8, 0.0, 16), body)
    assert engine.batch_sizes == [8]


def test_a_connected_client_gets_its_answer() -> None:
    engine = OrderEngine()
    x = rows(3, 0)

    async def body(batcher):
        return await submit_while_connected(
            _LeavingClient(), batcher, TINY, ForwardInputs(x), RequestOptions()
        )

    result = run(engine, BatchPolicy(8, 0.0, 16), body)
    torch.testing.assert_close(result.output, reference_forward(TINY, x))


@pytest.mark.parametrize(
    ("priority", "timeout_s", "message"),
    [(-1, None, "priority must be >= 0"), (0, 0.0, "timeout must be positive")],
)
def test_request_options_refuse_negative_values(priority, timeout_s, message) -> None:
    with pytest.raises(ValueError, match=message):
        RequestOptions(priority, timeout_s)
