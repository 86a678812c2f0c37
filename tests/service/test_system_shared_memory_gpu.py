"""System shared memory on a GPU: inputs are read from the region into pinned copy memory, copied
to the device from there and cast on it; the output is cast on the device and copied into pinned
copy memory, then written into the region. Over HTTP and gRPC, in FP32 and FP16, on a bfloat16
and a float16 layer: the output in the region matches the reference and equals the binary
request's; a region shrunk mid-request is a 400, not a crash; a non-finite input, or one beyond
the layer's dtype, is a 400 naming its value."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI

from moe_serve.kernels.accuracy import BY_DTYPE, relative_error
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.engine import pipeline
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.service.triton.shared_memory import SystemRegion
from tests.service.conftest import wait_ready
from tests.service.layers import TinyLayer, free_port, layers_of_dtypes, running_server

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
shm = pytest.importorskip("tritonclient.utils.shared_memory")

pytestmark = pytest.mark.gpu

E, H, INTER = 8, 1024, 256  # experts, hidden, intermediate; top-2 (tests/service/layers.py)
LAYERS = {"bf16": torch.bfloat16, "f16": torch.float16}
MAX_BATCH = 256  # a 300-row request runs in two pieces, its second staged on the host
DIRECT_ROWS = 192  # FP32 and FP16 rows over pipeline.DIRECT_BYTES: copied from where they lie
GPU_READY_TIMEOUT_S = 300.0
WIRE = {"FP32": np.float32, "FP16": np.float16}


def _layers(device: torch.device) -> list[TinyLayer]:
    return layers_of_dtypes(LAYERS, device, (E, H, INTER))


def _reference(name: str, x: np.ndarray) -> torch.Tensor:
    layer = next(t for t in _layers(torch.device("cpu")) if t.name == name)
    model, _ = build_layer(layer.config, layer.weights, torch.device("cpu"), "reference")
    hidden = torch.from_numpy(x.astype(np.float32)).to(layer.config.dtype)
    return model.forward(ForwardInputs(hidden)).output


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FastAPI, str, str]]:
    port = free_port()
    settings = Settings(
        device="cuda", grpc_port=port, allow_shared_memory=True, max_batch_tokens=MAX_BATCH
    )
    app = create_app(settings, lambda _settings, devices: _layers(devices[0]))
    with running_server(app) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get, GPU_READY_TIMEOUT_S)
        yield app, url.removeprefix("http://"), f"127.0.0.1:{port}"


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    _, http, grpc = server
    if request.param == "http":
        c, module = httpclient.InferenceServerClient(http), httpclient
    else:
        c, module = grpcclient.InferenceServerClient(grpc), grpcclient
    yield c, module
    c.unregister_system_shared_memory()
    c.close()


@pytest.fixture
def region() -> Iterator[tuple[str, object, int]]:
    """An object of two tensors of up to 300 FP32 rows: input at 0, output after it."""
    key = f"/moe-serve-test-{uuid.uuid4().hex[:12]}"
    size = 300 * H * 4
    handle = shm.create_shared_memory_region("data", key, 2 * size)
    yield key, handle, size
    shm.destroy_shared_memory_region(handle)


def _infer(c, module, name: str, x: np.ndarray, datatype: str, size: int):
    tensor = module.InferInput("hidden_states", list(x.shape), datatype)
    tensor.set_shared_memory("data", x.nbytes)
    out = module.InferRequestedOutput("output")
    out.set_shared_memory("data", x.nbytes, offset=size)
    return c.infer(name, [tensor], outputs=[out])


def _binary(c, module, name: str, x: np.ndarray, datatype: str) -> np.ndarray:
    tensor = module.InferInput("hidden_states", list(x.shape), datatype)
    tensor.set_data_from_numpy(x, **({"binary_data": True} if module is httpclient else {}))
    return c.infer(name, [tensor]).as_numpy("output")


@pytest.mark.parametrize("rows", [3, DIRECT_ROWS, 300], ids=lambda r: f"M={r}")
@pytest.mark.parametrize("datatype", list(WIRE))
@pytest.mark.parametrize("layer", list(LAYERS))
def test_the_output_in_the_region_matches_the_reference_and_the_binary_reply(
    server, client, region, layer: str, datatype: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small rows are staged on the host, large ones copied from the pinned copy memory and
    cast on the device (nothing of a DIRECT_ROWS request is staged); 300 rows run in two
    pieces, one of each. The bytes past the output in the region stay as they were."""
    app, _, _ = server
    c, module = client
    key, handle, size = region
    staged = []
    gather = pipeline._gather
    monkeypatch.setattr(
        pipeline, "_gather", lambda rows, into: staged.append(1) or gather(rows, into)
    )
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, H)).astype(WIRE[datatype])
    shm.set_shared_memory_region(handle, [x])
    shm.set_shared_memory_region(handle, [np.full(size, 7, np.uint8)], offset=size)
    c.register_system_shared_memory("data", key, 2 * size)
    result = _infer(c, module, layer, x, datatype, size)
    listed = result.get_output("output")
    out = shm.get_contents_as_numpy(handle, WIRE[datatype], [rows, H], offset=size)
    if rows == DIRECT_ROWS:
        assert not staged  # neither hidden states nor anything else went through the slot
    assert out.dtype == x.dtype and np.isfinite(out).all()
    tolerance = max(BY_DTYPE[LAYERS[layer]], BY_DTYPE[torch.from_numpy(x[:1]).dtype])
    expected = _reference(layer, x)
    assert relative_error(torch.from_numpy(out.astype(np.float32)), expected) < tolerance
    assert np.array_equal(out, _binary(c, module, layer, x, datatype))  # the same forward
    tail = shm.get_contents_as_numpy(handle, np.uint8, [size - x.nbytes], offset=size + x.nbytes)
    assert (tail == 7).all()
    if module is httpclient:
        assert listed["parameters"]["shared_memory_byte_size"] == x.nbytes
    memory = app.state.runtime.shared_memory
    assert memory.copied_bytes == 0
    loan = memory.copy_memory.lend(x.nbytes, pinned=True)  # a block a request gave back
    try:
        assert loan.view(torch.uint8, (loan.nbytes,)).is_pinned()
    finally:
        loan.release()


