"""DynamicBatcher on a real CPU engine: merging, chunking, back-pressure, failure isolation,
draining. Each test drives its own event loop with asyncio.run."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.layer import LayerWeights, RouterWeights
from moe_serve.kernels.quant_scheme import QuantConfig
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.engine.batcher import BatchPolicy, DynamicBatcher
from moe_serve.service.engine.engine import Engine
from moe_serve.service.errors import BadInput, ForwardFailed, NonFiniteOutput, NotReady, Overloaded
from moe_serve.service.metrics import Metrics
from tests.service.layers import TINY, E, H, TinyLayer, reference_forward, tiny_layers

WAIT_S = 10.0  # bound on every wait in these tests


class RecordingEngine(Engine):
    """An Engine that records each batch's size and can hold or fail a forward."""

    def __init__(self, layers: list[TinyLayer]) -> None:
        super().__init__([torch.device("cpu")])
        for layer in layers:
            self.add(layer)
        self.batch_sizes: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a forward has begun (and may wait at the gate)
        self.fail_next = False

    def forward(self, name: str, inputs: ForwardInputs):
        self.entered.set()
        assert self.gate.wait(WAIT_S), "test gate never opened"
        self.batch_sizes.append(inputs.hidden_states.shape[0])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device fault")
        return super().forward(name, inputs)


def rows(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))


def run(engine: Engine, policy: BatchPolicy, body) -> object:
    async def main():
        batcher = DynamicBatcher(engine, policy, Metrics())
        batcher.start()
        try:
            return await asyncio.wait_for(body(batcher), WAIT_S)
        finally:
            engine.gate.set()
            await batcher.close()

    return asyncio.run(main())


def test_concurrent_requests_merge_and_each_gets_its_own_rows() -> None:
    engine = RecordingEngine(tiny_layers())
    inputs = [rows(t, seed) for seed, t in enumerate([1, 3, 2, 5, 1, 4])]

    async def body(batcher):
        return await asyncio.gather(*(batcher.submit(TINY, ForwardInputs(x)) for x in inputs))

    results = run(engine, BatchPolicy(64, 0.05, 16), body)
    assert engine.batch_sizes == [16]  # one forward for all six
    for x, result in zip(inputs, results, strict=True):
        torch.testing.assert_close(result.output, reference_forward(TINY, x))
        assert result.routing.topk_ids.shape == (x.shape[0], 2)


def test_batches_stop_at_the_token_budget() -> None:
    engine = RecordingEngine(tiny_layers())
    inputs = [rows(4, seed) for seed in range(5)]

    async def body(batcher):
        return await asyncio.gather(*(batcher.submit(TINY, ForwardInputs(x)) for x in inputs))

    results = run(engine, BatchPolicy(8, 0.05, 16), body)
    assert engine.batch_sizes == [8, 8, 4]
    for x, result in zip(inputs, results, strict=True):
        torch.testing.assert_close(result.output, reference_forward(TINY, x))


def test_large_request_is_chunked_and_reassembled_in_order() -> None:
    engine = RecordingEngine(tiny_layers())
    x = rows(21, 0)
    result = run(engine, BatchPolicy(8, 0.0, 4), lambda b: b.submit(TINY, ForwardInputs(x)))
    assert engine.batch_sizes == [8, 8, 5]
    torch.testing.assert_close(result.output, reference_forward(TINY, x))


def test_requests_with_and_without_logits_go_in_separate_batches() -> None:
    engine = RecordingEngine(tiny_layers())
    x1, x2, logits = rows(2, 0), rows(3, 1), torch.randn(3, E)

    async def body(batcher):
        return await asyncio.gather(
            batcher.submit(TINY, ForwardInputs(x1)), batcher.submit(TINY, ForwardInputs(x2, logits))
        )

    first, second = run(engine, BatchPolicy(64, 0.05, 16), body)
    assert sorted(engine.batch_sizes) == [2, 3]
    torch.testing.assert_close(first.output, reference_forward(TINY, x1))
    torch.testing.assert_close(second.output, reference_forward(TINY, x2, logits))


def test_full_queue_raises_overloaded_and_drops_nothing() -> None:
    engine = RecordingEngine(tiny_layers())
    engine.gate.clear()  # the device is busy
    inputs = [rows(2, 0), rows(2, 1)]

    async def body(batcher):
        admitted = [asyncio.create_task(batcher.submit(TINY, ForwardInputs(x))) for x in inputs]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded, match="already has 2 requests queued") as err:
            await batcher.submit(TINY, ForwardInputs(rows(1, 2)))
        assert err.value.headers == {"Retry-After": "1"}
        engine.gate.set()
        return await asyncio.gather(*admitted)

    results = run(engine, BatchPolicy(64, 0.0, 2), body)
    for x, result in zip(inputs, results, strict=True):
        torch.testing.assert_close(result.output, reference_forward(TINY, x))


