"""`--http-workers`: a JSON forward too large for a front end to decode goes to the engine as its
text, through the front end's arena (not relayed over HTTP), and is answered, byte for byte, as
one process answers the same body: replies, errors, a non-finite output, the token, the request
id, the metrics, and a reply longer than the room the arena keeps for it."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from moe_serve.kernels.arith import round_up
from moe_serve.service.frontends import channel_server
from moe_serve.service.frontends.arena import BLOCK_BYTES, REPLY_HEADER_BYTES
from moe_serve.service.frontends.supervisor import FrontEnds
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import (
    NO_ROUTER,
    TINY,
    H,
    reference_forward,
    running_front_ends,
    tiny_loader,
)

TOKEN = "front-end-json-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON_HEADERS = {"Content-Type": "application/json"} | AUTH
# A front end decodes JSON bodies up to this; a CPU engine's decode every JSON body up to
# MOE_SERVE_MAX_JSON_BYTES (a GPU engine's, up to off_loop.JSON.on_loop_bytes)
JSON_HERE_BYTES = 16 << 10
READ_TIMEOUT_S = 3.0
FORWARD_200 = 'moe_serve_requests_total{route="/v1/layers/{name}/forward",status="200"}'


def _settings() -> Settings:
    return Settings(
        device="cpu", http_workers=1, grpc_port=0, api_token=TOKEN, read_timeout_s=READ_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def front_ends() -> Iterator[FrontEnds]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "moe_serve.service.frontends.supervisor.json_here_bytes", lambda _: JSON_HERE_BYTES
        )
        with running_front_ends(_settings()) as running:
            assert running.config.json_here_bytes == JSON_HERE_BYTES
            yield running


@pytest.fixture(scope="module")
def one_process() -> Iterator[TestClient]:
    """The same layers served by one process, with the same settings."""
    with TestClient(create_app(_settings(), tiny_loader)) as client:
        wait_ready(client.get)
        yield client


@pytest.fixture
def engine_parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of each JSON body the engine parsed from a front end's arena."""
    parsed, serve_json_into = [], channel_server.serve_json_into

    async def spy(call, body, reply, withdrawn):
        parsed.append(len(body))
        return await serve_json_into(call, body, reply, withdrawn)

    monkeypatch.setattr(channel_server, "serve_json_into", spy)
    return parsed


def _url(front_ends: FrontEnds) -> str:
    return f"http://127.0.0.1:{front_ends.listener.getsockname()[1]}"


def _text(value: dict, at_least: int = JSON_HERE_BYTES + 1) -> bytes:
    """`value` as JSON of at least `at_least` bytes (padded with JSON's whitespace)."""
    text = json.dumps(value).encode()
    return text + b" " * max(0, at_least - len(text))


def _count(metrics: str, series: str) -> float:
    line = next((x for x in metrics.splitlines() if x.startswith(series + " ")), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def _rows(tokens: int, seed: int) -> list[list[float]]:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed)).tolist()


def _short_rows(tokens: int) -> list[list[float]]:
    """[tokens, H] numbers of a few bytes each as JSON (-2.0 to 1.75 in quarters): the reply's
    numbers are longer than the body's."""
    gen = torch.Generator().manual_seed(tokens)
    return (torch.randint(-8, 8, (tokens, H), generator=gen) / 4).tolist()


BODIES = {
    "3 tokens": (TINY, {"hidden_states": _rows(3, 0)}),
    "64 tokens": (TINY, {"hidden_states": _rows(64, 1)}),
    "router logits": (
        NO_ROUTER,
        {"hidden_states": _rows(5, 2), "router_logits": torch.randn(5, 4).tolist()},
    ),
    "return routing": (TINY, {"return_routing": True, "hidden_states": _rows(7, 3)}),
}


