"""A lone request's batch on an engine that enqueues (the GPU pipeline) is waited for by the
event loop itself, which polls at each turn instead of sleeping, and answered there; a batch
launched behind it hands it to the device's completer thread, which answers both in order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
import torch

from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service import off_loop
from moe_serve.service.engine.batcher import BatchPolicy, DynamicBatcher
from moe_serve.service.errors import ForwardFailed
from moe_serve.service.metrics import Metrics
from tests.service.layers import NO_ROUTER, TINY, E, H, reference_forward
from tests.service.test_awake import LoopTimeouts
from tests.service.test_devices import _HeldPerLayer
from tests.service.test_output_into import WAIT_S, EnqueuingEngine, _run

COMPLETER = "moe-complete-cpu"


def _rows(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))


def test_a_lone_requests_batch_is_answered_on_the_event_loops_own_thread() -> None:
    engine = EnqueuingEngine()
    x = _rows(5, seed=1)

    async def body(batcher: DynamicBatcher):
        return threading.current_thread().name, await batcher.submit(TINY, ForwardInputs(x))

    loop_thread, out = _run(engine, body)
    torch.testing.assert_close(out.output, reference_forward(TINY, x))
    assert engine.answered_on == [(loop_thread, 5)]


def test_a_batch_launched_behind_a_lone_one_takes_it_to_the_completer_in_launch_order() -> None:
    engine = EnqueuingEngine()
    engine.gate.clear()  # both batches stay "on the device"
    first, second = _rows(2, seed=2), _rows(3, seed=3)

    async def body(batcher: DynamicBatcher):
        lone = asyncio.create_task(batcher.submit(TINY, ForwardInputs(first)))
        await asyncio.to_thread(engine.launched.wait, WAIT_S)
        behind = asyncio.create_task(batcher.submit(TINY, ForwardInputs(second)))
        while engine.starts < 2:  # the scheduler launches it beside the lone one
            await asyncio.sleep(0.001)
        engine.gate.set()
        return await lone, await behind

    lone, behind = _run(engine, body)
    torch.testing.assert_close(lone.output, reference_forward(TINY, first))
    torch.testing.assert_close(behind.output, reference_forward(TINY, second))
    assert engine.answered_on == [(COMPLETER, 2), (COMPLETER, 3)]


def test_a_lone_batch_goes_to_its_completer_once_host_work_runs_on_a_thread() -> None:
    """A thread working for another request (a JSON body parsed off the loop) would wait for the
    GIL that the polling loop holds: the loop stops polling and the completer answers."""
    engine = EnqueuingEngine()
    engine.gate.clear()
    x = _rows(4, seed=9)
    working = threading.Event()

    def host_work() -> None:
        working.set()
        engine.gate.wait(WAIT_S)  # until the batch is done

    async def body(batcher: DynamicBatcher):
        lone = asyncio.create_task(batcher.submit(TINY, ForwardInputs(x)))
        await asyncio.to_thread(engine.launched.wait, WAIT_S)
        other = asyncio.create_task(off_loop.JSON.off_loop(host_work))
        await asyncio.to_thread(working.wait, WAIT_S)
        await asyncio.sleep(0.01)  # turns of the loop: the poll sees the work
        engine.gate.set()
        await other
        return await lone

    out = _run(engine, body)
    torch.testing.assert_close(out.output, reference_forward(TINY, x))
    assert engine.answered_on == [(COMPLETER, 4)]


def test_a_lone_request_on_a_device_while_another_has_a_batch_goes_to_its_completer() -> None:
    """The loop polls only where nothing else is in flight: a batch on another device hands the
    one it polled to that device's completer, and goes to its own."""
    engine = _HeldPerLayer()  # TINY on cpu:0, NO_ROUTER on cpu:1
    engine.held[NO_ROUTER].set()
    x, logits = _rows(3, seed=6), torch.randn(3, E, generator=torch.Generator().manual_seed(7))

    async def body(batcher: DynamicBatcher):
        held = asyncio.create_task(batcher.submit(TINY, ForwardInputs(x)))
        await asyncio.to_thread(engine.launched.wait, WAIT_S)
        other = await batcher.submit(NO_ROUTER, ForwardInputs(x, logits))
        engine.held[TINY].set()
        return await held, other

    held, other = _run(engine, body)
    torch.testing.assert_close(held.output, reference_forward(TINY, x))
    torch.testing.assert_close(other.output, reference_forward(NO_ROUTER, x, logits))
    assert engine.answered_on == [("moe-complete-cpu:1", 3), ("moe-complete-cpu:0", 3)]


def test_the_loop_polls_while_a_lone_batch_is_on_the_device_and_sleeps_after_it_is_answered() -> (
    None
):
    engine = EnqueuingEngine()
    engine.gate.clear()
    selector = LoopTimeouts()

    async def main() -> tuple[list, list]:
        batcher = DynamicBatcher(engine, BatchPolicy(64, 0.0, 64), Metrics())
        batcher.start()
        try:
            work = asyncio.create_task(batcher.submit(TINY, ForwardInputs(_rows(4, seed=4))))
            await asyncio.to_thread(engine.launched.wait, WAIT_S)
            selector.timeouts.clear()
            await asyncio.to_thread(threading.Event().wait, 0.01)  # nothing else to do
            while_on_device = list(selector.timeouts)
            engine.gate.set()
            await work
            while batcher._awake.awake:  # it lingers a moment (service/awake.py)
                await asyncio.sleep(0.001)
            selector.timeouts.clear()
            await asyncio.to_thread(threading.Event().wait, 0.01)
            return while_on_device, list(selector.timeouts)
        finally:
            engine.gate.set()
            await batcher.close()

    loop = asyncio.SelectorEventLoop(selector)
    try:
        while_on_device, after = loop.run_until_complete(asyncio.wait_for(main(), WAIT_S))
    finally:
        loop.close()
    assert while_on_device and all(timeout == 0 for timeout in while_on_device)
    assert any(timeout is None or timeout > 0 for timeout in after)


class _FaultyEngine(EnqueuingEngine):
    """Its device fails under the batch: asking whether it is done raises, as its result does."""

    def start(
        self,
        name: str,
        parts: Sequence[ForwardInputs],
        into: Sequence[torch.Tensor | None] | None = None,
    ):
        super().start(name, parts, into)

        class Failed:
            def done(self) -> bool:
                raise RuntimeError("device fault")

            def result(self):
                raise RuntimeError("device fault")

        return Failed()


def test_a_lone_batch_whose_device_fails_fails_its_request() -> None:
    engine = _FaultyEngine()

    async def body(batcher: DynamicBatcher):
        with pytest.raises(ForwardFailed, match="device fault"):
            await batcher.submit(TINY, ForwardInputs(_rows(3, seed=5)))
        return True

    assert _run(engine, body)
