"""`--http-workers`: front-end processes that lay binary forwards (and JSON ones, decoded, or as
their text) in shared memory for the engine process and relay everything else; replies equal
the one-process service's, metrics are the engine's, a dead front end comes back, and nothing
the arena holds is handed out twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from moe_serve.service import logs, off_loop
from moe_serve.service.codecs import json_tensors
from moe_serve.service.codecs.json_numbers import (
    FLOAT32_MAX,
    NUMBER_BYTES,
    decode_forward_arrays,
)
from moe_serve.service.codecs.safetensors_wire import decode_safetensors, encode_safetensors
from moe_serve.service.frontends.arena import BLOCK_BYTES, REPLY_HEADER_BYTES, BodyArena
from moe_serve.service.frontends.engine_state import STALE_S, StateBlock
from moe_serve.service.frontends.front_end import (
    RELAYED,
    FrontEnd,
    FrontEndConfig,
    _Answer,
    _blob_bytes,
    _json_reply,
    _write_blob,
)
from moe_serve.service.frontends.supervisor import json_here_bytes, remove_stale_directories
from moe_serve.service.http.plain_forward import FORWARD_PATH
from moe_serve.service.http.server import MAX_HEAD_BYTES
from moe_serve.service.settings import Settings
from tests.service.layers import NO_ROUTER, TINY, H, reference_forward, running_front_ends
from tests.service.test_connections import _await_499, _final_answers
from tests.service.test_grpc_limits import serving
from tests.service.test_wire import HOSTILE_HEADERS

BINARY = {"Content-Type": "application/octet-stream"}
TOKEN = "front-end-test-token-0123456789"
WAIT_S = 30.0  # what a test waits for an answer before calling it a hang
FORWARD_200 = 'moe_serve_requests_total{route="/v1/layers/{name}/forward",status="200"}'


def _url(front_ends) -> str:
    return f"http://127.0.0.1:{front_ends.listener.getsockname()[1]}"


def _blob(x: torch.Tensor, **more: torch.Tensor) -> bytes:
    return encode_safetensors({"hidden_states": x, **more}, {})


def _count(metrics: str, series: str) -> float:
    line = next((x for x in metrics.splitlines() if x.startswith(series + " ")), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def front_ends():
    with running_front_ends(Settings(device="cpu", http_workers=2, grpc_port=0)) as running:
        yield running


def test_binary_forwards_take_the_shared_memory_path_and_match_the_reference(
    front_ends, caplog: pytest.LogCaptureFixture
) -> None:
    url = _url(front_ends)
    before = _count(httpx.get(f"{url}/metrics").text, FORWARD_200)
    rows = [torch.randn(t, H, generator=torch.Generator().manual_seed(t)) for t in (1, 3, 17, 64)]
    with (
        caplog.at_level(logging.INFO, logger="moe_serve.service.http.middleware"),
        ThreadPoolExecutor(8) as pool,
    ):
        replies = list(
            pool.map(
                lambda x: httpx.post(
                    f"{url}/v1/layers/{TINY}/forward", content=_blob(x), headers=BINARY
                ),
                rows * 4,
            )
        )
    for x, reply in zip(rows * 4, replies, strict=True):
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "application/octet-stream"
        out = decode_safetensors(reply.content)["output"]
        torch.testing.assert_close(out, reference_forward(TINY, x), rtol=1e-5, atol=1e-5)
    # answered by the front ends (the engine's HTTP server logs every request it serves) ...
    assert "/forward" not in caplog.text
    # ... and counted by the engine, which keeps every metric
    after = _count(httpx.get(f"{url}/metrics").text, FORWARD_200)
    assert after - before == len(replies)


def test_client_router_logits_and_bf16_bodies_go_through(front_ends) -> None:
    url = _url(front_ends)
    x = torch.randn(5, H).bfloat16()
    logits = torch.randn(5, 4).bfloat16()
    reply = httpx.post(
        f"{url}/v1/layers/{NO_ROUTER}/forward",
        content=_blob(x, router_logits=logits),
        headers=BINARY,
    )
    assert reply.status_code == 200, reply.text
    out = decode_safetensors(reply.content)["output"]
    assert out.dtype == torch.bfloat16
    expected = reference_forward(NO_ROUTER, x.float(), logits.float())
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_other_requests_are_relayed_to_the_engine(front_ends) -> None:
    url = _url(front_ends)
    x = torch.randn(2, H)
    routed = httpx.post(
        f"{url}/v1/layers/{TINY}/forward?return_routing=true", content=_blob(x), headers=BINARY
    )
    assert routed.status_code == 200
    assert set(decode_safetensors(routed.content)) == {"output", "topk_ids", "topk_weights"}
    as_json = httpx.post(f"{url}/v1/layers/{TINY}/forward", json={"hidden_states": x.tolist()})
    assert as_json.status_code == 200
    torch.testing.assert_close(
        torch.tensor(as_json.json()["output"]), reference_forward(TINY, x), rtol=1e-5, atol=1e-5
    )
    listed = httpx.get(f"{url}/v1/layers", headers={"X-Request-ID": "relay-1"})
    assert [layer["name"] for layer in listed.json()["layers"]] == [TINY, NO_ROUTER]
    assert listed.headers["X-Request-ID"] == "relay-1"
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200


@pytest.mark.parametrize(
    ("layer", "body", "status", "message"),
    [
        ("nope", _blob(torch.randn(1, H)), 404, "no layer named 'nope'"),
        (TINY, b"not a blob at all", 400, "body is not a valid safetensors blob"),
        (TINY, _blob(torch.randn(2, H + 1)), 400, "hidden_states"),
        (TINY, _blob(torch.full((2, H), float("nan"))), 400, "NaN"),
    ],
)
def test_bad_binary_forwards_get_the_engines_error(front_ends, layer, body, status, message):
    reply = httpx.post(
        f"{_url(front_ends)}/v1/layers/{layer}/forward", content=body, headers=BINARY
    )
    assert reply.status_code == status
    assert message in reply.json()["error"]
    assert reply.headers["X-Request-ID"]


def test_a_dead_front_end_is_restarted_and_the_service_keeps_answering(front_ends) -> None:
    url = _url(front_ends)
    restarts = "moe_serve_front_end_restarts_total"
    before = _count(httpx.get(f"{url}/metrics").text, restarts)
    victim = front_ends._processes[0]
    os.kill(victim.pid, signal.SIGKILL)
    x = torch.randn(3, H)
    for _ in range(20):  # the other front end answers meanwhile
        reply = httpx.post(f"{url}/v1/layers/{TINY}/forward", content=_blob(x), headers=BINARY)
        assert reply.status_code == 200
    deadline = time.monotonic() + 20
    while front_ends._processes[0] is victim or not _answers(url):
        assert time.monotonic() < deadline, "the front end was not restarted"
        time.sleep(0.05)
    assert _count(httpx.get(f"{url}/metrics").text, restarts) == before + 1


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready").status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def token_front_ends():
    """One front end that asks for TOKEN."""
    settings = Settings(device="cpu", http_workers=1, grpc_port=0, api_token=TOKEN)
    with running_front_ends(settings) as running:
        yield running


def test_the_token_is_checked_by_the_front_end_and_by_the_engine(token_front_ends) -> None:
    url = _url(token_front_ends)
    blob = _blob(torch.randn(1, H))
    for path, kwargs in [
        (f"/v1/layers/{TINY}/forward", {"content": blob, "headers": BINARY}),  # front end
        (f"/v1/layers/{TINY}/forward", {"json": {"hidden_states": [[0.0] * H]}}),  # engine
    ]:
        denied = httpx.post(url + path, **kwargs)
        assert denied.status_code == 401
        assert denied.headers["WWW-Authenticate"] == "Bearer"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        kwargs["headers"] = kwargs.get("headers", {}) | auth
        assert httpx.post(url + path, **kwargs).status_code == 200


def test_the_arena_never_hands_out_a_region_twice(tmp_path: Path) -> None:
    arena = BodyArena.create(tmp_path, 64 * BLOCK_BYTES)
    engine_side = BodyArena.attach(arena.path, arena.size)
    a = arena.allocate(1)
    b = arena.allocate(BLOCK_BYTES + 1)  # 2 blocks of body, then the reply's
    assert a.offset == 0
    assert b.offset == a.blocks * BLOCK_BYTES
    assert b.reply_offset == b.offset + 2 * BLOCK_BYTES
    assert b.reply_capacity >= b.body_bytes + REPLY_HEADER_BYTES
    arena.body(b)[:] = b"x" * b.body_bytes  # the engine sees what the front end wrote
    assert bytes(engine_side.body(b)) == b"x" * b.body_bytes
    engine_side.reply(b, 3)[:] = b"out"
    assert bytes(arena.reply(b, 3)) == b"out"
    assert arena.allocate(64 * BLOCK_BYTES) is None  # more than is free
    arena.free(a)
    again = arena.allocate(1)
    assert again.offset == 0  # a's blocks, not b's
    engine_side.close()
    arena.close()
    arena.unlink()
    assert not arena.path.exists()


def test_a_lent_reply_holds_its_region_until_its_last_view_is_gone(tmp_path: Path) -> None:
    arena = BodyArena.create(tmp_path, 8 * BLOCK_BYTES)
    region = arena.allocate(1)
    arena.reply(region, 3)[:] = b"out"
    reply = arena.lend_reply(region, 3)
    rest = reply[1:]  # what a transport keeps of a partly written reply
    del reply
    assert bytes(rest) == b"ut"
    assert arena.allocate(1).offset != region.offset  # still the reply's
    del rest
    assert arena.allocate(1).offset == region.offset  # freed with the last view
    arena.close()
    arena.unlink()


def test_json_forwards_are_decoded_by_the_front_end_and_equal_the_engines_reply(
    front_ends, caplog: pytest.LogCaptureFixture
) -> None:
    url = _url(front_ends)
    gen = torch.Generator().manual_seed(1)
    bodies = [
        (TINY, {"hidden_states": torch.randn(t, H, generator=gen).tolist()}) for t in (1, 3, 64)
    ]
    x = torch.randn(2, H, generator=gen)
    logits = torch.randn(2, 4, generator=gen)
    bodies.append((NO_ROUTER, {"hidden_states": x.tolist(), "router_logits": logits.tolist()}))
    with caplog.at_level(logging.INFO, logger="moe_serve.service.http.middleware"):
        plain = [httpx.post(f"{url}/v1/layers/{n}/forward", json=b) for n, b in bodies]
    assert "/forward" not in caplog.text  # answered through the channel, not relayed
    for (name, body), reply in zip(bodies, plain, strict=True):
        # ?priority=0: relayed, so the engine decodes and writes the JSON itself
        relayed = httpx.post(f"{url}/v1/layers/{name}/forward?priority=0", json=body)
        assert (reply.status_code, relayed.status_code) == (200, 200), reply.text
        assert reply.headers["content-type"] == relayed.headers["content-type"]
        assert reply.content == relayed.content
        assert reply.headers["X-Request-ID"]
    expected = reference_forward(NO_ROUTER, x, logits)
    torch.testing.assert_close(torch.tensor(plain[-1].json()["output"]), expected)


def _short_rows(tokens: int) -> list[list[float]]:
    """[tokens, H] numbers of a few bytes each as JSON (-2.0 to 1.75 in quarters)."""
    gen = torch.Generator().manual_seed(tokens)
    return (torch.randint(-8, 8, (tokens, H), generator=gen) / 4).tolist()


ON_LOOP_BYTES = off_loop.JSON.on_loop_bytes
REPLY_AT_LIMIT = ON_LOOP_BYTES // (H * NUMBER_BYTES)  # tokens whose reply is taken to fill it


@pytest.mark.parametrize(
    ("tokens", "pad_to"),
    [
        (3, ON_LOOP_BYTES),  # the body at the limit: decoded on the event loop
        (3, ON_LOOP_BYTES + 1),  # a byte over: on a JSON thread
        (REPLY_AT_LIMIT, 0),  # the reply's JSON at the limit: written on the event loop
        (REPLY_AT_LIMIT + 1, 0),
    ],
    ids=["body at the limit", "body over it", "reply at the limit", "reply over it"],
)
def test_json_forwards_on_either_side_of_the_on_loop_limit_equal_the_engines_reply(
    front_ends, tokens: int, pad_to: int
) -> None:
    rows = _short_rows(tokens)
    text = json.dumps({"hidden_states": rows}).encode()
    assert len(text) <= ON_LOOP_BYTES  # the body itself is decoded on the loop unless padded
    text += b" " * max(0, pad_to - len(text))  # JSON's whitespace: the same numbers
    url = f"{_url(front_ends)}/v1/layers/{TINY}/forward"
    headers = {"Content-Type": "application/json"}
    reply = httpx.post(url, content=text, headers=headers)
    relayed = httpx.post(f"{url}?priority=0", content=text, headers=headers)  # the engine's
    assert (reply.status_code, relayed.status_code) == (200, 200), reply.text
    assert reply.content == relayed.content
    expected = reference_forward(TINY, torch.tensor(rows))
    torch.testing.assert_close(torch.tensor(reply.json()["output"]), expected)


@pytest.mark.parametrize(
    ("layer", "body", "status", "message"),
    [
        (TINY, b'{"hidden_states": [[1.0, true]]}', 400, "hidden_states[0][1] is true"),
        (TINY, b'{"hidden_states": [[1.0, 2.0]', 400, "body is not valid JSON"),
        (TINY, b'{"hidden": [[1.0]]}', 400, "unknown fields ['hidden']"),
        (TINY, b'{"hidden_states": [[1.0, 2.0]]}', 400, f"hidden_size is {H}"),
        (
            TINY,
            f'{{"hidden_states": [{[1e39] * H}]}}'.encode(),
            400,
            "hidden_states[0][0] is 1e+39, beyond float32's range",
        ),
        (
            TINY,
            b'{"hidden_states": [[1.0, 1e400]]}',
            400,
            "body holds 1e400 at line 1 column 26, beyond float64's range",
        ),
        ("nope", b'{"hidden_states": [[1.0]]}', 404, "no layer named 'nope'"),
    ],
    ids=["true", "cut", "unknown-field", "width", "beyond-float32", "beyond-float64", "no-layer"],
)
def test_bad_json_forwards_get_the_engines_error(front_ends, layer, body, status, message):
    url = f"{_url(front_ends)}/v1/layers/{layer}/forward"
    reply = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    relayed = httpx.post(
        f"{url}?priority=0", content=body, headers={"Content-Type": "application/json"}
    )
    assert reply.status_code == status
    assert message in reply.json()["error"]
    assert reply.json() == relayed.json()
    assert reply.headers["X-Request-ID"]


def test_a_json_forward_asking_for_the_routing_goes_to_the_engine_as_its_text(
    front_ends, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the arena, not relayed: the engine writes the routing's JSON."""
    url = _url(front_ends)
    body = {"hidden_states": torch.randn(3, H).tolist(), "return_routing": True}
    with caplog.at_level(logging.INFO, logger="moe_serve.service.http.middleware"):
        reply = httpx.post(f"{url}/v1/layers/{TINY}/forward", json=body)
    assert "/forward" not in caplog.text
    assert reply.status_code == 200, reply.text
    assert set(reply.json()) >= {"output", "topk_ids", "topk_weights"}
    relayed = httpx.post(f"{url}/v1/layers/{TINY}/forward?priority=0", json=body)
    assert reply.content == relayed.content