@pytest.mark.parametrize("case", BODIES)
def test_a_json_forward_too_large_to_decode_here_goes_through_the_arena_as_one_process_answers(
    front_ends, one_process, engine_parsed, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    name, value = BODIES[case]
    body = _text(value)
    rid = "json-" + case.replace(" ", "-")
    url = _url(front_ends)
    before = _count(httpx.get(f"{url}/metrics").text, FORWARD_200)
    with caplog.at_level(logging.INFO, logger="moe_serve.service.http.middleware"):
        reply = httpx.post(
            f"{url}/v1/layers/{name}/forward",
            content=body,
            headers=JSON_HEADERS | {"X-Request-ID": rid},
        )
    assert "/forward" not in caplog.text  # not relayed: the engine's server logs what it serves
    assert engine_parsed == [len(body)]  # parsed by the engine, from the arena
    expected = one_process.post(f"/v1/layers/{name}/forward", content=body, headers=JSON_HEADERS)
    assert (reply.status_code, expected.status_code) == (200, 200), reply.text
    assert reply.headers["content-type"] == expected.headers["content-type"]
    assert reply.content == expected.content
    assert reply.headers["X-Request-ID"] == rid
    x = torch.tensor(value["hidden_states"])
    logits = value.get("router_logits")
    torch.testing.assert_close(
        torch.tensor(reply.json()["output"]),
        reference_forward(name, x, None if logits is None else torch.tensor(logits)),
    )
    # counted once, by the engine, which keeps every metric
    assert _count(httpx.get(f"{url}/metrics").text, FORWARD_200) == before + 1


def test_a_reply_longer_than_the_room_the_arena_keeps_for_it_is_answered_whole(
    front_ends, one_process, engine_parsed
) -> None:
    body = _text({"hidden_states": _short_rows(400)})
    reply = httpx.post(f"{_url(front_ends)}/v1/layers/{TINY}/forward", content=body,
                       headers=JSON_HEADERS)  # fmt: skip
    expected = one_process.post(f"/v1/layers/{TINY}/forward", content=body, headers=JSON_HEADERS)
    assert (reply.status_code, expected.status_code) == (200, 200), reply.text
    assert engine_parsed == [len(body)]
    assert len(reply.content) > round_up(len(body) + REPLY_HEADER_BYTES, BLOCK_BYTES)
    assert reply.content == expected.content


def _bad(rows: list[list[float]]) -> dict:
    return {"hidden_states": rows}


BAD_BODIES = {
    "true": (TINY, _text({"hidden_states": [[1.0, True], *_rows(40, 4)]})),
    "cut": (TINY, _text(_bad(_rows(40, 5)))[:-200]),
    "unknown-field": (TINY, _text({"hidden": _rows(40, 6)})),
    "width": (TINY, _text(_bad(torch.randn(200, 2).tolist()))),
    "ragged": (TINY, _text(_bad([*_rows(40, 7), [1.0]]))),
    "beyond-float32": (TINY, _text(_bad([[1e39] * H, *_rows(40, 8)]))),
    "routing-not-a-bool": (TINY, _text({"hidden_states": _rows(40, 9), "return_routing": 1})),
    "no-layer": ("nope", _text(_bad(_rows(40, 10)))),
    "no-router": (NO_ROUTER, _text(_bad(_rows(40, 11)))),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_a_bad_json_body_through_the_arena_gets_the_error_one_process_gives(
    front_ends, one_process, engine_parsed, case: str
) -> None:
    name, body = BAD_BODIES[case]
    assert len(body) > JSON_HERE_BYTES
    url = f"/v1/layers/{name}/forward"
    reply = httpx.post(_url(front_ends) + url, content=body, headers=JSON_HEADERS)
    expected = one_process.post(url, content=body, headers=JSON_HEADERS)
    assert 400 <= reply.status_code < 500
    assert (reply.status_code, reply.json()) == (expected.status_code, expected.json())
    assert reply.headers["X-Request-ID"]
    assert engine_parsed == ([] if case == "no-layer" else [len(body)])


def test_an_output_that_overflows_is_the_error_one_process_gives(front_ends, one_process) -> None:
    rows = _rows(40, 12)
    rows[1][3] = 1e30  # float32 holds it; the experts' products do not
    body = _text(_bad(rows))
    url = f"/v1/layers/{TINY}/forward"
    reply = httpx.post(_url(front_ends) + url, content=body, headers=JSON_HEADERS)
    expected = one_process.post(url, content=body, headers=JSON_HEADERS)
    assert reply.status_code == 422
    assert reply.json() == expected.json()
    assert reply.json()["error"].startswith(f"the output of layer '{TINY}' holds NaN or Inf")


def test_without_the_token_a_large_json_forward_is_401(front_ends, engine_parsed) -> None:
    body = _text(_bad(_rows(40, 13)))
    reply = httpx.post(
        f"{_url(front_ends)}/v1/layers/{TINY}/forward",
        content=body,
        headers={"Content-Type": "application/json"},
    )
    assert reply.status_code == 401
    assert reply.headers["WWW-Authenticate"] == "Bearer"
    assert engine_parsed == []


def test_a_large_json_body_that_stalls_gets_408(front_ends, engine_parsed) -> None:
    port = front_ends.listener.getsockname()[1]
    head = (
        f"POST /v1/layers/{TINY}/forward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {4 * JSON_HERE_BYTES}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(head.encode() + b'{"hidden_states": [[')
        conn.settimeout(10 * READ_TIMEOUT_S)
        status = conn.recv(4096).decode("latin-1").split("\r\n", 1)[0]
    assert status == "HTTP/1.1 408 Request Timeout"
    assert engine_parsed == []
