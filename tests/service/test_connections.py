"""Hostile clients on a real server: stalled heads and bodies are dropped in bounded time, and
the open connections are bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from moe_serve.service.http import server as server_module
from moe_serve.service.http.app import create_app
from moe_serve.service.http.server import MAX_HEAD_BYTES, bounded_protocol, listen
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import TINY, H, running_server, tiny_loader

READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 3
WAIT_S = 30.0  # far above READ_TIMEOUT_S: what the tests allow before calling it a hang


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    settings = Settings(
        device="cpu", read_timeout_s=READ_TIMEOUT_S, max_connections=MAX_CONNECTIONS
    )
    with running_server(create_app(settings, tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield url, int(url.rsplit(":", 1)[1])


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(WAIT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (raises on a hang)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_body_that_stalls_gets_408_and_the_connection_closed(server) -> None:
    _, port = server
    with _connect(port) as sock:
        sock.sendall(
            f"POST /v1/layers/{TINY}/forward HTTP/1.1\r\nHost: t\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            '{"hidden_states": [[0.1, '.encode()
        )
        reply = _read_until_closed(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"].startswith("the request body did not arrive within 1 s")


def test_a_request_head_that_stalls_has_its_connection_closed(server) -> None:
    _, port = server
    with _connect(port) as sock:
        sock.sendall(b"POST /v1/layers/tiny/forward HTTP/1.1\r\nHost: t\r\nContent-Le")
        assert _read_until_closed(sock) == b""


@pytest.mark.parametrize("endless", ["header lines", "one header"])
def test_a_request_head_past_the_limit_gets_a_json_431_and_is_closed(server, endless) -> None:
    """httptools would buffer a head of any size until the read timeout; past MAX_HEAD_BYTES the
    server answers at once, token or not, and the next connection is served."""
    url, port = server
    line = b"X-Filler: " + b"a" * 8000 + (b"\r\n" if endless == "header lines" else b"")
    with _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n")
        with contextlib.suppress(OSError):  # the server closes while the client still sends
            for _ in range(4 * MAX_HEAD_BYTES // len(line)):
                sock.sendall(line)
        reply = _read_until_closed(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert json.loads(body)["error"].startswith("the request head (request line and headers)")
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_whole_request_in_one_read_past_the_head_limit_is_served(server) -> None:
    """Head, a body larger than MAX_HEAD_BYTES and the message's end arrive in one read: only
    the head counts against the limit."""
    _, port = server
    rows = [[0.001 * i] * H for i in range(8)]
    body = json.dumps({"hidden_states": rows * (4 * MAX_HEAD_BYTES // (8 * H * 6) + 1)})
    assert len(body) > 2 * MAX_HEAD_BYTES
    head = (
        f"POST /v1/layers/{TINY}/forward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with _connect(port) as sock:
        sock.sendall(head.encode() + body.encode())
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]


def test_a_head_under_the_limit_is_served(server) -> None:
    url, _ = server
    filler = {f"x-filler-{i}": "a" * 4000 for i in range(MAX_HEAD_BYTES // 8000)}
    assert httpx.get(f"{url}/health", headers=filler).status_code == 200


def test_a_connection_that_never_sends_is_closed(server) -> None:
    _, port = server
    with _connect(port) as sock:
        assert _read_until_closed(sock) == b""


def test_connections_beyond_the_limit_get_a_json_503_but_the_probes_answer(server) -> None:
    url, port = server
    idle = [_connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        # a probe on a later connection is answered once the server has accepted those before
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            assert http.get("/health").status_code == 200
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            busy = http.post(f"/v1/layers/{TINY}/forward", json={"hidden_states": [[0.0] * 64]})
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            alive = http.get("/health")
    finally:
        for sock in idle:
            sock.close()
    assert busy.status_code == 503
    assert busy.headers["Retry-After"] == "1"
    assert busy.json() == {
        "error": f"the server has {MAX_CONNECTIONS} connections open (MOE_SERVE_MAX_CONNECTIONS); "
        "retry"
    }
    assert alive.status_code == 200
    deadline = time.monotonic() + WAIT_S  # once the server has seen the idle ones close
    while _forward_status(url) != 200:
        assert time.monotonic() < deadline, "requests were not served again"
        time.sleep(0.05)


def _forward_status(url: str) -> int:
    with httpx.Client(base_url=url, timeout=WAIT_S) as http:
        return http.post(
            f"/v1/layers/{TINY}/forward", json={"hidden_states": [[0.0] * 64]}
        ).status_code


def test_a_client_that_leaves_mid_body_is_counted_as_499_not_as_a_server_error(server) -> None:
    url, port = server
    with _connect(port) as sock:
        sock.sendall(
            f"POST /v1/layers/{TINY}/forward HTTP/1.1\r\nHost: t\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n[[".encode()
        )
        # a probe on a later connection is answered once the server has read the head above
        assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
    deadline = time.monotonic() + WAIT_S
    route = 'route="/v1/layers/{name}/forward"'
    while (
        f'moe_serve_requests_total{{{route},status="499"}}' not in httpx.get(f"{url}/metrics").text
    ):
        assert time.monotonic() < deadline, "the request was not counted as 499"
        time.sleep(0.05)
    assert f'{route},status="500"' not in httpx.get(f"{url}/metrics").text


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),
        b"GET /health HTTP/1.1\r\nHost\r\n\r\n",
    ],
    ids=["tls-hello", "header-without-colon"],
)
def test_bytes_that_are_not_http_get_a_json_400(server, garbage: bytes) -> None:
    _, port = server
    with _connect(port) as sock:
        sock.sendall(garbage)
        head, _, body = _read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"content-type: application/json" in head
    assert json.loads(body) == {"error": "Invalid HTTP request received."}


def test_a_body_gathers_up_to_the_buffer_before_reading_pauses() -> None:
    """uvicorn pauses reading past its module's HIGH_WATER_LIMIT, read at each body chunk: the
    served protocols raise it (a 917 KB body would otherwise cross the event loop 14 times)."""
    from uvicorn.protocols.http import h11_impl, httptools_impl

    from moe_serve.service.http.server import BODY_BUFFER_BYTES, bounded_protocol

    bounded_protocol(8, 1.0)
    assert "HIGH_WATER_LIMIT" in httptools_impl.HttpToolsProtocol.on_body.__code__.co_names
    assert "HIGH_WATER_LIMIT" in h11_impl.H11Protocol.handle_events.__code__.co_names
    assert httptools_impl.HIGH_WATER_LIMIT == h11_impl.HIGH_WATER_LIMIT == BODY_BUFFER_BYTES
    assert BODY_BUFFER_BYTES >= 1 << 20  # a 64-token DeepSeek-V3 body (917 KB) in one go


def test_a_client_that_stops_reading_its_response_is_dropped() -> None:
    """Once the connection's send buffer is full, the response must drain within the write
    timeout: else the connection is dropped, and the app's sends return (uvicorn alone would
    hold the response, and whatever its request holds, until the client reads)."""
    size, chunk = 64 << 20, bytes(1 << 20)
    sent = threading.Event()

    async def app(scope, receive, send) -> None:
        headers = [(b"content-length", str(size).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(size // len(chunk)):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        sent.set()

    protocol = bounded_protocol(8, READ_TIMEOUT_S, write_timeout_s=READ_TIMEOUT_S)
    config = uvicorn.Config(app, lifespan="off", log_config=None, http=protocol)
    with _serving(uvicorn.Server(config)) as port:
        sock = _connect(port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sent.wait(WAIT_S), "the response's sends still wait on a client that reads none"
        received = b""
        with contextlib.suppress(ConnectionResetError):
            received = _read_until_closed(sock)
        sock.close()
    assert len(received) < size


@contextlib.contextmanager
def _serving(server: uvicorn.Server) -> Iterator[int]:
    listener = listen("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(WAIT_S)


def _forward_request(rows: int = 2) -> bytes:
    body = json.dumps({"hidden_states": [[0.01] * H for _ in range(rows)]})
    return (
        f"POST /v1/layers/{TINY}/forward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


def _final_answers(reply: bytes) -> list[bytes]:
    """The status lines of the final responses in `reply` (a 1xx is not one)."""
    lines = [line for line in reply.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    return [line for line in lines if not line.startswith(b"HTTP/1.1 1")]


@pytest.mark.parametrize(
    "requests",
    [
        b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n",
        _forward_request(),
        b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n" + _forward_request(),  # pipelined
    ],
    ids=["probe", "forward", "pipelined"],
)
def test_whole_requests_then_a_half_close_are_answered_then_closed(server, requests) -> None:
    """The client's end of stream after whole requests (shutdown(SHUT_WR)) says it sends no
    more, not that it left: each request is answered, then the connection is closed."""
    _, port = server
    with _connect(port) as sock:
        sock.sendall(requests)
        sock.shutdown(socket.SHUT_WR)
        reply = _read_until_closed(sock)
    answers = [b"HTTP/1.1 200 OK"] * requests.count(b" HTTP/1.1\r\n")
    assert _final_answers(reply) == answers, reply[:300]


def test_a_client_that_closes_its_connection_has_its_waiting_request_withdrawn() -> None:
    """A client that closes its connection (both ways) while its request waits for company in
    the batcher: the end of stream alone looks like a half-close, but the client is found gone
    and its request withdrawn (499), not served to no one."""
    settings = Settings(device="cpu", max_batch_delay_ms=600_000)
    with running_server(create_app(settings, tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        port = int(url.rsplit(":", 1)[1])
        with _connect(port) as sock:
            sock.sendall(_forward_request())
        _await_499(url)


def _await_499(url: str, route: str = "/v1/layers/{name}/forward") -> None:
    series = f'moe_serve_requests_total{{route="{route}",status="499"}}'
    deadline = time.monotonic() + WAIT_S
    while series not in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline, "the request was not withdrawn"
        time.sleep(0.05)


def test_a_request_cut_short_by_a_half_close_is_closed_unanswered(server) -> None:
    _, port = server
    with _connect(port) as sock:
        sock.sendall(_forward_request()[:-10])
        sock.shutdown(socket.SHUT_WR)
        assert _read_until_closed(sock) == b""


def _ok_app():
    """An app that answers 200 "ok" once it has read the body, and keeps the event loop it runs
    on in `loop`."""
    loop: list[asyncio.AbstractEventLoop] = []

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        loop[:] = [asyncio.get_running_loop()]
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    return app, loop


def _server_side(server: uvicorn.Server, client: socket.socket) -> socket.socket:
    """The server's end of the connection `client` (a socket on a duplicate descriptor)."""
    for connection in server.server_state.connections:
        sock = connection.transport.get_extra_info("socket")
        if sock.getpeername() == client.getsockname():
            return socket.fromfd(sock.fileno(), sock.family, sock.type)
    raise AssertionError("no such connection")


