"""A TestClient around create_app with the tiny layers, ready before the test starts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.layers import tiny_loader

READY_TIMEOUT_S = 20.0


def wait_ready(get: Callable[[str], httpx.Response], timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while get("/ready").status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout_s} s: {get('/ready').text}")
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read MOE_SERVE_* variables: keep the developer's own out of the tests."""
    import os

    for name in list(os.environ):
        if name.startswith("MOE_SERVE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MOE_SERVE_GRPC_PORT", "0")  # as tests/conftest.py sets them
    monkeypatch.setenv("MOE_SERVE_METRICS_PORT", "0")


@pytest.fixture
def make_client() -> Iterator[Callable[..., TestClient]]:
    """make_client(**settings) -> a ready TestClient on the tiny layers."""
    clients: list[TestClient] = []

    def make(**settings: object) -> TestClient:
        client = TestClient(create_app(Settings(device="cpu", **settings), tiny_loader))
        client.__enter__()
        clients.append(client)
        wait_ready(client.get)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


_ENDS_THROUGH_LEAVE = pytest.StashKey[bool]()
_EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture
def ends_through_leave(request: pytest.FixtureRequest) -> None:
    """For a test that forms NCCL groups in this process (rank 0 of `serve --ep` on GPUs): torch's
    groups, torn down at the interpreter's exit, call std::terminate (status 134 after a passing
    test, 2 x H200), so pytest's process ends as the service's rank 0 does, through
    ep_group.leave, once its summary is out."""
    request.config.stash[_ENDS_THROUGH_LEAVE] = True


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_ENDS_THROUGH_LEAVE, False):
        from moe_serve.service.ep.group import leave

        leave(config.stash.get(_EXIT_STATUS, 1))