def test_the_batcher_is_idle_only_while_no_request_is_admitted() -> None:
    """`idle` tells a request outside `submit` that it is the server's only one (it then keeps
    its shared-memory copies on the loop): not while another waits or runs."""
    engine = RecordingEngine(tiny_layers())
    engine.gate.clear()  # the device is busy

    async def body(batcher):
        assert batcher.idle
        running = asyncio.create_task(batcher.submit(TINY, ForwardInputs(rows(2, 0))))
        await asyncio.to_thread(engine.entered.wait, WAIT_S)
        queued = asyncio.create_task(batcher.submit(TINY, ForwardInputs(rows(1, 1))))
        await asyncio.sleep(0)
        busy = batcher.idle
        engine.gate.set()
        await asyncio.gather(running, queued)
        return busy, batcher.idle

    assert run(engine, BatchPolicy(64, 0.0, 16), body) == (False, True)


def test_a_cancelled_request_leaves_the_batcher_idle() -> None:
    engine = RecordingEngine(tiny_layers())
    engine.gate.clear()

    async def body(batcher):
        admitted = asyncio.create_task(batcher.submit(TINY, ForwardInputs(rows(2, 0))))
        await asyncio.to_thread(engine.entered.wait, WAIT_S)
        queued = asyncio.create_task(batcher.submit(TINY, ForwardInputs(rows(1, 1))))
        await asyncio.sleep(0)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        engine.gate.set()
        await admitted
        return batcher.idle

    assert run(engine, BatchPolicy(64, 0.0, 16), body) is True


def test_failing_forward_fails_only_its_batch() -> None:
    engine = RecordingEngine(tiny_layers())
    engine.fail_next = True

    async def body(batcher):
        failed = await asyncio.gather(
            batcher.submit(TINY, ForwardInputs(rows(1, 0))),
            batcher.submit(TINY, ForwardInputs(rows(2, 1))),
            return_exceptions=True,
        )
        later = await batcher.submit(TINY, ForwardInputs(rows(3, 2)))
        return failed, later

    failed, later = run(engine, BatchPolicy(64, 0.05, 16), body)
    assert all(isinstance(f, ForwardFailed) and "device fault" in str(f) for f in failed)
    torch.testing.assert_close(later.output, reference_forward(TINY, rows(3, 2)))


def test_fp8_tensor_layer_runs_each_request_alone() -> None:
    """One activation scale per forward: merging would change other requests' numbers."""
    cfg = MoEConfig(E, H, 128, RoutingConfig(top_k=2), quant=QuantConfig("fp8-tensor"))
    router = RouterWeights(torch.randn(E, H))
    engine = RecordingEngine(
        [TinyLayer("fp8", cfg, LayerWeights(random_expert_weights(cfg), router))]
    )

    async def body(batcher):
        return await asyncio.gather(
            *(batcher.submit("fp8", ForwardInputs(rows(2, s))) for s in range(3))
        )

    run(engine, BatchPolicy(64, 0.05, 16), body)
    assert engine.batch_sizes == [2, 2, 2]


def test_close_drains_queued_requests_then_refuses_new_ones() -> None:
    engine = RecordingEngine(tiny_layers())
    x = rows(2, 0)

    async def main():
        batcher = DynamicBatcher(engine, BatchPolicy(64, 5.0, 16), Metrics())  # long wait
        batcher.start()
        pending = asyncio.create_task(batcher.submit(TINY, ForwardInputs(x)))
        await asyncio.sleep(0.01)
        await asyncio.wait_for(batcher.close(), WAIT_S)  # must not wait out the 5 s delay
        with pytest.raises(NotReady, match="shutting down"):
            await batcher.submit(TINY, ForwardInputs(x))
        return await pending

    result = asyncio.run(main())
    torch.testing.assert_close(result.output, reference_forward(TINY, x))