def _drain(server: uvicorn.Server) -> None:
    """What uvicorn's shutdown does to each connection first (before it waits for them)."""
    for connection in list(server.server_state.connections):
        connection.shutdown()


REQUEST = b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nbody"


def _idle_out(server: uvicorn.Server) -> None:
    """What the keep-alive timeout does to each connection between requests."""
    for connection in list(server.server_state.connections):
        connection.timeout_keep_alive_handler()


@pytest.mark.parametrize("close", [_drain, _idle_out], ids=["drain", "keep-alive timeout"])
def test_a_request_waiting_unread_as_its_connection_would_close_is_answered(close) -> None:
    """uvicorn's shutdown and its keep-alive timeout close a connection between requests: a
    request the client has sent on it, waiting in the socket unread, would be lost. It is read
    and answered instead (during the drain with `Connection: close`). The event loop is held
    while the request arrives, so that the connection would close before the loop could read
    it."""
    app, loop = _ok_app()
    config = uvicorn.Config(app, lifespan="off", log_config=None, http=bounded_protocol(8, WAIT_S))
    server = uvicorn.Server(config)
    with _serving(server) as port, _connect(port) as sock:
        sock.sendall(REQUEST)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")  # a keep-alive connection, idle
        held, sent = threading.Event(), threading.Event()

        def close_once_the_request_waits() -> None:
            held.set()
            assert sent.wait(WAIT_S)
            with _server_side(server, sock) as theirs:
                assert select.select([theirs], [], [], WAIT_S)[0], "the request never came"
            close(server)

        loop[0].call_soon_threadsafe(close_once_the_request_waits)
        assert held.wait(WAIT_S)
        sock.sendall(REQUEST)
        sent.set()
        reply = _read_until_closed(sock) if close is _drain else sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200 "), reply
    assert (b"connection: close\r\n" in reply) == (close is _drain)


