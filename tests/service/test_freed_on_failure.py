"""What a failed request held (its body, its message, its tensors) is freed as the request fails,
not once the garbage collector finds it: a serving process collects rarely
(service/interpreter.py), so memory held by a cycle through an error's traceback piles up with
every large request that fails. The collector is off in these tests, so a cycle shows."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tracemalloc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.engine.batcher import DynamicBatcher
from moe_serve.service.errors import BadInput
from moe_serve.service.off_loop import BINARY
from tests.service.layers import TINY, H, tiny_layers
from tests.service.test_batcher import RecordingEngine
from tests.service.test_grpc_limits import serving
from tests.service.test_output_into import _run

grpcclient = pytest.importorskip("tritonclient.grpc")
InferenceServerException = pytest.importorskip("tritonclient.utils").InferenceServerException


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_an_error_raised_off_the_loop_does_not_keep_what_it_worked_on() -> None:
    def refuse(rows: np.ndarray) -> None:
        raise BadInput(f"{rows.shape} refused")

    async def main() -> weakref.ref:
        rows = np.zeros((4, 4))
        kept = weakref.ref(rows)
        with pytest.raises(BadInput):
            await BINARY.off_loop(refuse, rows)
        del rows
        return kept

    with collector_off():
        assert asyncio.run(main())() is None


def test_a_request_refused_with_its_batch_does_not_keep_its_inputs() -> None:
    async def body(batcher: DynamicBatcher) -> weakref.ref:
        x = torch.zeros(3, H)
        x[2, 1] = float("nan")  # found with the batch's values
        kept = weakref.ref(x)
        with pytest.raises(BadInput, match="NaN or Inf"):
            await batcher.submit(TINY, ForwardInputs(x))
        del x
        return kept

    with collector_off():
        assert _run(RecordingEngine(tiny_layers()), body)() is None


def test_the_messages_of_grpc_calls_are_freed_as_they_end_failed_or_answered() -> None:
    rows = (4 << 20) // (4 * H)  # a 4 MiB message
    good = np.zeros((rows, H), np.float32)
    tensor = grpcclient.InferInput("hidden_states", [rows, H], "FP32")
    tensor.set_data_from_numpy(good)
    short = grpcclient.InferInput("hidden_states", [rows, H], "FP32")
    short.set_data_from_numpy(good)
    short._input.shape[:] = [rows + 1, H]  # one row more than its bytes hold
    with serving() as s, collector_off():
        client = grpcclient.InferenceServerClient(s.grpc)
        client.infer(TINY, [tensor])  # what the first call allocates for good
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(4):
                client.infer(TINY, [tensor])
                with pytest.raises(InferenceServerException, match="binary bytes for shape"):
                    client.infer(TINY, [short])
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            client.close()
    assert held < 2 * good.nbytes  # eight calls of a message each
