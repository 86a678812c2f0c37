"""One process: the connection reads a large plain JSON forward's body straight into memory of its
own (service/http/forward_body.py; on a CPU, unpinned host memory), and the forward is answered as
when the app reads the body as bytes; what the app refuses is left to it."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from moe_serve.service.http.app import create_app
from moe_serve.service.off_loop import JSON
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import NO_ROUTER, TINY, H, running_server, tiny_loader

TOKEN = "forward-body-token-0123456789abc"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEADERS = {"Content-Type": "application/json"} | AUTH
LARGE = JSON.on_loop_bytes + 1  # JSON work on more leaves the event loop
MAX_JSON_BYTES = 8 * LARGE


def _settings() -> Settings:
    return Settings(device="cpu", grpc_port=0, api_token=TOKEN, max_json_bytes=MAX_JSON_BYTES)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, list[bool]]]:
    """A real server's URL, and whether its connections read each body into memory of its own."""
    app = create_app(_settings(), tiny_loader)
    sink, taken = app.state.body_sink, []

    def counting_sink(scope, size):  # a BodySink
        target = sink(scope, size)
        taken.append(target is not None)
        return target

    app.state.body_sink = counting_sink
    with running_server(app) as url:
        wait_ready(httpx.Client(base_url=url).get)
        taken.clear()
        yield url, taken


@pytest.fixture(scope="module")
def as_bytes() -> Iterator[TestClient]:
    """The same app, its bodies read as bytes (a TestClient has no connections)."""
    with TestClient(create_app(_settings(), tiny_loader)) as client:
        wait_ready(client.get)
        yield client


def _text(value: dict, at_least: int = LARGE) -> bytes:
    text = json.dumps(value).encode()
    return text + b" " * max(0, at_least - len(text))


def _rows(tokens: int, seed: int) -> list[list[float]]:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).tolist()


BODIES = {
    "padded": (TINY, _text({"hidden_states": _rows(3, 0)})),
    "rows": (TINY, _text({"hidden_states": _rows(600, 1)}, 0)),
    "router logits": (
        NO_ROUTER,
        _text({"hidden_states": _rows(5, 2), "router_logits": torch.randn(5, 4).tolist()}),
    ),
    "return routing": (TINY, _text({"hidden_states": _rows(7, 3), "return_routing": True})),
    "bad": (TINY, _text({"hidden_states": [[1.0, True]]})),
    "cut": (TINY, _text({"hidden_states": _rows(600, 4)}, 0)[:-100]),
    "no layer": ("nope", _text({"hidden_states": _rows(3, 5)})),
}


@pytest.mark.parametrize("case", BODIES)
def test_a_large_json_body_read_into_its_own_memory_is_answered_as_when_read_as_bytes(
    served, as_bytes: TestClient, case: str
) -> None:
    url, taken = served
    name, body = BODIES[case]
    assert len(body) >= LARGE
    path = f"/v1/layers/{name}/forward"
    taken.clear()
    reply = httpx.post(url + path, content=body, headers=HEADERS)
    expected = as_bytes.post(path, content=body, headers=HEADERS)
    assert taken == [True]
    assert reply.status_code == expected.status_code
    assert reply.headers["content-type"] == expected.headers["content-type"]
    assert reply.content == expected.content
    if reply.status_code == 200:
        assert len(json.loads(reply.content)["output"]) == len(json.loads(body)["hidden_states"])


_TWO_ROWS = {"hidden_states": _rows(2, 6)}
JSON_TYPE = {"Content-Type": "application/json"}
GZIP = {"Content-Encoding": "gzip"}
LEFT_TO_THE_APP = {  # the body, its headers, the status
    "small": (_text(_TWO_ROWS, 0), HEADERS, 200),
    "no token": (_text(_TWO_ROWS), JSON_TYPE, 401),
    "over the limit": (_text(_TWO_ROWS, MAX_JSON_BYTES + 1), HEADERS, 413),
    # compressed, still over LARGE
    "gzip": (gzip.compress(_text({"hidden_states": _rows(2000, 7)}, 0)), HEADERS | GZIP, 200),
}


@pytest.mark.parametrize("case", LEFT_TO_THE_APP)
def test_a_json_body_the_app_reads_or_refuses_itself_is_left_to_it(served, case: str) -> None:
    url, taken = served
    body, headers, status = LEFT_TO_THE_APP[case]
    assert (len(body) < LARGE) == (case == "small")
    taken.clear()
    reply = httpx.post(f"{url}/v1/layers/{TINY}/forward", content=body, headers=headers)
    assert reply.status_code == status, reply.text
    assert taken == [False]