def test_a_keep_alive_connection_its_client_reset_idles_out_quietly() -> None:
    """A client resets its idle keep-alive connection: uvicorn leaves the keep-alive timer
    armed when a connection is lost with an error, and when it fires the connection, closed,
    is let go without an error."""
    app, loop = _ok_app()
    config = uvicorn.Config(app, lifespan="off", log_config=None, http=bounded_protocol(8, WAIT_S))
    server = uvicorn.Server(config)
    with _serving(server) as port:
        sock = _connect(port)
        sock.sendall(REQUEST)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        (connection,) = server.server_state.connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset
        deadline = time.monotonic() + WAIT_S
        while server.server_state.connections:
            assert time.monotonic() < deadline, "the reset was not seen"
            time.sleep(0.01)
        idled = asyncio.run_coroutine_threadsafe(_idle(connection), loop[0])
        idled.result(WAIT_S)  # raised ValueError (a closed socket's descriptor, -1)


async def _idle(connection) -> None:
    connection.timeout_keep_alive_handler()


def test_a_request_answered_after_its_client_reset_a_pipelined_connection_writes_nothing() -> None:
    """Two requests pipelined on one connection, which the client resets while the first runs:
    uvicorn marks only the last request's cycle disconnected, so the first one's response is
    written to the closed transport, which must drop it as a disconnected cycle does, not raise
    (uvloop refuses a write to a closed handle)."""
    release, answered, errors = threading.Event(), threading.Event(), []

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/first":  # it watches for the client leaving, as a relay does
            await receive()  # its empty body
            watching = asyncio.ensure_future(receive())  # which resumes reading
            await asyncio.get_running_loop().run_in_executor(None, release.wait, WAIT_S)
            watching.cancel()
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"2")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b"ok"})
        except Exception as err:  # what uvicorn would log as the app's error
            errors.append(err)
        answered.set()

    config = uvicorn.Config(app, lifespan="off", log_config=None, http=bounded_protocol(8, WAIT_S))
    server = uvicorn.Server(config)
    with _serving(server) as port:
        sock = _connect(port)
        sock.sendall(
            b"GET /first HTTP/1.1\r\nHost: t\r\n\r\n" + b"GET /second HTTP/1.1\r\nHost: t\r\n\r\n"
        )
        deadline = time.monotonic() + WAIT_S
        while not _pipelined(server):
            assert time.monotonic() < deadline, "the second request was not read"
            time.sleep(0.01)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset
        while server.server_state.connections:
            assert time.monotonic() < deadline, "the reset was not seen"
            time.sleep(0.01)
        release.set()
        assert answered.wait(WAIT_S)
    assert errors == []


