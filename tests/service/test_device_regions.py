"""CUDA regions without a GPU: a DeviceRegion over a CPU tensor stands in for an opened IPC
handle, so the path a CUDA region takes (views of its memory as the request's inputs, the
output rows written into a view by the forward, every place checked) runs through the real
server and the stock tritonclient. tests/service/test_cuda_shared_memory.py runs it on a GPU."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI

from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.service.triton.shared_memory import (
    VIEWS_KEPT,
    DeviceRegion,
    Region,
    SharedMemory,
    TensorPlace,
)
from tests.service.conftest import wait_ready
from tests.service.layers import TINY, H, free_port, reference_forward, running_server, tiny_loader

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

ROWS = 3
TENSOR_BYTES = ROWS * H * 4  # float32
BATCH_DELAY_MS = 300.0  # a request of fewer rows than a batch waits this long in the queue


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FastAPI, str, str]]:
    port = free_port()
    settings = Settings(
        device="cpu", grpc_port=port, allow_shared_memory=True, max_batch_delay_ms=BATCH_DELAY_MS
    )
    app = create_app(settings, tiny_loader)
    with running_server(app) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield app, url, f"127.0.0.1:{port}"


@pytest.fixture
def region(server) -> Iterator[torch.Tensor]:
    """The bytes of CUDA region "dev" (input at 0, output after it), registered for no token."""
    app, _, _ = server
    memory = torch.zeros(2 * TENSOR_BYTES, dtype=torch.uint8)
    regions = app.state.runtime.shared_memory.regions
    regions["dev"] = DeviceRegion("dev", memory, 0, None)
    yield memory
    regions.pop("dev", None)


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    _, url, grpc = server
    if request.param == "http":
        c = httpclient.InferenceServerClient(url.removeprefix("http://"))
        yield c, httpclient
    else:
        c = grpcclient.InferenceServerClient(grpc)
        yield c, grpcclient
    c.close()


def _put(memory: torch.Tensor, x: np.ndarray, offset: int = 0) -> None:
    memory[offset : offset + x.nbytes].copy_(torch.from_numpy(x.copy()).view(torch.uint8).ravel())


def _get(memory: torch.Tensor, offset: int = TENSOR_BYTES) -> torch.Tensor:
    return memory[offset : offset + TENSOR_BYTES].view(torch.float32).view(ROWS, H)


def _request(module, x, in_offset=0, in_size=TENSOR_BYTES, out_offset=TENSOR_BYTES, out_size=None):
    tensor = module.InferInput("hidden_states", list(x.shape), "FP32")
    tensor.set_shared_memory("dev", in_size, in_offset)
    out = module.InferRequestedOutput("output")
    out.set_shared_memory("dev", TENSOR_BYTES if out_size is None else out_size, out_offset)
    return [tensor], [out]


def test_inputs_are_read_from_and_the_output_written_into_the_region(client, region) -> None:
    c, module = client
    x = np.random.default_rng(0).standard_normal((ROWS, H)).astype(np.float32)
    _put(region, x)
    inputs, outputs = _request(module, x)
    result = c.infer(TINY, inputs, outputs=outputs)
    listed = result.get_output("output")
    if module is httpclient:
        assert listed["parameters"]["shared_memory_region"] == "dev"
        assert listed["parameters"]["shared_memory_byte_size"] == TENSOR_BYTES
    else:
        assert listed.parameters["shared_memory_region"].string_param == "dev"
        assert not result.get_response().raw_output_contents
    binary = module.InferInput("hidden_states", list(x.shape), "FP32")
    binary.set_data_from_numpy(x)
    in_reply = torch.from_numpy(c.infer(TINY, [binary]).as_numpy("output").copy())
    assert torch.equal(_get(region), in_reply)
    torch.testing.assert_close(_get(region), reference_forward(TINY, torch.from_numpy(x)))
    assert not region[TENSOR_BYTES + x.nbytes :].any()  # nothing written past the output


def test_output_into_the_region_from_an_input_in_the_body(client, region) -> None:
    c, module = client
    x = np.random.default_rng(1).standard_normal((ROWS, H)).astype(np.float32)
    tensor = module.InferInput("hidden_states", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    out = module.InferRequestedOutput("output")
    out.set_shared_memory("dev", TENSOR_BYTES, TENSOR_BYTES)
    c.infer(TINY, [tensor], outputs=[out])
    torch.testing.assert_close(_get(region), reference_forward(TINY, torch.from_numpy(x)))


PLACE_ERRORS = {
    "misaligned input": (dict(in_offset=2), "shared_memory_offset 2 in CUDA region 'dev' is not"),
    "wrong input size": (dict(in_size=TENSOR_BYTES - 4), "takes 768 bytes"),
    "input past the region": (dict(in_offset=TENSOR_BYTES + 4), "exceed region 'dev' of 1536"),
    "output does not fit": (dict(out_size=TENSOR_BYTES - 4), "takes at least 768 bytes"),
    "output past the region": (dict(out_offset=TENSOR_BYTES + 4), "exceed region 'dev'"),
    "misaligned output": (dict(out_offset=TENSOR_BYTES - 6, out_size=TENSOR_BYTES + 4), "4 bytes"),
}


@pytest.mark.parametrize(("given", "message"), PLACE_ERRORS.values(), ids=PLACE_ERRORS)
def test_bad_places_are_400_naming_the_tensor(client, region, given, message) -> None:
    c, module = client
    x = np.ones((ROWS, H), np.float32)
    _put(region, x)
    inputs, outputs = _request(module, x, **given)
    with pytest.raises(module.InferenceServerException, match=message) as err:
        c.infer(TINY, inputs, outputs=outputs)
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert not region[TENSOR_BYTES:].any()  # a refused request writes nothing


def test_nan_in_the_region_is_400(client, region) -> None:
    c, module = client
    x = np.ones((ROWS, H), np.float32)
    x[1, 5] = np.nan
    _put(region, x)
    with pytest.raises(module.InferenceServerException, match="row 1, column 5") as err:
        c.infer(TINY, _request(module, x)[0])
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_unregistered_while_queued_the_request_still_reads_and_writes_its_region(
    server, region
) -> None:
    """The request waits BATCH_DELAY_MS in the queue; the region is unregistered meanwhile: its
    views keep the memory, so the request is served and its output lands in the region; then the
    name is free."""
    app, url, grpc = server
    x = np.random.default_rng(2).standard_normal((ROWS, H)).astype(np.float32)
    _put(region, x)
    c = grpcclient.InferenceServerClient(grpc)  # tritonclient.http cannot leave its thread
    inputs, outputs = _request(grpcclient, x)
    answered: list[object] = []
    request = threading.Thread(
        target=lambda: answered.append(c.infer(TINY, inputs, outputs=outputs))
    )
    request.start()
    queue = app.state.runtime.batcher._queues[TINY]
    deadline = time.monotonic() + 10
    while not queue.requests:  # queued (for BATCH_DELAY_MS) before the region goes
        assert time.monotonic() < deadline, "the request was never queued"
        time.sleep(0.001)
    httpx.post(f"{url}/v2/cudasharedmemory/region/dev/unregister").raise_for_status()
    assert "dev" not in app.state.runtime.shared_memory.regions
    request.join(10)
    assert answered, "the request was not answered"
    torch.testing.assert_close(_get(region), reference_forward(TINY, torch.from_numpy(x)))
    with pytest.raises(grpcclient.InferenceServerException, match="no shared-memory region"):
        c.infer(TINY, inputs)
    c.close()


def test_a_device_region_views_its_memory_and_closes_once_its_last_user_is_done() -> None:
    memory = torch.arange(64, dtype=torch.uint8)
    released: list[str] = []
    regions = SharedMemory(allowed=True)
    regions.regions["dev"] = DeviceRegion("dev", memory, 3, None, lambda: released.append("dev"))
    place = TensorPlace("dev", 8, 16)
    held: list[DeviceRegion] = []
    view = regions.view("input x", place, torch.int32, [2, 2], None, True, held)
    assert view.data_ptr() == memory.data_ptr() + 8 and torch.equal(
        view.view(torch.uint8).ravel(), memory[8:24]
    )
    bigger = regions.view("output y", place, torch.int16, [2, 2], None, False, held)
    assert bigger.shape == (2, 2)
    with pytest.raises(Exception, match="takes 8 bytes"):
        regions.view("input x", place, torch.int16, [2, 2], None, True, held)
    assert regions.status("cuda", "", None) == [{"name": "dev", "device_id": 3, "byte_size": 64}]
    region = regions.regions["dev"]
    assert held == [region, region] and region.users == 2  # the refused view took none
    regions.unregister("cuda", "dev", None)
    assert regions.regions == {} and region.memory is not None and released == []
    region.release()
    assert released == []  # one request still uses it
    region.release()
    assert region.memory is None and released == ["dev"]  # closed once, by the last user
    regions.regions["idle"] = idle = DeviceRegion(
        "idle", memory, 3, None, lambda: released.append("idle")
    )
    regions.unregister("cuda", "idle", None)
    assert idle.memory is None and released == ["dev", "idle"]  # no user: closed at once


def test_a_place_named_again_gets_the_view_made_for_it_and_views_go_with_the_memory() -> None:
    memory = torch.arange(256, dtype=torch.uint8)
    region = DeviceRegion("dev", memory, 0, None)
    place = TensorPlace("dev", 8, 16)
    first = region.view("input x", place, torch.int32, [2, 2], True)
    assert region.view("input x", place, torch.int32, (2, 2), True) is first
    other_shape = region.view("input x", place, torch.int32, [4], True)
    other_dtype = region.view("input x", place, torch.int16, [2, 4], True)
    assert other_shape.shape == (4,) and other_dtype.dtype == torch.int16
    at_zero = region.view("input x", TensorPlace("dev", 0, 16), torch.int32, [2, 2], True)
    assert at_zero.data_ptr() == memory.data_ptr()
    scalar = region.view("input s", TensorPlace("dev", 0, 4), torch.int32, [], True)
    assert scalar.shape == () and scalar.data_ptr() == memory.data_ptr()
    with pytest.raises(Exception, match="takes 8 bytes"):  # the place is checked every time
        region.view("input x", place, torch.int16, [2, 2], True)
    assert region.view("output y", place, torch.int32, [2, 2], False) is first
    for offset in range(0, 4 * (VIEWS_KEPT + 1), 4):  # more places than are kept
        view = region.view("y", TensorPlace("dev", offset, 4), torch.int32, [1], True)
        assert view.data_ptr() == memory.data_ptr() + offset
    assert len(region._views) <= VIEWS_KEPT
    region.close()
    assert region.memory is None and not region._views


def test_system_regions_are_not_viewed() -> None:
    regions = SharedMemory(allowed=True)
    regions.regions["sys"] = _FakeSystem()
    place = TensorPlace("sys", 0, 4)
    assert regions.view("input x", place, torch.int32, [1], None, True, []) is None


class _FakeSystem(Region):  # a region that is no DeviceRegion
    kind = "system"

    def __init__(self) -> None:
        super().__init__("sys", 64, None)

    def close(self) -> None: ...

    def status(self) -> dict:
        return {}