def test_a_json_body_becomes_the_float32_blob_the_engine_would_decode() -> None:
    x, logits = torch.randn(3, 5).double(), torch.randn(3, 2).double()
    body = json_tensors.dumps({"hidden_states": x, "router_logits": logits})
    arrays = decode_forward_arrays(body)
    blob = bytearray(_blob_bytes(arrays))
    _write_blob(arrays, memoryview(blob))
    tensors = decode_safetensors(bytes(blob))
    decoded = json_tensors.decode_forward(body)
    assert torch.equal(tensors["hidden_states"], decoded.hidden_states)
    assert torch.equal(tensors["router_logits"], decoded.router_logits)
    largest = decode_forward_arrays(b'{"hidden_states": [[3.4028234663852886e38, 1.0]]}')
    blob = bytearray(_blob_bytes(largest))
    _write_blob(largest, memoryview(blob))
    assert decode_safetensors(bytes(blob))["hidden_states"].tolist() == [[FLOAT32_MAX, 1.0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_reply_blob_is_written_as_the_engines_json(dtype: torch.dtype) -> None:
    out = torch.randn(3, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    blob = encode_safetensors({"output": out}, {"layer": "x", "backend": "b", "tokens": "3"})
    expected = json_tensors.dumps({"output": out, "layer": "x", "tokens": 3, "backend": "b"})
    assert _json_reply(memoryview(blob)) == expected


@pytest.mark.parametrize(
    ("status", "raised", "counted"),
    [
        (200, None, [200]),
        (0, RuntimeError, [500]),  # failed before an answer
        (0, asyncio.CancelledError, [503]),  # cut by a shutdown: __call__ sends the 503
        (200, asyncio.CancelledError, [200]),  # cut while the answer was sent
        (RELAYED, None, []),  # the engine counts it
    ],
    ids=["answered", "failed", "cancelled", "cancelled-answering", "relayed"],
)
def test_a_forward_answered_by_the_front_end_is_counted_once_with_its_status(
    status: int, raised: type[BaseException] | None, counted: list[int]
) -> None:
    done: list[int] = []
    engine = SimpleNamespace(done=lambda _route, status, _seconds: done.append(status))
    logged: list[tuple[str, str]] = []

    class Keep(logging.Handler):  # the line and the request id it is written under
        def emit(self, record: logging.LogRecord) -> None:
            logged.append((record.getMessage().split(" in ")[0], logs.request_id.get()))

    scope = {"type": "http", "method": "POST", "path": "/forward",
             "headers": [(b"x-request-id", b"rid-1")]}  # fmt: skip
    before = logs.request_id.get()
    logger = logging.getLogger("moe_serve.service.frontends.front_end")
    keep, level = Keep(), logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        with (
            pytest.raises(raised) if raised else contextlib.nullcontext(),
            _Answer(engine, scope, FORWARD_PATH) as answer,
        ):
            assert (answer.rid, logs.request_id.get()) == ("rid-1", "rid-1")
            answer.status = status
            if raised:
                raise raised
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)
    assert done == counted
    assert logged == [(f"POST /forward -> {status}", "rid-1") for status in counted]
    assert logs.request_id.get() == before


@pytest.mark.parametrize(
    ("device", "expected"), [("cpu", 8 << 20), ("cuda", off_loop.JSON.on_loop_bytes)]
)
def test_front_ends_leave_large_json_bodies_to_a_gpu_engine(
    monkeypatch: pytest.MonkeyPatch, device: str, expected: int
) -> None:
    """On a GPU the engine reads them on the device (service/codecs/json_device.py); on a CPU a
    front end decodes every JSON forward up to MOE_SERVE_MAX_JSON_BYTES itself."""
    monkeypatch.setattr(Settings, "torch_device", lambda _: torch.device(device))
    assert json_here_bytes(Settings(max_json_bytes=8 << 20)) == expected


def _stalled(port: int, path: str, declared: int, sent: bytes, token: str | None) -> socket.socket:
    """A connection whose request declares `declared` body bytes and sends only `sent`."""
    conn = socket.create_connection(("127.0.0.1", port))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {declared}\r\n\r\n"
    )
    conn.sendall(head.encode() + sent)
    return conn


def _status_line(conn: socket.socket, timeout_s: float) -> str:
    conn.settimeout(timeout_s)
    try:
        return conn.recv(4096).decode("latin-1").split("\r\n", 1)[0]
    except TimeoutError:
        return "no answer"
    finally:
        conn.close()


STALLED_PATHS = [f"/v2/models/{TINY}/infer", "/v2/repository/index", f"/v1/layers/{TINY}/forward"]


def test_stalled_bodies_get_408_from_the_front_end_and_probes_keep_answering() -> None:
    """Clients that declare a body and stop sending it hold no engine connection: probes and
    scrapes answer meanwhile, and each stalled request ends in 408 (503 on a connection beyond
    the limit) at the read timeout, as in one process."""
    settings = Settings(
        device="cpu", http_workers=1, grpc_port=0, read_timeout_s=2.0, max_connections=4,
        api_token=TOKEN,
    )  # fmt: skip
    with running_front_ends(settings) as front_ends:
        port = front_ends.listener.getsockname()[1]
        stalled = [
            _stalled(port, path, 1000, b'{"in', TOKEN) for path in STALLED_PATHS for _ in range(4)
        ]
        for probe in ("/health", "/ready", "/metrics", "/v2/health/ready"):
            assert httpx.get(f"{_url(front_ends)}{probe}", timeout=10).status_code == 200
        answers = [_status_line(conn, 60) for conn in stalled]
        assert set(answers) <= {"HTTP/1.1 408 Request Timeout", "HTTP/1.1 503 Service Unavailable"}
        assert "HTTP/1.1 408 Request Timeout" in answers


def test_without_the_token_a_relayed_request_is_401_before_its_body_arrives(
    token_front_ends,
) -> None:
    """Nothing of the body is waited for, nor memory reserved for what it declares."""
    port = token_front_ends.listener.getsockname()[1]
    for path in STALLED_PATHS:
        with _stalled(port, path, 10 << 20, b"{", None) as conn:
            assert _status_line(conn, 20) == "HTTP/1.1 401 Unauthorized"


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) << 10