def _pipelined(server: uvicorn.Server) -> bool:
    return any(c.pipeline for c in list(server.server_state.connections))


def test_a_request_begun_as_the_drain_begins_is_answered_then_closed() -> None:
    """The drain finds part of a request head read (the rest still to come): it is answered
    once it has all come, then the connection is closed."""
    app, loop = _ok_app()
    config = uvicorn.Config(app, lifespan="off", log_config=None, http=bounded_protocol(8, WAIT_S))
    server = uvicorn.Server(config)
    with _serving(server) as port, _connect(port) as sock:
        sock.sendall(REQUEST)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.sendall(REQUEST[:20])
        with _server_side(server, sock) as theirs:  # until the server has read it
            deadline = time.monotonic() + WAIT_S
            while select.select([theirs], [], [], 0)[0]:
                assert time.monotonic() < deadline, "the server does not read"
                time.sleep(0.01)
        drained = threading.Event()
        loop[0].call_soon_threadsafe(lambda: (_drain(server), drained.set()))
        assert drained.wait(WAIT_S)
        sock.sendall(REQUEST[20:])
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 "), reply
    assert b"connection: close\r\n" in reply


@pytest.mark.parametrize("used", [True, False], ids=["idle keep-alive", "no request yet"])
def test_a_request_on_a_connection_between_requests_during_the_drain_is_answered(
    monkeypatch: pytest.MonkeyPatch, used: bool
) -> None:
    """An active client's connection is between requests for a moment after each response:
    the drain (uvicorn would close such a connection at once) leaves it open for a while, and
    answers its next request with `Connection: close`."""
    monkeypatch.setattr(server_module, "_DRAIN_IDLE_S", WAIT_S)  # no test waits for it
    app, loop = _ok_app()
    config = uvicorn.Config(app, lifespan="off", log_config=None, http=bounded_protocol(8, WAIT_S))
    server = uvicorn.Server(config)
    with _serving(server) as port, _connect(port) as sock, _connect(port) as other:
        other.sendall(REQUEST)  # the app's event loop known, the connections accepted
        assert other.recv(65536).startswith(b"HTTP/1.1 200 ")
        if used:
            sock.sendall(REQUEST)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        drained = threading.Event()
        loop[0].call_soon_threadsafe(lambda: (_drain(server), drained.set()))
        assert drained.wait(WAIT_S)
        sock.sendall(REQUEST)
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 "), reply
    assert b"connection: close\r\n" in reply