@pytest.mark.parametrize("shrunk", ["input", "output"])
def test_a_region_shrunk_mid_request_is_400_and_the_server_serves_on(
    server, client, region, shrunk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object shrinks to nothing as the input is being read (a short read), or once the
    forward has put the output in copy memory, before it is written: a 400 naming the region,
    never a SIGBUS; the next request is served."""
    c, module = client
    key, handle, size = region
    path = Path("/dev/shm") / key.lstrip("/")
    x = np.random.default_rng(5).standard_normal((DIRECT_ROWS, H)).astype(np.float32)
    shm.set_shared_memory_region(handle, [x])
    c.register_system_shared_memory("data", key, 2 * size)
    if shrunk == "input":
        io = SystemRegion._io

        def shrink_then_read(self, call, fd, buffer, offset):
            if call is os.preadv:
                os.truncate(path, 0)
            return io(self, call, fd, buffer, offset)

        monkeypatch.setattr(SystemRegion, "_io", shrink_then_read)
        message = "shrank while"
    else:
        write = SystemRegion._write

        def shrink_then_write(self, *args):
            os.truncate(path, 0)
            return write(self, *args)

        monkeypatch.setattr(SystemRegion, "_write", shrink_then_write)
        message = "past the end"
    with pytest.raises(module.InferenceServerException, match=message) as err:
        _infer(c, module, "bf16", x, "FP32", size)
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert "region 'data'" in err.value.message()
    monkeypatch.undo()
    os.truncate(path, 2 * size)
    shm.set_shared_memory_region(handle, [x])
    _infer(c, module, "bf16", x, "FP32", size)
    out = shm.get_contents_as_numpy(handle, np.float32, [DIRECT_ROWS, H], offset=size)
    assert np.array_equal(out, _binary(c, module, "bf16", x, "FP32"))


BAD = {
    "nan": ("bf16", float("nan"), "hidden_states holds NaN or Inf (first at row {row}, column 7)"),
    "inf": ("f16", float("inf"), "hidden_states holds NaN or Inf (first at row {row}, column 7)"),
    "beyond-float16": (
        "f16",
        1e5,
        "hidden_states holds 100000 at row {row}, column 7: beyond the largest float16 value",
    ),
}


@pytest.mark.parametrize("row", [3, 290], ids=["first-piece", "second-piece"])
@pytest.mark.parametrize(("layer", "value", "message"), BAD.values(), ids=list(BAD))
def test_an_input_the_layer_cannot_take_is_400_naming_it(
    client, region, layer: str, value: float, message: str, row: int
) -> None:
    """FP32 values are checked with the batch on the device (the device-side cast included: 1e5
    is a float32 but no float16); the request at fault gets the 400 naming its value."""
    c, module = client
    key, handle, size = region
    x = np.random.default_rng(7).standard_normal((300, H)).astype(np.float32)
    x[row, 7] = value
    shm.set_shared_memory_region(handle, [x])
    c.register_system_shared_memory("data", key, 2 * size)
    with pytest.raises(module.InferenceServerException) as err:
        _infer(c, module, layer, x, "FP32", size)
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert message.format(row=row) in err.value.message(), err.value.message()
    fine = np.random.default_rng(8).standard_normal((DIRECT_ROWS, H)).astype(np.float32)
    shm.set_shared_memory_region(handle, [fine])
    _infer(c, module, layer, fine, "FP32", size)