def submit_together(
    engine: Engine, policy: BatchPolicy, metrics: Metrics, *hidden: torch.Tensor
) -> list[object]:
    """Each of `hidden` submitted at once to layer TINY; its output or what it raised."""

    async def main():
        batcher = DynamicBatcher(engine, policy, metrics)
        batcher.start()
        try:
            submits = [batcher.submit(TINY, ForwardInputs(h)) for h in hidden]
            return await asyncio.wait_for(asyncio.gather(*submits, return_exceptions=True), WAIT_S)
        finally:
            await batcher.close()

    return asyncio.run(main())


def test_rows_whose_output_overflows_fail_only_their_request_and_are_counted() -> None:
    engine = RecordingEngine(tiny_layers())
    metrics = Metrics()
    overflowing = rows(3, 0)
    overflowing[2, 5] = 1e30  # finite, but the experts' products overflow float32
    fine = rows(2, 1)

    bad, good = submit_together(engine, BatchPolicy(64, 0.05, 16), metrics, overflowing, fine)
    assert engine.batch_sizes == [5]  # one forward for both
    assert isinstance(bad, NonFiniteOutput)
    assert bad.status == 422
    assert bad.message == (
        "the output of layer 'tiny' holds NaN or Inf at row 2 of this request: inputs this large "
        "overflow the layer's arithmetic"
    )
    torch.testing.assert_close(good.output, reference_forward(TINY, fine))
    assert metrics.nonfinite_forwards.labels(TINY)._value.get() == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "hidden_states holds NaN or Inf (first at row 3, column 5)"),
        (float("-inf"), "hidden_states holds NaN or Inf (first at row 3, column 5)"),
    ],
)
def test_a_request_with_a_nonfinite_value_gets_its_400_and_its_batch_is_served(
    value: float, message: str
) -> None:
    """Values are checked with the batch (its flag), not before it: the request at fault is
    refused naming its value, whichever chunk holds it, and its batch-mates are answered."""
    engine = RecordingEngine(tiny_layers())
    metrics = Metrics()
    bad_rows = rows(6, 0)
    bad_rows[3, 5] = value
    fine = rows(2, 1)

    good, bad = submit_together(engine, BatchPolicy(4, 0.05, 16), metrics, fine, bad_rows)
    assert isinstance(bad, BadInput)
    assert (bad.status, bad.message) == (400, message)
    torch.testing.assert_close(good.output, reference_forward(TINY, fine))
    assert metrics.nonfinite_forwards.labels(TINY)._value.get() == 0  # the input's fault


def test_a_chunked_request_names_its_own_row() -> None:
    engine = RecordingEngine(tiny_layers())
    x = rows(10, 2)
    x[7, 0] = -1e30

    async def body(batcher):
        return await batcher.submit(TINY, ForwardInputs(x))

    with pytest.raises(NonFiniteOutput, match="at row 7 of this request"):
        run(engine, BatchPolicy(4, 0.0, 16), body)  # chunks of 4: row 3 of the second one


def test_a_cpu_engine_answers_each_batch_from_the_launcher_thread() -> None:
    """A synchronous engine's batch runs to its end on the launcher thread, which answers it:
    no completer thread is started (its hop only waits for a device)."""
    engine = RecordingEngine(tiny_layers())
    forwards_on: list[str] = []
    forward = engine.forward

    def recording_forward(name: str, inputs: ForwardInputs):
        forwards_on.append(threading.current_thread().name)
        return forward(name, inputs)

    engine.forward = recording_forward
    x = rows(3, 0)

    async def body(batcher):
        result = await batcher.submit(TINY, ForwardInputs(x))
        return result, [t.name for t in threading.enumerate()]

    result, threads = run(engine, BatchPolicy(64, 0.0, 16), body)
    torch.testing.assert_close(result.output, reference_forward(TINY, x))
    assert len(forwards_on) == 1 and forwards_on[0].startswith("moe-device")
    assert not any(name.startswith("moe-complete") for name in threads)


def test_a_cpu_engine_that_cannot_start_fails_its_batch_and_serves_on() -> None:
    """Engine.start raising on the launcher thread (here: the engine has failed) fails the
    batch's requests with its error, and the batcher takes the next batch."""
    engine = RecordingEngine(tiny_layers())

    async def body(batcher):
        engine.failure = "the device failed"
        with pytest.raises(NotReady, match="the device failed"):
            await batcher.submit(TINY, ForwardInputs(rows(2, 0)))
        engine.failure = None
        return await batcher.submit(TINY, ForwardInputs(rows(3, 1)))

    later = run(engine, BatchPolicy(64, 0.0, 16), body)
    torch.testing.assert_close(later.output, reference_forward(TINY, rows(3, 1)))
