"""Outputs copied straight into the caller's buffer (`DynamicBatcher.submit(..., output_into)`,
as the engine does for bodies in a front end's arena on a GPU), on an engine that enqueues its
batches as the GPU pipeline does: the output is the buffer itself, split requests fill it piece
by piece, and a withdrawn request returns only once its batch is done with the buffer (the
front end then reuses it)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence

import pytest
import torch

from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.core.forward import submit_unless_withdrawn
from moe_serve.service.engine.batcher import BatchPolicy, DynamicBatcher, RequestOptions
from moe_serve.service.engine.engine import Engine
from moe_serve.service.engine.interface import BatchResult
from moe_serve.service.errors import ClientDisconnected, ForwardFailed
from tests.service.layers import CPU, TINY, H, reference_forward, tiny_layers
from tests.service.test_batcher import RecordingEngine, run

WAIT_S = 10.0


class EnqueuingEngine(Engine):
    """A CPU engine that answers as the GPU pipeline does: `start` returns at once, the batch
    completes when `result()` is called on the completer thread (held by `gate`), and a part
    with an `into` tensor gets its output written there."""

    def __init__(self, devices: Sequence[torch.device] = (CPU,)) -> None:
        super().__init__(devices)  # the tiny layers in turn on each
        for i, layer in enumerate(tiny_layers()):
            self.add(dataclasses.replace(layer, device=devices[i % len(devices)]))
        self.gate = threading.Event()
        self.gate.set()
        self.launched = threading.Event()
        self.writes: list[str] = []  # in order: "wrote" when a batch filled its targets
        self.answered_on: list[str] = []  # the thread that took each batch's result
        self.fault: Exception | None = None  # what a batch's result raises

    @property
    def enqueues(self) -> bool:
        return True

    def start(
        self,
        name: str,
        parts: Sequence[ForwardInputs],
        into: Sequence[torch.Tensor | None] | None = None,
    ):
        into = list(into or [None] * len(parts))
        self.launched.set()
        engine = self

        class Later:
            def result(self) -> BatchResult:
                assert engine.gate.wait(WAIT_S), "test gate never opened"
                engine.answered_on.append(threading.current_thread().name)
                if engine.fault is not None:
                    raise engine.fault
                done = engine._run_now(engine.get(name), parts).result()
                outputs = []
                for out, target in zip(done.outputs, into, strict=True):
                    if target is not None:
                        target.copy_(out.output)
                        out = type(out)(target, out.routing)
                    outputs.append(out)
                engine.writes.append("wrote")
                return BatchResult(outputs, done.expert_tokens, done.times, True, True)

        return Later()


class PollableEngine(EnqueuingEngine):
    """The same, with batches that say whether they are done (the gate is open), as the GPU
    pipeline's do: the batcher's loop watches one that runs alone."""

    def start(self, name, parts, into=None):
        later, gate = super().start(name, parts, into), self.gate

        class Polled:
            def done(self) -> bool:
                return gate.is_set()

            def result(self) -> BatchResult:
                return later.result()

        return Polled()


def _run(engine: Engine, body, max_batch_tokens: int = 64):
    return run(engine, BatchPolicy(max_batch_tokens, 0.0, 64), body)


def _rows(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("max_batch_tokens", [64, 3])  # whole, and in pieces of 3 rows
def test_the_output_is_the_callers_buffer_filled_with_the_layers_output(
    max_batch_tokens: int,
) -> None:
    engine = EnqueuingEngine()
    x = _rows(7, seed=1)
    buffer = torch.full((7, H), float("nan"))

    async def body(batcher: DynamicBatcher):
        return await batcher.submit(TINY, ForwardInputs(x), RequestOptions(), buffer)

    out = _run(engine, body, max_batch_tokens)
    assert out.output.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer, reference_forward(TINY, x))
    assert out.routing.topk_ids.shape == (7, 2)


@pytest.mark.parametrize("engine_type", [EnqueuingEngine, PollableEngine])
@pytest.mark.parametrize("how", ["gone", "withdrawn", "cancelled"])
def test_a_withdrawn_request_returns_only_once_its_batch_is_done_with_the_buffer(
    how: str, engine_type: type[EnqueuingEngine]
) -> None:
    """The client leaves while its rows are on the device: a route's watch of its client ends,
    or the front ends' channel completes `withdrawn` (submit_unless_withdrawn, in the caller's
    own task); both raise ClientDisconnected, and a caller cancelled from elsewhere stays
    cancelled, all only once the device is done with the buffer (whether the completer thread
    or the loop watches the batch)."""
    engine = engine_type()
    engine.gate.clear()  # the batch stays "on the device"
    x = _rows(4, seed=2)
    buffer = torch.zeros(4, H)
    order: list[str] = []

    async def body(batcher: DynamicBatcher):
        gone = asyncio.Event()
        watch = asyncio.ensure_future(gone.wait())  # as an HTTP route watches its client
        withdrawn = asyncio.get_running_loop().create_future()
        inputs, options = ForwardInputs(x), RequestOptions()
        ends = watch if how == "gone" else withdrawn
        work = asyncio.create_task(
            submit_unless_withdrawn(batcher, TINY, inputs, options, ends, buffer)
        )
        await asyncio.to_thread(engine.launched.wait, WAIT_S)
        if how == "gone":
            gone.set()  # the client leaves while its rows are on the device
        elif how == "withdrawn":
            withdrawn.set_result(None)  # likewise, told by the front end's CANCEL record
        else:
            work.cancel()  # the caller itself is cancelled (a shutdown)
        await asyncio.sleep(0.05)
        assert not work.done(), "returned while the device still writes the buffer"
        engine.gate.set()
        raised = asyncio.CancelledError if how == "cancelled" else ClientDisconnected
        with pytest.raises(raised):
            await work
        order.append("returned")
        watch.cancel()

    _run(engine, body)
    assert engine.writes + order == ["wrote", "returned"]


def test_submit_unless_withdrawn_after_its_rows_finished_keeps_the_result() -> None:
    engine = EnqueuingEngine()
    x = _rows(3, seed=4)
    buffer = torch.zeros(3, H)

    async def body(batcher: DynamicBatcher):
        withdrawn = asyncio.get_running_loop().create_future()
        out = await submit_unless_withdrawn(
            batcher, TINY, ForwardInputs(x), RequestOptions(), withdrawn, buffer
        )
        withdrawn.set_result(None)  # too late: nothing is cancelled
        await asyncio.sleep(0.01)
        return out

    out = _run(engine, body)
    torch.testing.assert_close(out.output, reference_forward(TINY, x))


def test_an_engine_that_runs_batches_itself_copies_each_piece_into_the_buffer() -> None:
    """On the CPU engine the batcher writes each piece's rows into `output_into`, cast to its
    dtype (a client's region may hold another dtype than the layer's)."""
    engine = RecordingEngine(tiny_layers())
    x = _rows(7, seed=3)
    buffer = torch.zeros(7, H, dtype=torch.float64)

    async def body(batcher: DynamicBatcher):
        return await batcher.submit(TINY, ForwardInputs(x), RequestOptions(), buffer)

    out = _run(engine, body, max_batch_tokens=3)
    assert engine.batch_sizes == [3, 3, 1]
    assert out.output.data_ptr() == buffer.data_ptr()
    expected = reference_forward(TINY, x).double()
    torch.testing.assert_close(buffer, expected, rtol=1e-5, atol=1e-5)


def test_a_batch_alone_on_its_device_is_answered_by_the_loop_that_watches_it() -> None:
    engine = PollableEngine()
    x = _rows(5, seed=5)

    async def body(batcher: DynamicBatcher):
        return await batcher.submit(TINY, ForwardInputs(x))

    out = _run(engine, body)
    torch.testing.assert_close(out.output, reference_forward(TINY, x))
    assert engine.answered_on == [threading.current_thread().name]  # asyncio.run's thread


def test_while_the_loop_watches_a_batch_it_serves_others_and_the_completer_takes_theirs() -> None:
    """The first request's batch runs alone (the loop watches it); a second arrives while it is
    on the device, so its batch is not alone and goes to the completer thread."""
    engine = PollableEngine()
    engine.gate.clear()
    first, second = _rows(3, seed=6), _rows(2, seed=7)

    async def body(batcher: DynamicBatcher):
        a = asyncio.create_task(batcher.submit(TINY, ForwardInputs(first)))
        await asyncio.to_thread(engine.launched.wait, WAIT_S)  # served while the loop polls
        engine.launched.clear()
        b = asyncio.create_task(batcher.submit(TINY, ForwardInputs(second)))
        await asyncio.to_thread(engine.launched.wait, WAIT_S)
        engine.gate.set()
        return await asyncio.gather(a, b)

    a, b = _run(engine, body)
    torch.testing.assert_close(a.output, reference_forward(TINY, first))
    torch.testing.assert_close(b.output, reference_forward(TINY, second))
    loop_thread = threading.current_thread().name
    assert sorted(engine.answered_on) == sorted([loop_thread, f"moe-complete-{CPU}"])


def test_a_watched_batch_that_fails_fails_its_requests() -> None:
    engine = PollableEngine()
    engine.fault = RuntimeError("device fault")

    async def body(batcher: DynamicBatcher):
        with pytest.raises(ForwardFailed, match="device fault"):
            await batcher.submit(TINY, ForwardInputs(_rows(2, seed=8)))
        engine.fault = None  # the next one is served
        return await batcher.submit(TINY, ForwardInputs(_rows(2, seed=9)))

    out = _run(engine, body)
    torch.testing.assert_close(out.output, reference_forward(TINY, _rows(2, seed=9)))
