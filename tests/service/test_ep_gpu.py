"""`serve --ep 2` on two GPUs (NCCL, CUDA graphs): redundant copies of the hot experts
(`--ep-redundant`) answer like one process; a placement switch under traffic (every expert on
both ranks) loses or spoils no reply and leaves the layer captured again; then the service keeps
answering on rank 0 alone once rank 1 is killed (the first request right after the kill,
launched on the broken group, included).

Run on a machine with two GPUs:
    python3 -m pytest -q -m gpu tests/service/test_ep_gpu.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from moe_serve.kernels.accuracy import BY_DTYPE, SERVED_FP8_LAYER, relative_error
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.test_ep import _forward, _single_process
from tests.service.test_ep_resilience import Traffic, _hidden, _wait_for

pytestmark = pytest.mark.gpu

READY_TIMEOUT_S = 600.0  # both ranks compile and capture every bucket
SWITCH_TIMEOUT_S = 300.0  # both ranks load the new experts and capture the layer again
TOLERANCE = {"demo": BY_DTYPE[torch.bfloat16], "demo-fp8": SERVED_FP8_LAYER}


def _check_one(client: TestClient, cache: Path, layer: str, tokens: int, seed: int) -> None:
    hidden = _hidden(tokens, seed)
    got, want = _forward(client, layer, hidden), _single_process(cache, layer, hidden)
    assert relative_error(got, want) < TOLERANCE[layer], (layer, tokens, seed)


def _check(client: TestClient, cache: Path, tokens: int) -> None:
    for layer in TOLERANCE:
        _check_one(client, cache, layer, tokens, seed=tokens)


def test_two_gpus_with_graphs_replicate_switch_under_traffic_and_survive_a_lost_rank(
    tmp_path: Path, ends_through_leave: None
) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[name] = "0" if name == "NCCL_NVLS_ENABLE" else "1"  # KINDS.md: keep these set
    placement = tmp_path / "placement.json"
    counts = [50, 1, 1, 1, 1, 1, 1, 40]  # experts 0 and 7 hot: a copy of each on the other rank
    placement.write_text(json.dumps({"ranks": [[0, 1, 2, 3], [4, 5, 6, 7]], "counts": counts}))
    settings = Settings(
        device="cuda", ep=2, ep_placement=placement, ep_redundant=2, cache_dir=tmp_path,
        max_batch_tokens=512,
    )  # fmt: skip
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get, READY_TIMEOUT_S)
        engine = client.app.state.runtime.engine
        assert all(served.graphs is not None for served in engine.layers.values())
        ranks = client.get("/v1/layers/demo/placement").json()["ranks"]
        assert all(0 in ids and 7 in ids for ids in ranks), ranks
        for tokens in (1, 37, 300):
            _check(client, tmp_path, tokens)

        everywhere = [list(range(8)), list(range(8))]  # so that rank 0 can serve alone below
        with Traffic(lambda *case: _check_one(client, tmp_path, *case)) as traffic:
            _wait_for(lambda: traffic.replies >= 4, "replies before the switch")
            for layer in TOLERANCE:
                r = client.post(f"/v1/layers/{layer}/placement", json={"ranks": everywhere})
                assert r.status_code == 202, r.text
                _wait_for(
                    lambda layer=layer: (
                        client.get(f"/v1/layers/{layer}/placement").json()["rebalance"] == "done"
                    ),
                    f"{layer}'s switch",
                    SWITCH_TIMEOUT_S,
                )
            before = traffic.replies
            _wait_for(lambda: traffic.replies >= before + 6, "replies after the switches")
        assert not traffic.errors, traffic.errors[:3]
        assert client.get("/v1/layers/demo-fp8/placement").json()["ranks"] == everywhere
        assert all(served.graphs is not None for served in engine.layers.values())
        for tokens in (1, 300):
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
