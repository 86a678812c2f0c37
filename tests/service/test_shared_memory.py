"""System shared memory (Triton's extension) with the stock tritonclient http and grpc clients
and tritonclient.utils.shared_memory: inputs read from regions, outputs written into them, and
every bad region, offset and size refused naming the problem."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import os
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from moe_serve.service import off_loop
from moe_serve.service.engine.copy_memory import MIN_BLOCK_BYTES
from moe_serve.service.errors import BadInput, Forbidden, NotReady, Overloaded
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.service.triton import shared_memory
from moe_serve.service.triton.shared_memory import SharedMemory, SystemRegion, owner_of
from tests.service.conftest import wait_ready
from tests.service.layers import TINY, H, free_port, reference_forward, running_server, tiny_loader

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
shm = pytest.importorskip("tritonclient.utils.shared_memory")

ROWS = 3
TENSOR_BYTES = ROWS * H * 4  # float32


async def _read(r: SystemRegion, offset: int, size: int, alone: bool = False) -> torch.Tensor:
    """`size` bytes of region `r` at `offset`, read into new memory."""
    into = torch.empty(size, dtype=torch.uint8)
    await r.read(offset, memoryview(into.numpy()), alone)
    return into


@pytest.fixture(scope="module")
def urls() -> Iterator[tuple[str, str]]:
    port = free_port()
    settings = Settings(device="cpu", grpc_port=port, allow_shared_memory=True)
    with running_server(create_app(settings, tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield url, f"127.0.0.1:{port}"


@pytest.fixture(params=["http", "grpc"])
def client(request, urls):
    if request.param == "http":
        c = httpclient.InferenceServerClient(urls[0].removeprefix("http://"))
        yield c, httpclient
    else:
        c = grpcclient.InferenceServerClient(urls[1])
        yield c, grpcclient
    c.unregister_system_shared_memory()
    c.close()


@pytest.fixture
def region() -> Iterator[tuple[str, object]]:
    """A 2-tensor shared-memory object: input at 0, output at TENSOR_BYTES."""
    key = f"/moe-serve-test-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region("data", key, 2 * TENSOR_BYTES)
    yield key, handle
    shm.destroy_shared_memory_region(handle)


def _inputs(module, x: np.ndarray, region: str = "data", size: int = TENSOR_BYTES, offset=0):
    tensor = module.InferInput("hidden_states", list(x.shape), "FP32")
    tensor.set_shared_memory(region, size, offset)
    return [tensor]


def _output(module, region: str = "data", size: int = TENSOR_BYTES, offset=TENSOR_BYTES):
    out = module.InferRequestedOutput("output")
    out.set_shared_memory(region, size, offset)
    return [out]


def test_infer_reads_and_writes_system_shared_memory(client, region) -> None:
    c, module = client
    key, handle = region
    x = np.random.default_rng(0).standard_normal((ROWS, H)).astype(np.float32)
    shm.set_shared_memory_region(handle, [x])
    c.register_system_shared_memory("data", key, 2 * TENSOR_BYTES)
    result = c.infer(TINY, _inputs(module, x), outputs=_output(module))
    listed = result.get_output("output")  # listed, its bytes in the region, not the reply
    if module is httpclient:
        assert "data" not in listed and listed["parameters"]["shared_memory_region"] == "data"
    else:
        assert listed.parameters["shared_memory_region"].string_param == "data"
        assert not result.get_response().raw_output_contents
    out = shm.get_contents_as_numpy(handle, np.float32, [ROWS, H], offset=TENSOR_BYTES)
    torch.testing.assert_close(torch.tensor(out), reference_forward(TINY, torch.from_numpy(x)))


def test_region_at_an_offset_of_the_object_and_output_in_the_reply(client, region) -> None:
    """Register only the object's second half; the input lies at the region's start."""
    c, module = client
    key, handle = region
    x = np.random.default_rng(1).standard_normal((ROWS, H)).astype(np.float32)
    shm.set_shared_memory_region(handle, [x], offset=TENSOR_BYTES)
    c.register_system_shared_memory("half", key, TENSOR_BYTES, offset=TENSOR_BYTES)
    out = c.infer(TINY, _inputs(module, x, "half")).as_numpy("output")
    torch.testing.assert_close(torch.tensor(out), reference_forward(TINY, torch.from_numpy(x)))


def _status(c) -> dict[str, dict]:
    """Registered regions by name, in the HTTP schema, from either client."""
    if isinstance(c, httpclient.InferenceServerClient):
        return {r["name"]: r for r in c.get_system_shared_memory_status()}
    regions = c.get_system_shared_memory_status(as_json=True).get("regions", {})
    return {
        name: {**r, "offset": int(r.get("offset", 0)), "byte_size": int(r["byte_size"])}
        for name, r in regions.items()
    }


def test_status_lists_registered_regions_and_unregister_removes_them(client, region) -> None:
    c, _ = client
    key, _ = region
    c.register_system_shared_memory("a", key, 64, offset=8)
    c.register_system_shared_memory("b", key, 16)
    status = _status(c)
    assert status["a"] == {"name": "a", "key": key, "offset": 8, "byte_size": 64}
    assert sorted(status) == ["a", "b"]
    c.unregister_system_shared_memory("a")
    assert sorted(_status(c)) == ["b"]
    c.unregister_system_shared_memory()
    assert _status(c) == {}


REGISTER_ERRORS = {
    "no such object": ("/moe-serve-no-such-object", 0, 64, "cannot open shared-memory object"),
    "past the object": (None, 8, 2 * TENSOR_BYTES, "exceed shared-memory object"),
    "a path as key": ("/../etc/passwd", 0, 8, "is not a shared-memory object name"),
}


@pytest.mark.parametrize(
    ("key", "offset", "size", "message"), REGISTER_ERRORS.values(), ids=REGISTER_ERRORS
)
def test_bad_registrations_are_refused_naming_the_problem(
    client, region, key, offset, size, message
) -> None:
    c, module = client
    with pytest.raises(module.InferenceServerException, match=message) as err:
        c.register_system_shared_memory("bad", key or region[0], size, offset=offset)
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_a_name_registered_twice_is_a_conflict(client, region) -> None:
    c, module = client
    c.register_system_shared_memory("data", region[0], 64)
    with pytest.raises(module.InferenceServerException, match="already registered") as err:
        c.register_system_shared_memory("data", region[0], 64)
    assert err.value.status() in ("409", "StatusCode.ALREADY_EXISTS")


INFER_ERRORS = {
    "unknown region": (
        dict(region="nope"),
        {},
        "input hidden_states: no shared-memory region named 'nope'",
    ),
    "offset past the region": (
        dict(offset=TENSOR_BYTES + 4),
        {},
        "exceed region 'data' of 1536 bytes",
    ),
    "wrong byte size": (dict(size=TENSOR_BYTES - 4), {}, "takes 768 bytes"),
    "output does not fit": ({}, dict(size=TENSOR_BYTES - 4), "takes at least 768 bytes"),
    "output past the region": ({}, dict(offset=TENSOR_BYTES + 4), "exceed region 'data'"),
}


@pytest.mark.parametrize(("given", "out", "message"), INFER_ERRORS.values(), ids=INFER_ERRORS)
def test_bad_places_in_a_request_are_400_naming_the_tensor(
    client, region, given, out, message
) -> None:
    c, module = client
    c.register_system_shared_memory("data", region[0], 2 * TENSOR_BYTES)
    x = np.zeros((ROWS, H), np.float32)
    with pytest.raises(module.InferenceServerException, match=message) as err:
        c.infer(TINY, _inputs(module, x, **given), outputs=_output(module, **out))
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_unregister_of_an_unknown_region_is_404(client) -> None:
    c, module = client
    with pytest.raises(
        module.InferenceServerException, match="no system shared-memory region"
    ) as err:
        c.unregister_system_shared_memory("never")
    assert err.value.status() in ("404", "StatusCode.NOT_FOUND")


def test_shared_memory_is_refused_unless_allowed(region) -> None:
    with running_server(create_app(Settings(device="cpu"), tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        with httpclient.InferenceServerClient(url.removeprefix("http://")) as c:
            with pytest.raises(
                httpclient.InferenceServerException, match="--allow-shared-memory"
            ) as err:
                c.register_system_shared_memory("data", region[0], 64)
            assert err.value.status() == "403"
            with pytest.raises(httpclient.InferenceServerException, match="--allow-shared-memory"):
                c.infer(TINY, _inputs(httpclient, np.zeros((ROWS, H), np.float32)))
            assert "system_shared_memory" not in c.get_server_metadata()["extensions"]


def test_a_region_is_visible_only_to_the_token_that_registered_it(region) -> None:
    regions = SharedMemory(allowed=True)
    alice, bob = owner_of("Bearer alice-token"), owner_of("Bearer bob-token")
    regions.register_system("data", region[0], 0, 64, alice)
    assert [r["name"] for r in regions.status("system", "", alice)] == ["data"]
    assert regions.status("system", "", bob) == []
    with pytest.raises(Exception, match="no system shared-memory region named 'data'"):
        regions.unregister("system", "data", bob)
    regions.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suite registers real CUDA regions")
def test_a_cuda_region_on_a_server_without_a_gpu_is_400(client) -> None:
    c, module = client
    with pytest.raises(module.InferenceServerException, match="needs a CUDA GPU") as err:
        c.register_cuda_shared_memory("gpu", base64.b64encode(bytes(64)), 0, 64)
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_a_symlink_in_dev_shm_is_not_followed(client, tmp_path) -> None:
    c, module = client
    target = tmp_path / "secret"
    target.write_bytes(b"x" * 64)
    link = Path("/dev/shm") / f"moe-serve-link-{uuid.uuid4().hex[:12]}"
    link.symlink_to(target)
    try:
        with pytest.raises(module.InferenceServerException, match="cannot open") as err:
            c.register_system_shared_memory("link", f"/{link.name}", 64)
        assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    finally:
        link.unlink()


def test_a_system_region_reads_and_writes_exactly_its_bytes(region) -> None:
    """At the region's offset in the object plus the tensor's, in any dtype (bfloat16 has no
    numpy type), from a non-contiguous tensor too; the bytes around them stay as they were, and
    a read is a copy that later writes to the region leave alone."""
    key, handle = region
    shm.set_shared_memory_region(handle, [np.full(2 * TENSOR_BYTES, 7, dtype=np.uint8)])
    r = SystemRegion("r", key, 16, 96, None)
    try:
        data = torch.arange(32, dtype=torch.bfloat16).reshape(4, 8).t()  # 64 bytes
        asyncio.run(r.write(8, data))
        raw = shm.get_contents_as_numpy(handle, np.uint8, [2 * TENSOR_BYTES])
        assert (raw[:24] == 7).all() and (raw[24 + 64 :] == 7).all()
        assert raw[24 : 24 + 64].tobytes() == data.contiguous().view(torch.uint8).numpy().tobytes()
        read = asyncio.run(_read(r, 8, 64))
        asyncio.run(r.write(8, torch.zeros(32, dtype=torch.bfloat16)))
        torch.testing.assert_close(read.view(torch.bfloat16).reshape(8, 4), data, rtol=0, atol=0)
        assert asyncio.run(_read(r, 0, 0)).numel() == 0
    finally:
        r.close()


@pytest.mark.parametrize("shrunk", ["input", "output"])
def test_a_region_its_owner_shrank_is_400_and_the_server_lives(client, region, shrunk) -> None:
    """The client truncates its object after registering it: reading the input from it, or
    writing the output into it, must not touch memory past the object's end (a SIGBUS would
    kill the server)."""
    c, module = client
    key, handle = region
    x = np.random.default_rng(2).standard_normal((ROWS, H)).astype(np.float32)
    shm.set_shared_memory_region(handle, [x])
    c.register_system_shared_memory("data", key, 2 * TENSOR_BYTES)
    c.register_system_shared_memory("tail", key, TENSOR_BYTES, offset=TENSOR_BYTES)
    os.truncate(Path("/dev/shm") / key.lstrip("/"), 0 if shrunk == "input" else TENSOR_BYTES)
    named = "data" if shrunk == "input" else "tail"
    with pytest.raises(module.InferenceServerException, match="past the end") as err:
        c.infer(TINY, _inputs(module, x), outputs=_output(module, "tail", offset=0))
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert f"region '{named}'" in err.value.message()
    assert c.is_server_live()


def test_a_shrunk_object_is_refused_by_read_and_write_never_touched(region) -> None:
    key, _ = region
    r = SystemRegion("r", key, 16, 96, None)
    try:
        os.truncate(Path("/dev/shm") / key.lstrip("/"), 32)
        with pytest.raises(BadInput, match="region 'r': 64 bytes at offset 8 lie past the end"):
            asyncio.run(_read(r, 8, 64))
        with pytest.raises(BadInput, match=f"shared-memory object '{key}', now of 32 bytes"):
            asyncio.run(r.write(8, torch.zeros(16)))
        # what is still there reads as before
        assert asyncio.run(_read(r, 0, 16)).numel() == 16
    finally:
        r.close()


@pytest.mark.parametrize("into", ["reply", "region"])
def test_a_float16_reply_that_would_hold_inf_is_refused_and_counted(
    client, urls, region, into
) -> None:
    """float16 ends at 65504: an output the float32 layer computes beyond it would become Inf
    in the cast to the request's dtype, so the request fails (422, INVALID_ARGUMENT over gRPC),
    whether the output goes into the reply or into a region, and the metric counts it."""
    c, module = client
    key, handle = region
    x = np.full((ROWS, H), 6e4, np.float16)
    x[0] = 0.5  # a row that fits
    metrics = f"{urls[0]}/metrics"
    tensor = module.InferInput("hidden_states", [ROWS, H], "FP16")
    if into == "region":
        shm.set_shared_memory_region(handle, [x])
        c.register_system_shared_memory("data", key, 2 * TENSOR_BYTES)
        tensor.set_shared_memory("data", x.nbytes)
        outputs = _output(module, size=x.nbytes, offset=x.nbytes)
    else:
        tensor.set_data_from_numpy(x, **({"binary_data": True} if module is httpclient else {}))
        outputs = None
    before = _nonfinite_count(metrics)
    with pytest.raises(module.InferenceServerException, match="holds NaN or Inf at row 1") as err:
        c.infer(TINY, [tensor], outputs=outputs)
    assert err.value.status() in ("422", "StatusCode.INVALID_ARGUMENT")
    assert "exceeds float16" in err.value.message()
    assert _nonfinite_count(metrics) == before + 1
    fits = module.InferInput("hidden_states", [1, H], "FP16")
    fits.set_data_from_numpy(x[:1])
    out = c.infer(TINY, [fits]).as_numpy("output")
    assert out.dtype == np.float16 and np.isfinite(out).all()


def _nonfinite_count(url: str) -> float:
    series = f'moe_serve_nonfinite_forwards_total{{layer="{TINY}"}} '
    line = next((x for x in httpx.get(url).text.splitlines() if x.startswith(series)), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


@contextlib.contextmanager
def _copies_seen(monkeypatch, size: int) -> Iterator[tuple[SystemRegion, list[str]]]:
    """A system region of `size` bytes, and where each of its reads and writes runs ("loop"
    or "worker", in order)."""
    key = f"/moe-serve-test-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region("copies", key, size)
    threads: list[str] = []
    read, write = SystemRegion._read, SystemRegion._write
    monkeypatch.setattr(SystemRegion, "_read", lambda *a: threads.append(_thread()) or read(*a))
    monkeypatch.setattr(SystemRegion, "_write", lambda *a: threads.append(_thread()) or write(*a))
    r = SystemRegion("copies", key, 0, size, None)
    try:
        yield r, threads
    finally:
        r.close()
        shm.destroy_shared_memory_region(handle)


def test_a_large_copy_runs_off_the_event_loop(monkeypatch) -> None:
    """Reading or writing megabytes of a region must not hold the event loop (probes, other
    requests)."""
    size = 4 << 20
    with _copies_seen(monkeypatch, size) as (r, threads):

        async def copies() -> None:
            await r.write(0, torch.ones(size // 4))
            assert (await _read(r, 0, size)).view(torch.float32).eq(1).all()
            await _read(r, 0, 64)  # small: here

        asyncio.run(copies())
    assert threads == ["worker", "worker", "loop"]


def test_a_copy_on_the_loop_goes_through_the_regions_descriptor_one_on_a_thread_its_own(
    monkeypatch,
) -> None:
    """Nothing closes the region's descriptor while a copy on the loop runs, so that copy makes
    no descriptor of its own (and still serves with none left); a copy on a thread does, which
    an unregister meanwhile leaves open."""
    size = 4 << 20
    with _copies_seen(monkeypatch, size) as (r, threads):

        def no_descriptor_left(fd: int) -> int:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(shared_memory.os, "dup", no_descriptor_left)

        async def copies() -> None:
            await r.write(0, torch.full((16,), 2.0))
            assert (await _read(r, 0, 64)).view(torch.float32).eq(2).all()
            with pytest.raises(NotReady, match="no file descriptor left"):
                await _read(r, 0, size)

        asyncio.run(copies())
    assert threads == ["loop", "loop"]


def test_the_servers_only_request_copies_a_few_megabytes_on_the_loop(monkeypatch) -> None:
    """Alone (nothing else admitted to the batcher), a copy up to BINARY.alone_bytes skips the
    thread hops each way; a larger one still leaves the loop."""
    size, large = 2 << 20, off_loop.BINARY.alone_bytes + 4
    with _copies_seen(monkeypatch, large) as (r, threads):

        async def copies() -> None:
            await r.write(0, torch.full((size // 4,), 3.0), alone=True)
            got = await _read(r, 0, size, alone=True)
            assert got.view(torch.float32).eq(3).all()
            await _read(r, 0, large, alone=True)

        asyncio.run(copies())
    assert threads == ["loop", "loop", "worker"]


def test_a_request_copies_on_the_loop_only_while_it_is_the_servers_only_one(
    monkeypatch, region
) -> None:
    """inference.infer asks the batcher whether it is idle before the input's copy and after
    the forward, for the output's."""
    key, _ = region
    seen = []
    read, write = SharedMemory.read, SharedMemory.write

    async def spy_read(self, *args):
        seen.append(("read", args[-1]))
        return await read(self, *args)

    async def spy_write(self, *args):
        seen.append(("write", args[-1]))
        return await write(self, *args)

    monkeypatch.setattr(SharedMemory, "read", spy_read)
    monkeypatch.setattr(SharedMemory, "write", spy_write)
    port = free_port()
    settings = Settings(device="cpu", grpc_port=port, allow_shared_memory=True)
    with running_server(create_app(settings, tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            c.register_system_shared_memory("data", key, 2 * TENSOR_BYTES)
            x = np.ones((ROWS, H), np.float32)
            shm.set_shared_memory_region(region[1], [x])
            c.infer(TINY, _inputs(grpcclient, x), outputs=_output(grpcclient))
        finally:
            c.unregister_system_shared_memory()
            c.close()
    assert seen == [("read", True), ("write", True)]


def test_a_request_cancelled_mid_copy_gives_its_copy_memory_back_once_the_copy_ended(
    monkeypatch,
) -> None:
    """A gRPC call cancelled while its input is read on a thread: the thread cannot be stopped,
    so the request unwinds (and gives its block back, to be lent to the next request) only once
    the copy has ended; else the late copy writes the cancelled request's bytes into the next
    request's input."""
    key = f"/moe-serve-test-{uuid.uuid4().hex[:12]}"
    size = 2 << 20  # over 1 MiB: read on a thread
    handle = shm.create_shared_memory_region("cancelled", key, 2 * size)
    shm.set_shared_memory_region(handle, [np.full(size // 4, 7.0, np.float32)])
    shm.set_shared_memory_region(handle, [np.ones(size // 4, np.float32)], offset=size)
    copying, go_on = threading.Event(), threading.Event()
    read = SystemRegion._read

    def held_read(region, fd, offset, *rest):
        if offset == 0:  # the first request's copy
            copying.set()
            go_on.wait()
        return read(region, fd, offset, *rest)

    monkeypatch.setattr(SystemRegion, "_read", held_read)
    memory = SharedMemory(allowed=True)
    memory.register_system("r", key, 0, 2 * size, None)
    shape = (size // (4 * H), H)

    async def cancelled_then_next() -> None:
        held: list = []
        place = shared_memory.TensorPlace("r", 0, size)
        first = asyncio.create_task(
            memory.read("input a", place, torch.float32, shape, None, held, False)
        )
        await asyncio.get_running_loop().run_in_executor(None, copying.wait)
        first.cancel()
        for _ in range(10):
            await asyncio.sleep(0)
        unwound_mid_copy = first.done()
        go_on.set()
        assert not unwound_mid_copy
        with pytest.raises(asyncio.CancelledError):
            await first
        for loan in held:  # as inference.infer's finally does
            loan.release()
        after: list = []
        place = shared_memory.TensorPlace("r", size, size)
        x = await memory.read("input b", place, torch.float32, shape, None, after, False)
        assert after[0].block is held[0].block  # the same block
        assert x.eq(1).all()

    try:
        asyncio.run(cancelled_then_next())
    finally:
        go_on.set()
        memory.close()
        shm.destroy_shared_memory_region(handle)


def _thread() -> str:
    return "loop" if threading.current_thread() is threading.main_thread() else "worker"


def test_inputs_in_system_shared_memory_count_against_the_body_limit(region) -> None:
    key, _ = region
    settings = Settings(device="cpu", allow_shared_memory=True, max_body_bytes=1024)
    with running_server(create_app(settings, tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        with httpclient.InferenceServerClient(url.removeprefix("http://")) as c:
            c.register_system_shared_memory("data", key, 2 * TENSOR_BYTES)
            x = np.zeros((ROWS * 2, H), np.float32)  # 1536 bytes
            with pytest.raises(httpclient.InferenceServerException, match="1024-byte limit") as err:
                c.infer(TINY, _inputs(httpclient, x, size=2 * TENSOR_BYTES))
            assert err.value.status() == "413"
            c.unregister_system_shared_memory()


def test_with_a_prefix_only_keys_under_it_are_accepted(region) -> None:
    """--shared-memory-prefix: a key naming another /dev/shm object (one the client did not
    make, say) is refused with 403; keys under the prefix register as before."""
    key, _ = region  # "/moe-serve-test-..."
    port = free_port()
    settings = Settings(
        device="cpu", grpc_port=port, allow_shared_memory=True, shared_memory_prefix="client-"
    )
    with running_server(create_app(settings, tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        with httpclient.InferenceServerClient(url.removeprefix("http://")) as http_client:
            with pytest.raises(httpclient.InferenceServerException, match="'/client-'") as err:
                http_client.register_system_shared_memory("data", key, 64)
            assert err.value.status() == "403"
            with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as grpc_client:
                with pytest.raises(grpcclient.InferenceServerException, match="prefix") as err:
                    grpc_client.register_system_shared_memory("data", key, 64)
                assert err.value.status() == "StatusCode.PERMISSION_DENIED"
            ours = f"/client-{uuid.uuid4().hex[:12]}"
            handle = shm.create_shared_memory_region("ours", ours, 64)
            try:
                http_client.register_system_shared_memory("ours", ours, 64)
                assert [r["name"] for r in http_client.get_system_shared_memory_status()] == [
                    "ours"
                ]
                http_client.unregister_system_shared_memory("ours")
            finally:
                shm.destroy_shared_memory_region(handle)


def test_the_regions_a_token_may_hold_are_capped(region) -> None:
    """Each region holds a descriptor until it is unregistered, however long ago its client
    left: a token may hold max_regions, another token its own, and an unregistered one frees
    its place."""
    key, _ = region
    regions = SharedMemory(allowed=True, max_regions=2)
    alice, bob = owner_of("Bearer alice-token"), owner_of("Bearer bob-token")
    regions.register_system("a1", key, 0, 64, alice)
    regions.register_system("a2", key, 0, 64, alice)
    with pytest.raises(Overloaded, match=re.escape(CAPPED)) as err:
        regions.register_system("a3", key, 0, 64, alice)
    assert err.value.status == 429 and not err.value.headers  # no Retry-After: waiting won't do
    regions.register_system("b1", key, 0, 64, bob)
    regions.unregister("system", "a1", alice)
    regions.register_system("a3", key, 0, 64, alice)
    assert sorted(regions.regions) == ["a2", "a3", "b1"]
    regions.close()


CAPPED = "2 shared-memory regions are registered, the limit (MOE_SERVE_MAX_SHARED_MEMORY_REGIONS)"


def test_over_http_the_cap_is_a_429_and_registrations_take_integers_only(
    make_client, region
) -> None:
    client = make_client(allow_shared_memory=True, max_shared_memory_regions=2)
    key, _ = region
    for name in ("a", "b"):
        register = {"key": key, "offset": 0, "byte_size": 64}
        r = client.post(f"/v2/systemsharedmemory/region/{name}/register", json=register)
        assert r.status_code == 200, r.text
    r = client.post("/v2/systemsharedmemory/region/c/register", json=register)
    assert r.status_code == 429 and CAPPED in r.json()["error"]
    client.post("/v2/systemsharedmemory/unregister")
    for field, value in (("offset", True), ("byte_size", 64.0), ("byte_size", "64")):
        register = {"key": key, "offset": 0, "byte_size": 64, field: value}
        r = client.post("/v2/systemsharedmemory/region/d/register", json=register)
        assert r.status_code == 400
        assert f"{field}: Input should be a valid integer" in r.json()["error"]


def test_region_names_and_keys_longer_than_256_characters_are_refused(region) -> None:
    key, _ = region
    regions = SharedMemory(allowed=True)
    with pytest.raises(BadInput, match="region name of 257 characters is longer than 256"):
        regions.register_system("n" * 257, key, 0, 64, None)
    with pytest.raises(BadInput, match="key of 258 characters is longer than 256"):
        regions.register_system("n", "/" + "k" * 257, 0, 64, None)
    regions.register_system("n" * 256, key, 0, 64, None)
    regions.close()


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\x00b", "tab\there"])
def test_region_names_no_http_route_could_carry_are_refused(region, name: str) -> None:
    """HTTP names a region in its routes' paths, and an empty name means every region: a name
    gRPC could register but HTTP could not address (or unregister alone) is refused."""
    key, _ = region
    regions = SharedMemory(allowed=True)
    with pytest.raises(BadInput, match="cannot be used: a name is printable characters"):
        regions.register_system(name, key, 0, 64, None)
    assert regions.regions == {}
    regions.register_system("a.b-c_d:é", key, 0, 64, None)
    regions.close()


def test_with_a_prefix_an_object_with_a_second_link_is_refused() -> None:
    """A hard link under the prefix to another program's object would carry that object past
    --shared-memory-prefix: with a prefix set, an object of more than one link is refused."""
    token = uuid.uuid4().hex[:12]
    other, link = Path(f"/dev/shm/other-{token}"), Path(f"/dev/shm/client-{token}")
    other.write_bytes(bytes(64))
    os.link(other, link)
    regions = SharedMemory(allowed=True, key_prefix="client-")
    try:
        with pytest.raises(Forbidden, match=f"'/{link.name}' has 2 links"):
            regions.register_system("data", f"/{link.name}", 0, 64, None)
        other.unlink()  # the link is now the object's one name
        regions.register_system("data", f"/{link.name}", 0, 64, None)
    finally:
        regions.close()
        link.unlink()
        other.unlink(missing_ok=True)


def test_regions_leave_descriptors_for_connections_and_the_probes_answer(
    region, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registering region after region stops, with a 503, while the process still has
    DESCRIPTOR_RESERVE descriptors left; new connections, the probes', are still served. (The
    limit is lowered here, as if the process were close to `ulimit -n`.)"""
    key, _ = region
    limit = []

    def descriptor_limit() -> int:
        """A few more than the server holds at its first registration, plus the reserve."""
        if not limit:
            lowest_free = os.open("/dev/null", os.O_RDONLY)
            os.close(lowest_free)
            limit.append(lowest_free + 4 + shared_memory.DESCRIPTOR_RESERVE)
        return limit[0]

    monkeypatch.setattr(shared_memory, "_descriptor_limit", descriptor_limit)
    settings = Settings(device="cpu", allow_shared_memory=True, max_shared_memory_regions=1000)
    with running_server(create_app(settings, tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
            register = {"key": key, "byte_size": 64}
            for i in range(100):
                r = http.post(f"/v2/systemsharedmemory/region/r{i}/register", json=register)
                if r.status_code != 200:
                    break
            assert r.status_code == 503, r.text
            assert "no file descriptor left" in r.json()["error"]
            assert 0 < i < 100
        for probe in ("/health", "/ready", "/metrics"):  # each on a new connection
            assert httpx.get(f"{url}{probe}", timeout=WAIT_S).status_code == 200
        httpx.post(f"{url}/v2/systemsharedmemory/unregister")


WAIT_S = 30.0  # what a probe may take before it counts as hung


@pytest.mark.parametrize(
    ("shape", "byte_size", "message"),
    [
        ([0, 2**63], 0, "shape [0, 9223372036854775808] is too large"),  # torch cannot lay out
        ([], 4, "hidden_states"),  # a scalar: the wrong rank, as anywhere else
    ],
    ids=["too-large-to-lay-out", "scalar"],
)
def test_a_system_region_input_of_a_shape_no_layer_takes_is_400(
    make_client, region, shape, byte_size, message
) -> None:
    client = make_client(allow_shared_memory=True)
    key, _ = region
    register = {"key": key, "byte_size": 64}
    assert client.post("/v2/systemsharedmemory/region/io/register", json=register).is_success
    place = {"shared_memory_region": "io", "shared_memory_byte_size": byte_size}
    body = {"inputs": [{"name": "hidden_states", "shape": shape, "datatype": "FP32",
                        "parameters": place}]}  # fmt: skip
    r = client.post(f"/v2/models/{TINY}/infer", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]


EMPTY = {"[0, H]": ([0, H], "hidden_states is empty"), "[4, 0]": ([4, 0], "has 0 columns"),
         "[0, 0]": ([0, 0], "hidden_states is empty")}  # fmt: skip


@pytest.mark.parametrize(("shape", "message"), EMPTY.values(), ids=EMPTY)
@pytest.mark.parametrize("offset", [0, TENSOR_BYTES], ids=["start", "second-tensor"])
def test_an_empty_shared_memory_input_is_400_as_any_empty_input(
    client, region, shape, message, offset
) -> None:
    c, module = client
    key, _ = region
    c.register_system_shared_memory("data", key, 2 * TENSOR_BYTES)
    tensor = module.InferInput("hidden_states", shape, "FP32")
    tensor.set_shared_memory("data", 0, offset)
    with pytest.raises(module.InferenceServerException) as err:
        c.infer(TINY, [tensor], outputs=_output(module, size=0, offset=offset))
    assert message in err.value.message(), err.value.message()
    assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")


def test_the_copies_requests_in_flight_hold_out_of_system_regions_are_bounded(
    make_client, region
) -> None:
    """A request names 64 MiB of a region in a few hundred bytes, and the server copies them:
    past MOE_SERVE_MAX_SHARED_MEMORY_COPY_BYTES held by requests in flight, a 429 with
    Retry-After; once they are answered the room is back, and answered requests hold none."""
    client = make_client(allow_shared_memory=True, max_shared_memory_copy_bytes=TENSOR_BYTES)
    key, handle = region
    register = {"key": key, "byte_size": 2 * TENSOR_BYTES}
    assert client.post("/v2/systemsharedmemory/region/data/register", json=register).is_success
    shm.set_shared_memory_region(handle, [np.zeros((ROWS, H), np.float32)])
    place = {"shared_memory_region": "data", "shared_memory_byte_size": TENSOR_BYTES}
    body = {"inputs": [{"name": "hidden_states", "shape": [ROWS, H], "datatype": "FP32",
                        "parameters": place}]}  # fmt: skip
    memory = client.app.state.runtime.shared_memory
    in_flight = memory.reserve_copies(1)  # another request's copy, not yet answered
    refused = client.post(f"/v2/models/{TINY}/infer", json=body)
    assert refused.status_code == 429, refused.text
    assert "MOE_SERVE_MAX_SHARED_MEMORY_COPY_BYTES" in refused.json()["error"]
    assert refused.headers["retry-after"] == "1"
    in_flight.release()
    for _ in range(2):
        assert client.post(f"/v2/models/{TINY}/infer", json=body).status_code == 200
    assert memory.copied_bytes == 0


def test_system_shared_memory_requests_give_their_copy_memory_back(make_client, region) -> None:
    """Each request's input and output go through copy memory, which is back once it is
    answered: the next requests reuse the same two blocks."""
    client = make_client(allow_shared_memory=True)
    key, handle = region
    register = {"key": key, "byte_size": 2 * TENSOR_BYTES}
    assert client.post("/v2/systemsharedmemory/region/data/register", json=register).is_success
    x = np.random.default_rng(3).standard_normal((ROWS, H)).astype(np.float32)
    shm.set_shared_memory_region(handle, [x])
    place = {"shared_memory_region": "data", "shared_memory_byte_size": TENSOR_BYTES}
    after = place | {"shared_memory_offset": TENSOR_BYTES}
    body = {"inputs": [{"name": "hidden_states", "shape": [ROWS, H], "datatype": "FP32",
                        "parameters": place}],
            "outputs": [{"name": "output", "parameters": after}]}  # fmt: skip
    memory = client.app.state.runtime.shared_memory
    for _ in range(3):
        assert client.post(f"/v2/models/{TINY}/infer", json=body).status_code == 200
        assert memory.copy_memory.idle_bytes == 2 * MIN_BLOCK_BYTES  # the input's, the output's
    out = shm.get_contents_as_numpy(handle, np.float32, [ROWS, H], offset=TENSOR_BYTES).copy()
    torch.testing.assert_close(torch.from_numpy(out), reference_forward(TINY, torch.from_numpy(x)))