def test_a_declared_body_size_reserves_no_memory_before_its_bytes_arrive(token_front_ends) -> None:
    port = token_front_ends.listener.getsockname()[1]
    pid = token_front_ends._processes[0].pid
    declared = token_front_ends.config.json_here_bytes  # decoded in the front end
    before = _rss_bytes(pid)
    path = f"/v1/layers/{TINY}/forward"
    stalled = [_stalled(port, path, declared, b'{"hidden', TOKEN) for _ in range(24)]
    assert httpx.get(f"{_url(token_front_ends)}/health").status_code == 200  # all of them read
    grown = _rss_bytes(pid) - before
    for conn in stalled:
        conn.close()
    assert grown < 4 * declared, f"{grown >> 20} MiB for 24 x {declared >> 20} MiB declared"


def _answer_to_head(port: int, head: bytes) -> tuple[str, dict]:
    """The status line and JSON body answered to a request head whose body is never sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
        conn.sendall(head)
        received = b""
        while b"\r\n\r\n" not in received:
            received += conn.recv(65536)
        top, _, body = received.partition(b"\r\n\r\n")
        size = int(re.search(rb"(?i)content-length: *(\d+)", top).group(1))
        while len(body) < size:
            body += conn.recv(65536)
    return top.split(b"\r\n")[0].decode(), json.loads(body)


@pytest.mark.parametrize(
    "head",
    [
        # a JSON forward relayed (its query string), declared past the JSON limit
        f"POST /v1/layers/{TINY}/forward?priority=0 HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/json\r\nContent-Length: 20971520\r\n\r\n",
        # past the body limit too, where the JSON limit is still the one named
        f"POST /v1/layers/{TINY}/forward?priority=0 HTTP/1.1\r\nHost: x\r\n"
        "Content-Type: application/json\r\nContent-Length: 67108865\r\n\r\n",
        # KServe binary tensors whose JSON part passes the JSON limit
        f"POST /v2/models/{TINY}/infer HTTP/1.1\r\nHost: x\r\n"
        "Inference-Header-Content-Length: 999999999\r\nContent-Length: 1000000000\r\n\r\n",
    ],
    ids=["json", "json-past-the-body-limit", "kserve-json-part"],
)
def test_a_body_past_its_limit_gets_the_same_413_behind_front_ends_as_in_one_process(
    front_ends, head: str
) -> None:
    fronted = _answer_to_head(front_ends.listener.getsockname()[1], head.encode())
    with serving() as s:
        alone = _answer_to_head(int(s.url.rsplit(":", 1)[1]), head.encode())
    assert fronted == alone
    assert (
        fronted[0].startswith("HTTP/1.1 413") and "MOE_SERVE_MAX_JSON_BYTES" in fronted[1]["error"]
    )


def test_json_nested_a_thousand_deep_is_a_json_400_from_the_front_end(front_ends) -> None:
    deep = "[" * 1000 + "1" + "]" * 1000
    reply = httpx.post(
        f"{_url(front_ends)}/v1/layers/{TINY}/forward",
        content='{"hidden_states": ' + deep + "}",
        headers={"Content-Type": "application/json"},
    )
    assert reply.status_code == 400
    assert reply.json()["error"] == "hidden_states is nested more than 32 arrays deep"


def test_a_request_head_past_the_limit_is_a_json_431_from_the_front_end(front_ends) -> None:
    port = front_ends.listener.getsockname()[1]
    line = b"X-Filler: " + b"a" * 8000 + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        with contextlib.suppress(OSError):  # the front end closes while the client still sends
            for _ in range(4 * MAX_HEAD_BYTES // len(line)):
                sock.sendall(line)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert httpx.get(f"{_url(front_ends)}/health").status_code == 200


def test_directories_of_engines_that_are_gone_are_removed_at_start(tmp_path: Path) -> None:
    """A killed engine leaves its sockets and arenas behind; the next start cleans them up and
    leaves those of live engines (and anything not ours) alone."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"moe-serve-{gone.pid}-abc123"
    live = tmp_path / f"moe-serve-{os.getpid()}-def456"
    other = tmp_path / "moe-serve-test-region"
    for path in (stale, live, other):
        path.mkdir()
        (path / "http.sock").touch()
    remove_stale_directories(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def _infer_held(port: int) -> socket.socket:
    """A connection whose KServe infer waits in the engine's batcher (for company, up to
    max_batch_delay_ms): the front end holds one relay connection to the engine for it."""
    body = json.dumps(
        {"inputs": [{"name": "hidden_states", "shape": [1, H], "datatype": "FP32",
                     "data": [0.0] * H}]}
    ).encode()  # fmt: skip
    conn = socket.create_connection(("127.0.0.1", port))
    head = f"POST /v2/models/{TINY}/infer HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n"
    conn.sendall(head.encode() + body)
    return conn


def test_probes_have_connections_to_the_engine_that_relayed_requests_cannot_take() -> None:
    """As many relayed requests as the relay may hold connections to the engine (max_connections)
    are held in the engine; the probes and /metrics still answer."""
    settings = Settings(
        device="cpu", http_workers=1, grpc_port=0, max_connections=2, max_batch_delay_ms=600_000
    )
    with running_front_ends(settings) as front_ends:
        port = front_ends.listener.getsockname()[1]
        held = [_infer_held(port) for _ in range(settings.max_connections)]
        try:
            for probe in ("/health", "/ready", "/metrics", "/v2/health/ready"):
                assert httpx.get(f"{_url(front_ends)}{probe}", timeout=20).status_code == 200
        finally:
            for conn in held:
                conn.close()  # the front end withdraws them from the engine


def test_during_the_drain_a_new_connection_is_refused_at_once() -> None:
    """SIGTERM with a request in flight: the front ends drain it, and a new connection is
    refused (as in one process), not queued where no one takes it."""
    settings = Settings(
        device="cpu", http_workers=1, grpc_port=0, drain_timeout_s=120, read_timeout_s=120
    )
    with running_front_ends(settings) as front_ends:
        port = front_ends.listener.getsockname()[1]
        in_flight = _stalled(port, f"/v2/models/{TINY}/infer", 1000, b"{", None)
        try:
            front_ends.terminate()  # what SIGTERM to the engine process does first
            deadline = time.monotonic() + 30
            while (answer := _new_connection(port)) == "HTTP/1.1 200 OK":  # not stopped yet
                assert time.monotonic() < deadline, "the front end did not stop taking requests"
                time.sleep(0.05)
            assert answer in ("refused", "closed", "HTTP/1.1 503 Service Unavailable")
        finally:
            in_flight.close()


def _new_connection(port: int) -> str:
    """What a new connection's GET /health gets: the status line, "refused", "closed" (taken
    just as the server stopped, and closed unanswered), or "no answer" within 10 s."""
    try:
        conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    except ConnectionRefusedError:
        return "refused"
    try:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        return _status_line(conn, 10) or "closed"
    except (ConnectionResetError, BrokenPipeError):
        return "refused"


def _exchange(front_ends, request: bytes) -> tuple[bytes, bytes]:
    """A request sent as it is (no client library rewrites it) on a connection of its own:
    the response's head and body."""
    with socket.create_connection(("127.0.0.1", front_ends.listener.getsockname()[1])) as conn:
        conn.sendall(request)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return head, body


def test_a_relayed_response_has_one_date_and_one_server_header(front_ends) -> None:
    head, _ = _exchange(
        front_ends, b"GET /v1/layers HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    lines = head.decode("latin-1").lower().split("\r\n")
    assert lines[0] == "http/1.1 200 ok"
    names = [line.split(":", 1)[0] for line in lines[1:]]
    assert (names.count("date"), names.count("server")) == (1, 1)


def test_a_relayed_path_reaches_the_engine_as_the_client_sent_it(front_ends) -> None:
    # "/v1/layers/.." is the route /v1/layers/{name} with the name "..", not /v1/layers
    request = b"GET /v1/layers/..?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    head, body = _exchange(front_ends, request)
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 404 Not Found"
    assert "no layer named '..'" in json.loads(body)["error"]


@pytest.mark.parametrize("case", HOSTILE_HEADERS)
def test_hostile_blobs_are_a_json_400_from_the_front_end(front_ends, case: str) -> None:
    body, says = HOSTILE_HEADERS[case]
    r = httpx.post(f"{_url(front_ends)}/v1/layers/{TINY}/forward", content=body, headers=BINARY)
    assert r.status_code == 400
    assert says in r.json()["error"]


def test_a_request_the_engine_closed_the_connection_on_is_sent_again(tmp_path: Path) -> None:
    """The engine closes an idle connection just as the relay takes it for a request (the fake
    engine here closes its first connection unanswered): the request is sent again, once, on a
    new connection, and the client gets the engine's answer, not a 503."""
    engine_http = tmp_path / "http.sock"
    connections = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(await reader.readuntil(b"\r\n\r\n"))
        if len(connections) > 1:
            body = b'{"served": true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        writer.close()

    async def relayed() -> httpx.Response:
        server = await asyncio.start_unix_server(engine, path=str(engine_http))
        app = FrontEnd(_config(tmp_path, engine_http))
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://fe") as client:
                return await client.get("/v2/models/x")
        finally:
            await app.relay.aclose()
            await app.scrapes.aclose()
            server.close()
            await server.wait_closed()

    r = asyncio.run(relayed())
    assert (r.status_code, r.json()) == (200, {"served": True})
    assert len(connections) == 2 and all(c.startswith(b"GET /v2/models/x ") for c in connections)


def _config(tmp_path: Path, engine_http: Path) -> FrontEndConfig:
    """A front end with no arena (every request relayed), no channel and no state published."""
    state = StateBlock.create(tmp_path / "state")
    state.close()
    return FrontEndConfig(
        listen_fd=-1, engine_http=str(engine_http), engine_channel=str(tmp_path / "channel.sock"),
        engine_state=str(state.path), engine_stale_s=STALE_S, arena_dir=str(tmp_path / "no-arena"),
        api_token=None, max_connections=4, read_timeout_s=10.0, max_body_bytes=1 << 20,
        json_here_bytes=1 << 20, max_json_bytes=1 << 20, drain_timeout_s=1.0, stay_awake=False,
        log_level="info",
        log_format="text", routes=[],
    )  # fmt: skip


def test_a_cancelled_relays_socket_wakeup_is_not_logged_as_an_error(caplog) -> None:
    """anyio's Unix-socket reader sets a bare future's result: after a client left and its
    relay was cancelled, that is harmless and not an ERROR; other callback errors still are."""
    from moe_serve.service.frontends.front_end import _quiet_cancelled_wakeups

    def broken() -> None:
        raise RuntimeError("a real error")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_quiet_cancelled_wakeups)
        waiter = loop.create_future()
        waiter.cancel()
        loop.call_soon(waiter.set_result, None)  # as anyio's reader callback fires
        loop.call_soon(broken)
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(run())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [str(r.exc_info[1]) for r in errors] == ["a real error"]
    assert any("cancelled relay" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("body", ["{}", '{"hidden_states": [[1.0]]}'], ids=["empty", "bad"])
def test_a_json_forward_to_an_unknown_layer_is_the_engines_404(front_ends, body) -> None:
    url = f"{_url(front_ends)}/v1/layers/nope/forward"
    reply = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"].startswith("no layer named 'nope'; served layers: ")


def test_a_front_end_imports_no_torch() -> None:
    """A front end starts in a fraction of a second (and again when it dies): no torch, nor the
    demo layer that the API's examples come from."""
    code = (
        "import sys\nimport moe_serve.service.frontends.front_end\n"
        "print([m for m in ('torch', 'triton', 'moe_serve.weights.demo') if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]


@pytest.fixture(scope="module")
def patient_front_ends():
    """Front ends whose read timeout no test waits for: an answer that comes is not a 408."""
    settings = Settings(device="cpu", http_workers=1, grpc_port=0, read_timeout_s=3600)
    with running_front_ends(settings) as running:
        yield running


def _engine_client(front_ends) -> httpx.Client:
    """A client of the engine process's own HTTP server (what the front ends relay to)."""
    transport = httpx.HTTPTransport(uds=str(front_ends.http_path))
    return httpx.Client(transport=transport, base_url="http://engine", timeout=WAIT_S)


def _paths(engine: httpx.Client) -> list[str]:
    """A path of each of the engine's routes (its API's and the docs'), parameters filled in."""
    templates = [*engine.get("/openapi.json").json()["paths"], "/docs", "/redoc", "/openapi.json"]
    filled = {"{name}": TINY, "{version}": "1"}
    for name, value in filled.items():
        templates = [path.replace(name, value) for path in templates]
    return templates


def _methods(reply: httpx.Response) -> set[str]:
    return {m.strip() for m in reply.headers["allow"].split(",")}


def test_a_route_asked_with_a_method_it_does_not_take_is_the_engines_405_at_once(
    patient_front_ends,
) -> None:
    """For every route of the engine (the probes too) and method, the front end answers what
    the engine does; a 405 is the engine's (JSON error, Allow), and a path no route has the
    engine's 404, each coming without waiting for a body that never comes, whose connection is
    then closed. A path one slash away from a route's is the engine's redirect."""
    url, port = _url(patient_front_ends), patient_front_ends.listener.getsockname()[1]
    with _engine_client(patient_front_ends) as engine, httpx.Client(timeout=WAIT_S) as http:
        refused = []
        for path in [*_paths(engine), "/nope", "/v2/models/x/y/z", "/v1/layers/", "/health/"]:
            for method in METHODS:
                mine, theirs = engine.request(method, path), http.request(method, url + path)
                assert theirs.status_code == mine.status_code, (method, path, theirs.text)
                if mine.status_code == 405:
                    refused.append((method, path))
                    assert theirs.content == mine.content, (method, path)
                    assert _methods(theirs) == _methods(mine), (method, path)
                if mine.status_code in (307, 404):
                    assert theirs.content == mine.content, (method, path)
                    where = [httpx.URL(r.headers.get("location", "")).path for r in (theirs, mine)]
                    assert where[0] == where[1], (method, path)  # each on the host it was asked
                if mine.status_code == 404 and path in ("/nope", "/v2/models/x/y/z"):
                    refused.append((method, path))
    assert len({path for _, path in refused}) > 20  # the probes, KServe's GET and POST routes
    for method, path in refused:
        if method != "HEAD":
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
                head = f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n"
                sock.sendall(head.encode() + b"{")
                reply = b""
                while chunk := sock.recv(65536):  # the body never comes: closed after the 4xx
                    reply += chunk
            status = b"404" if path in ("/nope", "/v2/models/x/y/z") else b"405"
            assert reply.startswith(b"HTTP/1.1 " + status), (method, path, reply[:100])
            assert b"connection: close\r\n" in reply


def _half_closed_requests() -> dict[str, bytes]:
    blob = _blob(torch.randn(4, H, generator=torch.Generator().manual_seed(1)))
    rows = json.dumps({"hidden_states": [[0.01] * H] * 2}).encode()
    forward = f"POST /v1/layers/{TINY}/forward HTTP/1.1\r\nHost: t\r\nContent-Type: "
    return {
        "probe": b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n",
        "relayed": b"GET /v1/layers HTTP/1.1\r\nHost: t\r\n\r\n",
        "binary forward": (
            f"{forward}application/octet-stream\r\nContent-Length: {len(blob)}\r\n\r\n".encode()
            + blob
        ),
        "json forward": (
            f"{forward}application/json\r\nContent-Length: {len(rows)}\r\n\r\n".encode() + rows
        ),
    }


@pytest.mark.parametrize("kind", list(_half_closed_requests()))
def test_a_whole_request_then_a_half_close_is_answered_by_the_front_end(front_ends, kind) -> None:
    """The client's end of stream (shutdown(SHUT_WR)) after a whole request: answered, then the
    connection is closed, as in one process."""
    port = front_ends.listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(_half_closed_requests()[kind])
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert _final_answers(reply) == [b"HTTP/1.1 200 OK"], reply[:300]


def test_a_client_that_closes_its_connection_has_its_relayed_request_withdrawn() -> None:
    """The front end finds the client gone (its end of stream alone looks like a half-close)
    and withdraws the relayed request from the engine, which counts it 499."""
    settings = Settings(device="cpu", http_workers=1, grpc_port=0, max_batch_delay_ms=600_000)
    with running_front_ends(settings) as front_ends:
        _infer_held(front_ends.listener.getsockname()[1]).close()
        _await_499(_url(front_ends), "/v2/models/{name}/infer")
