"""CUDA shared memory on the GPU: a client in a second process on the same GPU hands the
server a CUDA IPC handle (tritonclient.utils.cuda_shared_memory); the output written into its
buffer matches the reference, over HTTP and gRPC; bad handles are clear 400s."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from kernels.accuracy import relative_error
from kernels.layer import build_layer
from kernels.tensors import ForwardInputs
from service.app import create_app
from service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import free_port, running_server
from weights.load import load_layer

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
GPU_READY_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_S = 120.0
TOLERANCE = 2e-2  # the demo layer computes in bf16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    cache = tmp_path_factory.mktemp("cache")
    port = free_port()
    settings = Settings(
        device="cuda",
        cache_dir=cache,
        grpc_port=port,
        allow_shared_memory=True,
        max_batch_tokens=64,
    )
    with running_server(create_app(settings)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get, GPU_READY_TIMEOUT_S)
        yield url.removeprefix("http://"), f"127.0.0.1:{port}", cache


def test_cuda_shared_memory_round_trip_from_another_process(server, tmp_path: Path) -> None:
    http, grpc, cache = server
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
    for transport in ("http", "grpc"):
        out = torch.from_numpy(np.load(tmp_path / f"{transport}.npy"))
        assert relative_error(out, expected) < TOLERANCE, transport
    assert report["another device"].startswith("400: device_id"), report
    assert "is not a GPU of this server" in report["another device"]
    assert report["invalid handle"].startswith("StatusCode.INVALID_ARGUMENT"), report
    assert "is not a CUDA IPC handle" in report["invalid handle"]
    assert "exceeds the CUDA buffer" in report["larger than the buffer"], report
    assert report["unregistered region"].startswith("400"), report
    assert "no shared-memory region named 'never'" in report["unregistered region"]
