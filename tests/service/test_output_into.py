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
from moe_serve.service.errors import ClientDisconnected
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
        self.answered_on: list[tuple[str, int]] = []  # (thread, rows) of each batch answered
        self.starts = 0

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
        self.starts += 1
        self.launched.set()
        engine = self

        class Later:
            def done(self) -> bool:
                return engine.gate.is_set()

            def result(self) -> BatchResult:
                assert engine.gate.wait(WAIT_S), "test gate never opened"
                done = engine._run_now(engine.get(name), parts).result()
                outputs = []
                for out, target in zip(done.outputs, into, strict=True):
                    if target is not None:
                        target.copy_(out.output)
                        out = type(out)(target, out.routing)
                    outputs.append(out)
                engine.writes.append("wrote")
                rows = sum(p.hidden_states.shape[0] for p in parts)
                engine.answered_on.append((threading.current_thread().name, rows))
                return BatchResult(outputs, done.expert_tokens, done.times, True, True)

        return Later()


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


@pytest.mark.parametrize("how", ["gone", "withdrawn", "cancelled"])
def test_a_withdrawn_request_returns_only_once_its_batch_is_done_with_the_buffer(how: str) -> None:
    """The client leaves while its rows are on the device: a route's watch of its client ends,
    or the front ends' channel completes `withdrawn` (submit_unless_withdrawn, in the caller's
    own task); both raise ClientDisconnected, and a caller cancelled from elsewhere stays
    cancelled, all only once the device is done with the buffer."""
    engine = EnqueuingEngine()
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