def test_the_drain_closes_a_connection_whose_next_request_does_not_come() -> None:
    """Nor one whose next request has begun and stalls: the drain does not wait for them."""
    app, loop = _ok_app()
    config = uvicorn.Config(app, lifespan="off", log_config=None, http=bounded_protocol(8, WAIT_S))
    server = uvicorn.Server(config)
    with _serving(server) as port, _connect(port) as idle, _connect(port) as stalled:
        for sock in (idle, stalled):
            sock.sendall(REQUEST)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        stalled.sendall(REQUEST[:20])
        loop[0].call_soon_threadsafe(_drain, server)
        assert _read_until_closed(idle) == b""
        assert _read_until_closed(stalled) == b""


class _Recording:
    """A transport that records each write and how it was made."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", [bytes(data)]))

    def writelines(self, parts: tuple[bytes, ...]) -> None:
        self.calls.append(("writelines", [bytes(p) for p in parts]))


def _cycle_transport(method: str) -> tuple[object, SimpleNamespace, _Recording, list[str]]:
    recording, ended = _Recording(), []
    connection = SimpleNamespace(transport=recording, end=lambda: ended.append("end"))
    cycle = SimpleNamespace(response_started=False, scope={"method": method})
    return server_module._CycleTransport(connection, cycle), cycle, recording, ended


def test_a_response_head_goes_out_with_its_first_body_bytes_in_one_write() -> None:
    transport, cycle, recording, _ = _cycle_transport("POST")
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # interim: before the response starts
    cycle.response_started = True
    transport.write(b"head")
    assert len(recording.calls) == 1  # the head waits for the body
    transport.write(b"body")
    transport.write(b"more")
    assert recording.calls == [
        ("write", [b"HTTP/1.1 100 Continue\r\n\r\n"]),
        ("writelines", [b"head", b"body"]),
        ("write", [b"more"]),
    ]


@pytest.mark.parametrize("method", ["HEAD", "POST"])
def test_a_response_without_body_writes_still_sends_its_head(method: str) -> None:
    """A HEAD response has no body write: its head goes at once; a response that closes the
    connection after its head alone sends the head before the close."""
    transport, cycle, recording, ended = _cycle_transport(method)
    cycle.response_started = True
    transport.write(b"head")
    transport.close()
    assert recording.calls == [("write", [b"head"])]
    assert ended == ["end"]


def test_uvicorn_builds_no_access_line(server, monkeypatch) -> None:
    """RequestMiddleware logs each request: uvicorn's protocol leaves its own line unmade."""
    from uvicorn.protocols.http import h11_impl, httptools_impl

    def access_line(scope: dict) -> str:
        raise AssertionError(f"uvicorn built an access line for {scope['path']}")

    for protocol in (h11_impl, httptools_impl):
        monkeypatch.setattr(protocol, "get_path_with_query_string", access_line)
    # as `moe-serve serve` leaves it (pytest's log capture hangs its own handlers on it)
    monkeypatch.setattr(logging.getLogger("uvicorn.access"), "handlers", [])
    url, _port = server
    with httpx.Client(base_url=url) as http:
        assert http.get("/health").status_code == 200
