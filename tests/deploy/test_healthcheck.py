"""The image's and the compose file's health checks, run as written against a real server: healthy
only once /ready answers 200, unhealthy while it answers 503 or nothing listens."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.deploy.files import Stage
from tests.service.conftest import wait_ready
from tests.service.layers import running_server, tiny_loader

FAIL_TIMEOUT_S = 20.0


def failing_loader(settings: Settings, devices: Sequence[torch.device]) -> list[Any]:
    raise ValueError("weights missing")


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


@pytest.fixture(scope="module")
def ready_port() -> Iterator[int]:
    with running_server(create_app(Settings(device="cpu"), tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield port_of(url)


@pytest.fixture(scope="module")
def failed_port() -> Iterator[int]:
    """A server whose layers failed to load: it answers, but /ready stays 503."""
    with running_server(create_app(Settings(device="cpu"), failing_loader)) as url:
        deadline = time.monotonic() + FAIL_TIMEOUT_S
        while "weights missing" not in httpx.get(f"{url}/ready").text:
            assert time.monotonic() < deadline, "the load failure never reached /ready"
            time.sleep(0.01)
        yield port_of(url)


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:  # bound then closed: nothing listens there any more
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=["dockerfile", "compose"])
def healthy(
    request: pytest.FixtureRequest, stages: list[Stage], serving: dict[str, Any]
) -> Callable[[int], bool]:
    """healthy(port) -> whether the health check, run the container's way, exits 0."""
    if request.param == "dockerfile":
        program, *args = stages[-1].all("HEALTHCHECK")[-1].exec_form()
    else:
        kind, program, *args = serving["healthcheck"]["test"]
        assert kind == "CMD"
    assert program == "python3"  # in the image: the venv's python, first on PATH

    def run(port: int) -> bool:
        env = {**os.environ, "MOE_SERVE_PORT": str(port)}
        return subprocess.run([sys.executable, *args], env=env, timeout=10).returncode == 0

    return run


def test_health_check_passes_once_ready(healthy: Callable[[int], bool], ready_port: int) -> None:
    assert healthy(ready_port)


def test_health_check_fails_while_ready_answers_503(
    healthy: Callable[[int], bool], failed_port: int
) -> None:
    assert not healthy(failed_port)


def test_health_check_fails_when_nothing_listens(
    healthy: Callable[[int], bool], closed_port: int
) -> None:
    assert not healthy(closed_port)
