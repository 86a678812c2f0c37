"""`serve --ep 2` on the CPU (gloo): rank 0 serves HTTP, rank 1 is a spawned process.

Each app here spawns a real second rank, loads the demo layers from disk on both ranks and
answers like the single-process service.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.cli import main
from moe_serve.service.engine.pipeline import BadRouting
from moe_serve.service.ep.engine import EPEngine, _EPBatch
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.weights.demo import ensure_demo_layers
from moe_serve.weights.load import load_layer
from tests.service.conftest import wait_ready

FAIL_FAST_S = 5.0


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("ep_cache")
    ensure_demo_layers(cache)
    return cache


@contextlib.contextmanager
def _ep_app(cache: Path, ready: bool = True, **settings: object) -> Iterator[TestClient]:
    app = create_app(Settings(device="cpu", ep=2, cache_dir=cache, **settings))
    with TestClient(app) as client:
        if ready:
            wait_ready(client.get)
        yield client


@pytest.fixture
def ep_client(demo_cache: Path) -> Iterator[Callable[..., TestClient]]:
    """ep_client(**settings) -> a TestClient around a fresh 2-rank app on the demo layers.

    A process joins one torch.distributed group at a time, so apps never overlap in time."""
    with contextlib.ExitStack() as stack:
        yield lambda **settings: stack.enter_context(_ep_app(demo_cache, **settings))


def _single_process(cache: Path, layer: str, hidden: torch.Tensor) -> torch.Tensor:
    source = load_layer(cache / layer, torch.device("cpu"))
    moe, _ = build_layer(source.config, source.weights, torch.device("cpu"), "reference")
    with torch.inference_mode():
        return moe.forward(ForwardInputs(hidden)).output.float()


def _forward(client: TestClient, layer: str, hidden: torch.Tensor) -> torch.Tensor:
    r = client.post(f"/v1/layers/{layer}/forward", json={"hidden_states": hidden.tolist()})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json()["output"])


def test_two_rank_service_answers_like_the_single_process_layer(
    ep_client: Callable[..., TestClient], demo_cache: Path
) -> None:
    served = ep_client()
    for layer, tokens in itertools.product(("demo", "demo-fp8"), (1, 37)):
        hidden = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
        got = _forward(served, layer, hidden)
        expected = _single_process(demo_cache, layer, hidden)
        assert (got - expected).norm() / expected.norm() < 1e-2


def _replicated(tmp_path: Path) -> Path:
    """Every demo expert on both ranks: rank 0 can serve alone."""
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"ranks": [list(range(8)), list(range(8))]}))
    return placement


def test_a_batch_in_flight_counts_its_load_from_the_routing_it_brings_back(
    ep_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    engine = ep_client(ep_placement=_replicated(tmp_path)).app.state.runtime.engine
    parts = [ForwardInputs(torch.randn(5, 256)), ForwardInputs(torch.randn(4, 256))]
    pending = engine.start("demo", parts)  # the CPU's synchronous forward counted it already
    before = sum(engine.placement("demo")["expert_tokens"])
    result = _EPBatch(engine, "demo", parts, None, engine.gen, pending).result()
    assert result is pending.result()  # no rerun: the group is whole
    placement = engine.placement("demo")
    assert sum(placement["expert_tokens"]) == before + 2 * (5 + 4)  # 9 tokens, top-2
    # every expert on both ranks: token t's pairs go to rank t mod 2, 10 pairs against 8
    assert placement["balancedness"] == pytest.approx(9 / 10)


class _Broken:
    """A batch whose result raises, as one can once its group is aborted."""

    def result(self) -> None:
        raise BadRouting("the forward brought back routing ids that name no expert")


@pytest.mark.parametrize("came_back", ["unfinished", "raising"])
def test_a_batch_whose_group_was_aborted_under_it_runs_again_on_the_survivors(
    ep_client: Callable[..., TestClient], demo_cache: Path, tmp_path: Path, came_back: str
) -> None:
    engine = ep_client(ep_placement=_replicated(tmp_path)).app.state.runtime.engine
    hidden = torch.randn(9, 256, generator=torch.Generator().manual_seed(9))
    parts = [ForwardInputs(hidden)]
    launched_on = engine.gen
    stale = engine.start("demo", parts)  # on the GPU: its forward still running when...
    if came_back == "raising":
        stale = _Broken()
    engine.workers[0].kill()  # ...rank 1 dies, and the group is aborted (NCCL: data unfinished)
    engine.workers[0].join()
    launched_on.abort()
    result = _EPBatch(engine, "demo", parts, None, launched_on, stale).result()
    assert engine.gen is not launched_on and engine.members == [0]
    assert "rank 1 exited" in engine.degraded
    expected = _single_process(demo_cache, "demo", hidden)
    got = result.outputs[0].output.float()
    assert (got - expected).norm() / expected.norm() < 1e-2


def test_backends_show_naive_ep_and_the_experts_per_rank(
    ep_client: Callable[..., TestClient],
) -> None:
    body = ep_client().get("/backends").json()
    for layer in body["layers"]:
        assert layer["prepare_finalize"] == "naive-ep"
        assert "experts over 2 ranks, per rank [4, 4]" in layer["reason"]
    stage = next(s for s in body["prepare_finalize"] if s["name"] == "naive-ep")
    assert stage["available"], stage["reason"]


def test_placement_file_decides_which_rank_holds_which_expert(
    ep_client: Callable[..., TestClient], demo_cache: Path, tmp_path: Path
) -> None:
    placement = tmp_path / "placement.json"
    placement.write_text('{"ranks": [[7, 2, 5], [0, 1, 3, 4, 6]]}')
    client = ep_client(ep_placement=placement)
    hidden = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    expected = _single_process(demo_cache, "demo", hidden)
    assert (_forward(client, "demo", hidden) - expected).norm() / expected.norm() < 1e-2
    reasons = [layer["reason"] for layer in client.get("/backends").json()["layers"]]
    assert all("per rank [3, 5]" in reason for reason in reasons)


def test_bad_placement_file_keeps_the_service_unready_naming_the_file(
    ep_client: Callable[..., TestClient], tmp_path: Path
) -> None:
    placement = tmp_path / "placement.json"
    placement.write_text('{"ranks": [[0, 1, 2], [3, 4, 5]]}')  # experts 6 and 7 nowhere
    client = ep_client(ready=False, ep_placement=placement)
    deadline = time.monotonic() + 30
    while "loading the layers failed" not in (reason := client.get("/ready").json()["reason"]):
        assert time.monotonic() < deadline, reason
        time.sleep(0.05)
    assert str(placement) in reason and "missing [6, 7]" in reason


def test_a_start_that_fails_once_the_ranks_are_up_stops_them(
    ep_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure after the ranks joined (here the warm-up's) leaves the service unready naming
    it, as any failed start, and the other ranks stopped, not left waiting for commands (on
    the H200 the EP service test ran past its time limit after such a failure)."""
    engines: list[EPEngine] = []

    def failing_warm_up(self: EPEngine, *_args: object, **_kwargs: object) -> None:
        engines.append(self)
        raise RuntimeError("the warm-up failed")

    monkeypatch.setattr(EPEngine, "warm_up", failing_warm_up)
    client = ep_client(ready=False)
    deadline = time.monotonic() + 30
    while "loading the layers failed" not in (reason := client.get("/ready").json()["reason"]):
        assert time.monotonic() < deadline, reason
        time.sleep(0.05)
    assert "the warm-up failed" in reason
    (engine,) = engines
    assert engine.workers and not any(worker.is_alive() for worker in engine.workers)


