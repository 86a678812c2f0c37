"""CUDA shared memory on the GPU: a client in a second process on the same GPU hands the
server a CUDA IPC handle (tritonclient.utils.cuda_shared_memory); the output written into its
buffer (device to device) matches the reference and equals the binary request's, over HTTP and
gRPC; a region unregistered while a request on it waits is still read and written, and its
handle closed after; bad handles and places are clear 400s."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.service.triton import shared_memory
from moe_serve.weights.load import load_layer
from tests.service.conftest import wait_ready
from tests.service.layers import free_port, running_server

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
GPU_READY_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 120.0
TOLERANCE = 2e-2  # the demo layer computes in bf16
CLOSE_TIMEOUT_S = 5.0
BATCH_DELAY_MS = 300.0  # how long cuda_shm_client's in-flight requests (16 rows) wait


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    cache = tmp_path_factory.mktemp("cache")
    port = free_port()
    settings = Settings(
        device="cuda",
        cache_dir=cache,
        grpc_port=port,
        allow_shared_memory=True,
        max_batch_tokens=64,  # a 64-row request runs at once; fewer rows wait BATCH_DELAY_MS
        max_batch_delay_ms=BATCH_DELAY_MS,
    )
    with running_server(create_app(settings)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get, GPU_READY_TIMEOUT_S)
        yield url.removeprefix("http://"), f"127.0.0.1:{port}", cache


def test_cuda_shared_memory_round_trip_from_another_process(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    http, grpc, cache = server
    closed: dict[str, list[float]] = {}  # region -> when its IPC handle was closed
    close_ipc = shared_memory._close_ipc

    def record_close(cudart: object, pointer: int, device_id: int, region: str) -> None:
        closed.setdefault(region, []).append(time.time())
        close_ipc(cudart, pointer, device_id, region)

    monkeypatch.setattr(shared_memory, "_close_ipc", record_close)
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.service.cuda_shm_client",
            "--http",
            http,
            "--grpc",
            grpc,
            "--input",
            str(tmp_path / "x.npy"),
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    loaded = load_layer(cache / "demo", torch.device("cpu"))
    reference, _ = build_layer(loaded.config, loaded.weights, torch.device("cpu"), "reference")
    with torch.inference_mode():
        hidden = torch.from_numpy(x).bfloat16().float()  # the bf16 layer rounds its input so
        expected = reference.forward(ForwardInputs(hidden, None)).output
    binary = np.load(tmp_path / "binary.npy")
    for transport in ("http", "grpc"):
        out = np.load(tmp_path / f"{transport}.npy")
        assert relative_error(torch.from_numpy(out), expected) < TOLERANCE, transport
        assert np.array_equal(out, binary), transport  # the same forward of the same rows
    inflight = torch.from_numpy(np.load(tmp_path / "inflight.npy"))
    inflight_binary = torch.from_numpy(np.load(tmp_path / "inflight-binary.npy"))
    assert relative_error(inflight, expected[: inflight.shape[0]]) < TOLERANCE
    assert relative_error(inflight, inflight_binary) < TOLERANCE
    assert "no shared-memory region named 'inflight'" in report["named afterwards"]
    # each opened handle closed once, when its last view is freed (a refused request's views
    # may wait for the garbage collector); the in-flight one after its unregister had returned
    opened = {"io-grpc", "io-http", "inflight", "places", "bad"}  # bad: larger than the buffer
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    while set(closed) != opened and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert {name: len(times) for name, times in closed.items()} == dict.fromkeys(opened, 1), closed
    assert closed["inflight"][0] > report["unregistered at"], (closed, report)
    assert report["nan input"].startswith("400: hidden_states holds NaN"), report
    assert "row 3, column 7" in report["nan input"]
    assert report["misaligned offset"].startswith("400"), report
    assert "is not a multiple of the FP32 element size" in report["misaligned offset"]
    assert report["another device"].startswith("400: device_id"), report
    assert "is not a GPU of this server" in report["another device"]
    assert report["invalid handle"].startswith("StatusCode.INVALID_ARGUMENT"), report
    assert "is not a CUDA IPC handle" in report["invalid handle"]
    assert "exceeds the CUDA buffer" in report["larger than the buffer"], report
    assert report["unregistered region"].startswith("400"), report
    assert "no shared-memory region named 'never'" in report["unregistered region"]


FREED_CLIENT = """
import sys
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.cuda_shared_memory as cudashm

x = np.ones((4, 256), np.float32)
region = cudashm.create_shared_memory_region("freed", 2 * x.nbytes, 0)
cudashm.set_shared_memory_region(region, [x])
client = grpcclient.InferenceServerClient(sys.argv[1])
client.register_cuda_shared_memory("freed", cudashm.get_raw_handle(region), 0, 2 * x.nbytes)
cudashm.destroy_shared_memory_region(region)  # freed, then the process exits
"""


def test_a_region_its_owner_freed_leaves_the_server_serving(server) -> None:
    """The client registers a buffer, frees it and exits; a request then names the region: it
    is answered (the server's open handle keeps the memory) or refused with a 400, and the GPU
    keeps serving."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    http, grpc, _ = server
    run = subprocess.run(
        [sys.executable, "-c", FREED_CLIENT, grpc],
        cwd=ROOT, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    client = grpcclient.InferenceServerClient(grpc)
    nbytes = 4 * 256 * 4
    tensor = grpcclient.InferInput("hidden_states", [4, 256], "FP32")
    tensor.set_shared_memory("freed", nbytes)
    output = grpcclient.InferRequestedOutput("output")
    output.set_shared_memory("freed", nbytes, offset=nbytes)
    try:
        client.infer("demo", [tensor], outputs=[output])
        status = "ok"
    except InferenceServerException as err:
        status = err.status()
    assert status in ("ok", "StatusCode.INVALID_ARGUMENT")
    client.unregister_cuda_shared_memory("freed")
    assert httpx.get(f"http://{http}/ready").status_code == 200
    again = httpx.post(
        f"http://{http}/v1/layers/demo/forward", json={"hidden_states": [[0.1] * 256]}
    )
    assert again.status_code == 200, again.text
