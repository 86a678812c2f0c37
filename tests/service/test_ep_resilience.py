"""`serve --ep N` with replicated experts, a rank killed, a placement switched under traffic and
a rank joining as another host: every reply must equal the single-process layer's.

Each app spawns real ranks (gloo on the CPU) and loads the demo layers (E=8) from disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from moe_serve.service.ep.group import Rendezvous, free_port
from moe_serve.service.ep.worker import run_rank
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.weights.demo import ensure_demo_layers
from tests.service.conftest import wait_ready
from tests.service.test_ep import _forward, _single_process

TOL = 1e-2  # bf16 demo layers: only the summation order differs
WAIT_S = 30.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("ep_cache")
    ensure_demo_layers(cache)
    return cache


@pytest.fixture(scope="module")
def expected(demo_cache: Path) -> Callable[[str, torch.Tensor], torch.Tensor]:
    return lambda layer, hidden: _single_process(demo_cache, layer, hidden)


@contextlib.contextmanager
def _app(cache: Path, **settings: object) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(device="cpu", cache_dir=cache, **settings))) as client:
        wait_ready(client.get, WAIT_S)
        yield client


def _hidden(tokens: int, seed: int) -> torch.Tensor:
    """Values the bf16 demo layers hold exactly: the service rounds its input to the layer's
    dtype before routing, and a near tie may route float32 input elsewhere."""
    hidden = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed))
    return hidden.to(torch.bfloat16).float()


def _check(client: TestClient, expected: Callable, layer: str, tokens: int, seed: int) -> None:
    hidden = _hidden(tokens, seed)
    got, want = _forward(client, layer, hidden), expected(layer, hidden)
    assert (got - want).norm() / want.norm() < TOL, (layer, tokens, seed)


def _metric(client: TestClient, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {line_start}")


def _placement_file(tmp_path: Path, ranks: list[list[int]], **extra: object) -> Path:
    file = tmp_path / "placement.json"
    file.write_text(json.dumps({"ranks": ranks, **extra}))
    return file


def _checks(client: TestClient, expected: Callable) -> Callable[[str, int, int], None]:
    return lambda layer, tokens, seed: _check(client, expected, layer, tokens, seed)


class Traffic:
    """Threads sending forwards until stopped; `check(layer, tokens, seed)` sends one and checks
    the reply against one process (an AssertionError: a wrong or lost reply)."""

    def __init__(self, check: Callable[[str, int, int], None], threads: int = 2) -> None:
        self.check = check
        self.errors: list[str] = []
        self.replies = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, index: int) -> None:
        seed = index * 1000
        while not self._stop.is_set():
            seed += 1
            layer, tokens = ("demo", "demo-fp8")[seed % 2], 1 + seed % 23
            try:
                self.check(layer, tokens, seed)
                self.replies += 1
            except AssertionError as err:
                self.errors.append(repr(err))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def _wait_for(condition: Callable[[], object], what: str, timeout_s: float = WAIT_S) -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_redundant_copies_of_hot_experts_answer_like_one_process_and_report_balance(
    demo_cache: Path, expected: Callable, tmp_path: Path
) -> None:
    counts = [50, 1, 1, 1, 1, 1, 1, 40]  # experts 0 and 7 hot
    file = _placement_file(tmp_path, [[0, 1, 2], [3, 4, 5], [6, 7]], counts=counts)
    with _app(demo_cache, ep=3, ep_placement=file, ep_redundant=2) as client:
        placement = client.get("/v1/layers/demo/placement").json()
        holders = {e: [r for r, ids in enumerate(placement["ranks"]) if e in ids] for e in (0, 7)}
        assert len(holders[0]) == 2 and len(holders[7]) == 2, placement
        assert placement["live_ranks"] == [0, 1, 2]
        for layer in ("demo", "demo-fp8"):
            for tokens in (1, 7, 40):
                _check(client, expected, layer, tokens, seed=tokens)
        assert 0 < _metric(client, 'moe_serve_ep_balancedness{layer="demo"}') <= 1
        assert _metric(client, "moe_serve_ep_live_ranks") == 3
        assert _metric(client, "moe_serve_ep_degraded") == 0
        counts_seen = client.get("/v1/layers/demo/placement").json()["expert_tokens"]
        assert sum(counts_seen) == 2 * (1 + 7 + 40 + 1)  # top-2, + the warm-up token


def test_a_killed_rank_whose_experts_have_copies_degrades_and_keeps_answering(
    demo_cache: Path, expected: Callable, tmp_path: Path
) -> None:
    file = _placement_file(tmp_path, [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]])
    with _app(demo_cache, ep=3, ep_placement=file) as client:
        with Traffic(_checks(client, expected)) as traffic:
            _wait_for(lambda: traffic.replies >= 4, "replies before the kill")
            client.app.state.runtime.engine.workers[1].kill()  # rank 2
            _wait_for(lambda: client.get("/ready").json().get("degraded"), "degraded")
            before = traffic.replies
            _wait_for(lambda: traffic.replies >= before + 6, "replies after the kill")
        assert not traffic.errors, traffic.errors[:3]
        body = client.get("/ready")
        assert body.status_code == 200 and body.json()["degraded"] is True
        reason = body.json()["reason"]
        assert "rank 2 exited" in reason and "serving on ranks [0, 1]" in reason, reason
        assert _metric(client, "moe_serve_ep_degraded") == 1
        assert _metric(client, "moe_serve_ep_live_ranks") == 2
        assert client.get("/v1/layers/demo/placement").json()["live_ranks"] == [0, 1]


def test_a_killed_rank_holding_the_only_copy_of_an_expert_turns_everything_503(
    demo_cache: Path, tmp_path: Path
) -> None:
    file = _placement_file(tmp_path, [[0, 1, 2, 3, 4], [0, 1, 5], [2, 3, 4, 6, 7]])
    with _app(demo_cache, ep=3, ep_placement=file) as client:
        client.app.state.runtime.engine.workers[1].kill()  # rank 2: experts 6, 7 only there
        ready = _wait_for(lambda: (r := client.get("/ready")).status_code == 503 and r, "503")
        reason = ready.json()["reason"]
        assert "rank 2 exited" in reason and "experts [6, 7] have no copy" in reason, reason
        r = client.post("/v1/layers/demo/forward", json={"hidden_states": [[0.5] * 256]})
        assert r.status_code == 503 and "rank 2 exited" in r.json()["error"]
        assert _metric(client, "moe_serve_ep_live_ranks") == 0


def test_placement_switches_under_traffic_without_a_wrong_or_lost_reply(
    demo_cache: Path, expected: Callable
) -> None:
    with _app(demo_cache, ep=2) as client, Traffic(_checks(client, expected)) as traffic:
        _wait_for(lambda: traffic.replies >= 4, "replies before the switch")
        ranks = [[7, 6, 0, 1], [2, 3, 4, 5, 0, 6]]
        r = client.post("/v1/layers/demo/placement", json={"ranks": ranks})
        assert r.status_code == 202, r.text
        assert r.json() == {"layer": "demo", "ranks": ranks, "rebalance": "staging"}
        done = _wait_for(
            lambda: (
                (p := client.get("/v1/layers/demo/placement").json())["rebalance"] == "done" and p
            ),
            "the switch",
        )
        assert done["ranks"] == ranks
        before = traffic.replies
        _wait_for(lambda: traffic.replies >= before + 4, "replies after the switch")
        r = client.post("/v1/layers/demo/placement", json={"placement": "auto"})
        assert r.status_code == 202, r.text
        auto = r.json()["ranks"]
        assert sum(map(len, auto)) == 10  # as many redundant copies (2) as the placement had
        _wait_for(
            lambda: client.get("/v1/layers/demo/placement").json()["ranks"] == auto, "auto switch"
        )
        before = traffic.replies
        _wait_for(lambda: traffic.replies >= before + 4, "replies after the auto switch")
        r = client.post("/v1/layers/demo-fp8/placement", json={"placement": "auto", "redundant": 3})
        assert r.status_code == 202 and sum(map(len, r.json()["ranks"])) == 11, r.text
        _wait_for(
            lambda: client.get("/v1/layers/demo-fp8/placement").json()["rebalance"] == "done",
            "the fp8 layer's switch",
        )
        before = traffic.replies
        _wait_for(lambda: traffic.replies >= before + 4, "replies after the fp8 layer's switch")
    assert not traffic.errors, traffic.errors[:3]


def test_bad_placements_are_refused_naming_the_problem(demo_cache: Path) -> None:
    refused = [
        ({"ranks": [[0, 1, 2], [3, 4, 5]]}, 400, "missing [6, 7]"),
        ({"ranks": [[0, 1, 2, 3, 4, 5, 6, 7]]}, 400, "lists 1 ranks, the group has 2"),
        ({"ranks": [[0, 0, 1, 2, 3], [4, 5, 6, 7]]}, 400, "rank 0 lists experts [0] more"),
        ({"placement": "even"}, 400, "placement"),
        ({}, 400, 'either "ranks" or "placement": "auto"'),
        ({"ranks": [[0, 1, 2, 3], [4, 5, 6, 7]], "redundant": 1}, 400, '"redundant" goes with'),
        ({"placement": "auto", "redundant": 9}, 400, "9 redundant copies do not fit"),
    ]
    with _app(demo_cache, ep=2) as client:
        for body, status, message in refused:
            r = client.post("/v1/layers/demo/placement", json=body)
            assert r.status_code == status and message in r.json()["error"], r.text
        r = client.post("/v1/layers/nope/placement", json={"placement": "auto"})
        assert r.status_code == 404
        assert client.get("/v1/layers/demo/placement").json()["rebalance"] == "none"


def test_placements_need_expert_parallelism(make_client: Callable[..., TestClient]) -> None:
    client = make_client()
    for r in (
        client.get("/v1/layers/tiny/placement"),
        client.post("/v1/layers/tiny/placement", json={"placement": "auto"}),
    ):
        assert r.status_code == 409 and "--ep N" in r.json()["error"], r.text


@contextlib.contextmanager
def _other_host(
    monkeypatch: pytest.MonkeyPatch, rank: int, world: int
) -> Iterator[subprocess.Popen]:
    """`moe-serve ep-rank` as rank `rank` in its own process, as another host would run it;
    rank 0 (this process) serves the store at MASTER_ADDR:MASTER_PORT."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "moe_serve.service.cli", "ep-rank", "--device", "cpu"],
        cwd=ROOT,
        env=env,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()