def test_a_dead_rank_turns_ready_and_requests_into_503_without_hanging(
    ep_client: Callable[..., TestClient],
) -> None:
    client = ep_client()
    client.app.state.runtime.engine.workers[0].kill()
    deadline = time.monotonic() + FAIL_FAST_S
    while (ready := client.get("/ready")).status_code == 200:
        assert time.monotonic() < deadline, "/ready still 200 after rank 1 died"
        time.sleep(0.05)
    assert ready.status_code == 503 and "rank 1 exited" in ready.json()["reason"]
    started = time.monotonic()
    r = client.post("/v1/layers/demo/forward", json={"hidden_states": [[0.5] * 256]})
    assert r.status_code == 503 and "rank 1 exited" in r.json()["error"]
    assert time.monotonic() - started < FAIL_FAST_S


def test_serve_ep_refuses_a_backend_that_cannot_hold_a_slice_of_the_experts(
    demo_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MOE_SERVE_EP", "2")
    layer = demo_cache / "demo"
    args = ["serve", "--weights", str(layer), "--backend", "reference-batched", "--device", "cpu"]
    assert main(args) == 2
    assert f"{layer}: backend 'reference-batched' cannot run this layer" in caplog.text
    assert "naive-ep) dispatches in the standard format" in caplog.text
