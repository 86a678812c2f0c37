"""`serve --ep 2` on two GPUs (NCCL, CUDA graphs): answers like one process, every replica set
up on both ranks, and keeps answering on rank 0 alone once rank 1 is killed (the first request
right after the kill, launched on the broken group, included).

Run on nvidia-h200-x2:
    source .deps/device-env.sh; python3 -m pytest -q -m gpu tests/service/test_ep_gpu.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from kernels.accuracy import BY_DTYPE, SERVED_FP8_LAYER, relative_error
from service.app import create_app
from service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.test_ep import _forward, _single_process

pytestmark = pytest.mark.gpu

READY_TIMEOUT_S = 600.0  # both ranks compile and capture every bucket
TOLERANCE = {"demo": BY_DTYPE[torch.bfloat16], "demo-fp8": SERVED_FP8_LAYER}


def _check(client: TestClient, cache: Path, tokens: int) -> None:
    for layer, tol in TOLERANCE.items():
        gen = torch.Generator().manual_seed(tokens)
        hidden = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).float()
        got, want = _forward(client, layer, hidden), _single_process(cache, layer, hidden)
        assert relative_error(got, want) < tol, (layer, tokens)


def test_two_gpus_with_graphs_answer_like_one_process_and_survive_a_lost_replica_rank(
    tmp_path: Path, ends_through_leave: None
) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (nvidia-h200-x2), found {torch.cuda.device_count()}")
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[name] = "0" if name == "NCCL_NVLS_ENABLE" else "1"  # KINDS.md: keep these set
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"ranks": [list(range(8)), list(range(8))]}))
    settings = Settings(
        device="cuda", ep=2, ep_placement=placement, cache_dir=tmp_path, max_batch_tokens=512
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get, READY_TIMEOUT_S)
        engine = client.app.state.runtime.engine
        assert all(served.graphs is not None for served in engine.layers.values())
        for tokens in (1, 37, 300):
            _check(client, tmp_path, tokens)
        engine.workers[0].kill()
        _check(client, tmp_path, 37)  # launched on the broken group: run again on the survivor
        deadline = time.monotonic() + 60
        while not client.get("/ready").json().get("degraded"):
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.1)
        for tokens in (1, 37):
            _check(client, tmp_path, tokens)
        assert client.get("/v1/layers/demo/placement").json()["live_ranks"] == [0]