def test_a_rank_from_another_host_joins_through_the_torch_distributed_environment(
    demo_cache: Path, expected: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _other_host(monkeypatch, rank=1, world=2) as other_host:
        with _app(demo_cache, ep=2, ep_local_ranks=1) as client:
            assert client.app.state.runtime.engine.workers == []  # no rank spawned here
            for layer in ("demo", "demo-fp8"):
                _check(client, expected, layer, tokens=9, seed=9)
        assert other_host.wait(timeout=WAIT_S) == 0  # it leaves when rank 0 does


def test_a_silent_rank_of_another_host_is_served_around_after_its_heartbeat_stops(
    demo_cache: Path, expected: Callable, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("moe_serve.service.ep.engine.HEARTBEAT_TIMEOUT_S", 2.0)
    file = _placement_file(tmp_path, [list(range(8)), list(range(8))])
    with (
        _other_host(monkeypatch, rank=1, world=2) as other_host,
        _app(demo_cache, ep=2, ep_local_ranks=1, ep_placement=file) as client,
        Traffic(_checks(client, expected)) as traffic,
    ):
        _wait_for(lambda: traffic.replies >= 4, "replies before the kill")
        other_host.kill()
        _wait_for(lambda: client.get("/ready").json().get("degraded"), "degraded")
        before = traffic.replies
        _wait_for(lambda: traffic.replies >= before + 4, "replies after the kill")
        reason = client.get("/ready").json()["reason"]
        assert "rank 1 sent no heartbeat" in reason and "serving on ranks [0]" in reason, reason
        r = client.post("/v1/layers/demo/placement", json={"placement": "auto"})
        assert r.status_code == 409 and "cannot rebalance: rank 1" in r.json()["error"], r.text
    assert not traffic.errors, traffic.errors[:3]


def test_a_rank_that_cannot_load_keeps_the_service_unready_naming_it(
    demo_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    errors: list[Exception] = []

    def rank1_on_another_device() -> None:  # as `ep-rank --device` of the wrong kind
        try:
            run_rank(1, Rendezvous("127.0.0.1", port, 2), torch.device("meta"))
        except ValueError as err:
            errors.append(err)

    rank1 = threading.Thread(target=rank1_on_another_device)
    rank1.start()
    app = create_app(Settings(device="cpu", cache_dir=demo_cache, ep=2, ep_local_ranks=1))
    with TestClient(app) as client:
        reason = _wait_for(
            lambda: (
                "loading the layers failed" in (r := client.get("/ready").json()["reason"]) and r
            ),
            "the failed start",
        )
    rank1.join(WAIT_S)
    assert "rank 1 failed to load: ValueError: rank 0 runs on cpu, rank 1 on meta" in reason
    assert len(errors) == 1
