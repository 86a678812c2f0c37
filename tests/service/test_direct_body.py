"""The connection reads a body a sink takes straight into its target (service/http/direct_body.py):
a real uvicorn server on both event loops, raw sockets sending the bytes as a client may."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import socket
import struct
import threading
import time
from collections.abc import Iterator
from functools import partial

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from moe_serve.service.errors import ServiceError
from moe_serve.service.http.direct_body import DIRECT_BODY, BodyTarget, DirectBody
from moe_serve.service.http.server import bounded_protocol, listen

TIMEOUT_S = 1.0
SIZE = 300_000  # over the 256 KiB the loop reads at once for other requests


class Sink:
    """Takes the bodies of POST /direct and /early into buffers it keeps."""

    def __init__(self) -> None:
        self.targets: list[bytearray] = []
        self.statuses: list[int] = []  # each answer's, as the app sent it
        self.released: list[int] = []  # the targets given back unserved, by index

    def __call__(self, scope: Scope, size: int) -> BodyTarget[bytearray] | None:
        if scope["path"] not in ("/direct", "/early", "/left"):
            return None
        memory = bytearray(size)
        self.targets.append(memory)
        release = partial(self.released.append, len(self.targets) - 1)
        return BodyTarget(memoryview(memory), memory, release)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """/direct: the digest of the direct body; /early: answers without it; /left: whether the
        client left once its body came; else the digest of the body read through `receive`."""
        if scope["type"] == "http":
            status, text = await _answer(scope, receive)
            self.statuses.append(status)
            body = text.encode()
            length = [(b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": length})
            await send({"type": "http.response.body", "body": body})


async def _answer(scope: Scope, receive: Receive) -> tuple[int, str]:
    direct: DirectBody[bytearray] | None = scope.get(DIRECT_BODY)
    status, text = 200, "none"
    if scope["path"] == "/early":
        direct.discard()
        text = "early"
    elif scope["path"] == "/left":  # waits, its body read, for the client to leave
        await direct.read(TIMEOUT_S)
        done, _ = await asyncio.wait({direct.left}, timeout=TIMEOUT_S)
        status, text = (499, "left") if done else (200, "stayed")
    elif direct is not None:
        try:
            text = "direct " + hashlib.sha256(await direct.read(TIMEOUT_S)).hexdigest()
        except ServiceError as err:
            status, text = err.status, type(err).__name__
    else:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        text = "receive " + hashlib.sha256(body).hexdigest()
    return status, text


@contextlib.contextmanager
def server(loop: str, sink: Sink) -> Iterator[int]:
    protocol = bounded_protocol(16, TIMEOUT_S, sink)
    config = uvicorn.Config(
        sink.app, http=protocol, loop=loop, log_config=None, lifespan="off", interface="asgi3"
    )
    running = uvicorn.Server(config)
    listener = listen("127.0.0.1", 0)
    thread = threading.Thread(target=running.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not running.started:
        assert thread.is_alive()
        time.sleep(0.01)
    try:
        yield listener.getsockname()[1]
    finally:
        running.should_exit = True
        thread.join(5)


@pytest.fixture(params=["asyncio", "uvloop"])
def port_and_sink(request: pytest.FixtureRequest) -> Iterator[tuple[int, Sink]]:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    sink = Sink()
    with server(request.param, sink) as port:
        yield port, sink


def _head(path: str, size: int, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {size}\r\n{extra}\r\n".encode()


class Responses:
    """The responses on a connection, in order (an interim 100 Continue skipped)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.data = sock, b""

    def next(self) -> tuple[int, bytes]:
        head = self._until_blank_line()
        if head.startswith(b"HTTP/1.1 100"):
            head = self._until_blank_line()
        lines = head.split(b"\r\n")
        fields = dict(line.split(b": ", 1) for line in lines[1:])
        length = int(fields[b"content-length"])
        while len(self.data) < length:
            self._recv()
        body, self.data = self.data[:length], self.data[length:]
        return int(lines[0].split()[1]), body

    def _until_blank_line(self) -> bytes:
        while b"\r\n\r\n" not in self.data:
            self._recv()
        head, self.data = self.data.split(b"\r\n\r\n", 1)
        return head

    def _recv(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, "the server closed the connection"
        self.data += chunk


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    return Responses(sock).next()


def _digest(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest().encode()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@pytest.mark.parametrize("pieces", [1, 2, 7])
def test_a_body_sent_in_pieces_lands_whole_in_its_target(port_and_sink, pieces: int) -> None:
    port, sink = port_and_sink
    body = bytes(range(256)) * (SIZE // 256) + b"tail"
    message = _head("/direct", len(body)) + body
    cuts = [len(message) * i // pieces for i in range(pieces + 1)]
    with _connect(port) as sock:
        for start, end in itertools.pairwise(cuts):
            sock.sendall(message[start:end])
            time.sleep(0.01)
        assert _read_response(sock) == (200, b"direct " + _digest(body))
    assert bytes(sink.targets[-1]) == body


def test_requests_after_a_direct_body_on_one_connection_parse_as_usual(port_and_sink) -> None:
    port, _ = port_and_sink
    first, second, third = b"a" * SIZE, b"b" * 1000, b"c" * (SIZE + 1)
    with _connect(port) as sock:  # pipelined: all three before any answer
        sock.sendall(
            _head("/direct", len(first)) + first + _head("/other", len(second)) + second
            + _head("/direct", len(third)) + third
        )  # fmt: skip
        responses = Responses(sock)
        assert responses.next() == (200, b"direct " + _digest(first))
        assert responses.next() == (200, b"receive " + _digest(second))
        assert responses.next() == (200, b"direct " + _digest(third))


def test_a_body_the_sink_declines_reaches_the_app_as_usual(port_and_sink) -> None:
    port, sink = port_and_sink
    body = b"x" * SIZE
    with _connect(port) as sock:
        sock.sendall(_head("/other", len(body)) + body)
        assert _read_response(sock) == (200, b"receive " + _digest(body))
    assert sink.targets == []


def test_a_discarded_target_is_not_written_and_the_connection_goes_on(port_and_sink) -> None:
    port, sink = port_and_sink
    body = b"z" * SIZE
    with _connect(port) as sock:
        sock.sendall(_head("/early", len(body)) + body[:1000])
        assert _read_response(sock) == (200, b"early")
        sock.sendall(body[1000:] + _head("/direct", 5) + b"hello")
        assert _read_response(sock) == (200, b"direct " + _digest(b"hello"))
    assert bytes(sink.targets[0]) == body[:1000] + bytes(SIZE - 1000)  # nothing after discard


def test_expect_100_continue_is_answered_before_the_body(port_and_sink) -> None:
    port, _ = port_and_sink
    body = b"e" * SIZE
    with _connect(port) as sock:
        sock.sendall(_head("/direct", len(body), "Expect: 100-continue\r\n"))
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        assert _read_response(sock) == (200, b"direct " + _digest(body))


def test_a_stalled_body_gets_408(port_and_sink) -> None:
    port, _ = port_and_sink
    with _connect(port) as sock:
        sock.sendall(_head("/direct", SIZE) + b"only this")
        assert _read_response(sock) == (408, b"RequestTimeout")


def test_a_client_gone_mid_body_is_a_499_and_the_server_serves_on(port_and_sink) -> None:
    port, sink = port_and_sink
    with _connect(port) as sock:
        sock.sendall(_head("/direct", SIZE) + b"part")
        time.sleep(0.05)
    deadline = time.monotonic() + TIMEOUT_S / 2  # well before a 408
    while not sink.statuses and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.statuses == [499]
    with _connect(port) as sock:  # the server is fine
        sock.sendall(_head("/direct", 3) + b"abc")
        assert _read_response(sock) == (200, b"direct " + _digest(b"abc"))


def test_a_client_gone_after_its_body_came_is_seen_by_its_request(port_and_sink) -> None:
    """DirectBody.left: the connection's loss reaches a request whose body has arrived, with no
    task of its own waiting on `receive`."""
    port, sink = port_and_sink
    deadline = time.monotonic() + TIMEOUT_S * 2
    with _connect(port) as sock:
        sock.sendall(_head("/left", 3) + b"abc")
        while not sink.targets and time.monotonic() < deadline:  # the server has the request
            time.sleep(0.01)
    while not sink.statuses and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.statuses == [499]


def test_a_body_queued_behind_another_is_given_back_when_its_client_goes(port_and_sink) -> None:
    """A request pipelined behind one in flight has its target when its head is parsed; a
    client that resets the connection before it starts means uvicorn never starts it: the
    connection gives its target back (an arena region would otherwise stay taken for good),
    and only that one. (uvicorn reads nothing while a request is queued, so the server sees the
    reset when it writes the first answer.)"""
    port, sink = port_and_sink
    deadline = time.monotonic() + TIMEOUT_S * 3
    with _connect(port) as sock:
        sock.sendall(_head("/left", 3) + b"abc" + _head("/direct", 5) + b"hello")
        while len(sink.targets) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sink.targets) == 2
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset
    while not sink.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.released == [1]
    assert len(sink.statuses) == 1  # the first ran; the second never did
