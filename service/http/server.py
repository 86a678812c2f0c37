"""The uvicorn server as `moe-serve serve` runs it, with the bounds uvicorn lacks, added to its
HTTP protocol (which also answers bytes that are not HTTP in the service's JSON error shape):

- at most `max_connections` open connections: a request on a connection beyond them gets a
  JSON 503 (the probes and /metrics still answer) and its connection is closed;
- a request head must arrive within `read_timeout_s` of the connection opening or of the last
  response: uvicorn closes idle keep-alive connections, but never one whose client sent part of
  its headers and stalled. The body's deadline is the app's (`service.http.body.read_body`: 408);
- a request head may hold at most MAX_HEAD_BYTES, else a JSON 431 and the connection closed:
  httptools buffers a head of any size (h11, uvicorn's other parser, has a limit of its own);
- no request is lost where uvicorn ends a connection (`_HttpToolsConnection`): a reply that
  closes the connection before its request's body came still reaches the client (the
  connection lingers), requests followed by the client's half-close are answered, and the
  drain gives a connection between requests a moment for its next request, and answers it;
- a response the client stops reading: once the connection's send buffer is full, it must
  drain within `write_timeout_s`, else the connection is dropped (uvicorn would wait forever,
  holding the response and whatever the request holds).

It also lets a body gather up to BODY_BUFFER_BYTES before it pauses reading the socket (uvicorn
pauses past 64 KB until the app takes what came, so a DeepSeek-V3-sized request would cross the
event loop a dozen times on its way in), and, given a `BodySink`, reads the bodies it takes
straight into their memory (`service/http/direct_body.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import select
import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http import h11_impl, httptools_impl
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .direct_body import BodySink, BufferedConnection, DirectBodyProtocol

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..settings import Settings

log = logging.getLogger(__name__)

OVER_CAPACITY = "moe_serve.over_capacity"  # scope key: the connection is beyond max_connections
# Body bytes a connection holds before it stops reading (per connection, at most this much more
# memory than uvicorn's 64 KB; max_connections bounds the connections).
BODY_BUFFER_BYTES = 4 << 20
# A request head's bytes (request line and headers) before the connection is refused: h11's limit
# is 16 KiB, nginx's default 32 KiB; bearer tokens and KServe's headers take a few KiB.
MAX_HEAD_BYTES = 64 << 10


def listen(host: str, port: int, what: str = "HTTP, --port") -> socket.socket:
    """A socket bound to host:port, so that a port in use is known before anything loads
    (uvicorn would find out after the app has started, and log it). `what`: the listener and
    the option that sets its port, for the error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as err:
        listener.close()
        raise ValueError(f"cannot listen on {host}:{port} ({what}): {err.strerror}") from None
    return listener


def server_config(app: FastAPI, settings: Settings, uds: str | None = None) -> uvicorn.Config:
    """As `moe-serve serve` runs it; on a Unix socket `uds` behind the --http-workers front
    ends, each of which may relay up to max_connections (and reads what it relays as fast as
    its client does: the front end's own connection has the write timeout)."""
    connections = settings.max_connections * (settings.front_ends() if uds else 1)
    timeout_s = settings.read_timeout_s
    return uvicorn.Config(
        app,
        uds=uds,
        log_config=None,  # keep the handlers service.logs installed
        # RequestMiddleware logs each request; without this uvicorn's protocol would still build
        # the arguments of its access line (which service.logs drops) for every response
        access_log=False,
        timeout_graceful_shutdown=settings.drain_timeout_s,
        http=bounded_protocol(
            connections, timeout_s, app.state.body_sink, None if uds else timeout_s
        ),
    )


def bounded_protocol(
    max_connections: int,
    read_timeout_s: float,
    body_sink: BodySink | None = None,
    write_timeout_s: float | None = None,
) -> Callable[..., asyncio.BaseProtocol]:
    """uvicorn's HTTP protocol (h11, or httptools when installed) with the bounds (no write
    timeout when `write_timeout_s` is None), reading the bodies `body_sink` takes straight into
    place (with httptools only); uvicorn calls it with its keyword arguments for each
    connection."""
    # uvicorn has no setting for it: its protocols read the module's constant at each body chunk
    for protocol in (h11_impl, httptools_impl):
        protocol.HIGH_WATER_LIMIT = BODY_BUFFER_BYTES
    direct = body_sink is not None and AutoHTTPProtocol is httptools_impl.HttpToolsProtocol
    base = DirectBodyProtocol if direct else AutoHTTPProtocol
    httptools = issubclass(base, httptools_impl.HttpToolsProtocol)
    bases = (_HttpToolsConnection, base) if httptools else (base,)

    class BoundedHTTPProtocol(*bases):
        _head_deadline: asyncio.TimerHandle | None = None
        _write_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.app = _flag_over_capacity(self.app)
                self.body_sink = _no_target  # its requests get a 503, their bodies no memory
            self._await_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_head()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": msg}).encode()
            self.transport.write(_reply_head("400 Bad Request", body) + body)
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            self._written()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if write_timeout_s is not None and self._write_deadline is None:
                self._write_deadline = self.loop.call_later(write_timeout_s, self._write_overdue)

        def resume_writing(self) -> None:
            self._written()
            super().resume_writing()

        def _written(self) -> None:
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def _write_overdue(self) -> None:
            """The client has not drained a full send buffer in time: reset the connection.
            Abort, as close would wait for the buffer to be sent, and linger 0, else the kernel
            would go on holding its own buffer for the client."""
            self._write_deadline = None
            log.info("resetting a connection: its client did not read its response for %g s",
                     write_timeout_s)  # fmt: skip
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

        def _await_head(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            overdue = self._head_overdue
            self._head_deadline = self.loop.call_later(read_timeout_s, overdue, self.cycle)

        def _head_overdue(self, cycle: object) -> None:
            """Close the connection unless a request has started since the deadline was set."""
            idle = cycle is None or cycle.response_complete
            if self.cycle is cycle and idle and not self.transport.is_closing():
                log.info("closing a connection: no request head within %g s", read_timeout_s)
                self.transport.close()

    if not direct:
        return BoundedHTTPProtocol
    BoundedHTTPProtocol.body_sink = staticmethod(body_sink)
    return lambda **kwargs: BufferedConnection(BoundedHTTPProtocol(**kwargs))


class _HttpToolsConnection(httptools_impl.HttpToolsProtocol):
    """uvicorn's httptools protocol with what it lacks over a connection's life:

    - a head limit: the bytes of each request head are counted as they arrive; past
      MAX_HEAD_BYTES, a 431. A chunk is counted when the parser was reading a head before and
      after it and no head ended in it; the chunk that ends one message and starts the next
      (pipelining) is not, so a head may pass the limit by one read's worth before it is refused;
    - a close that lingers: when the connection closes while the client may still be sending
      its request (the 431, or an answer given before its body came that says
      `Connection: close`: a 408, the front ends' 405), the reply is followed by the end of the
      stream and what the client still sends is read and dropped for a moment before the
      connection closes: closing on unread bytes would reset the connection, and the client
      could lose the reply;
    - a half-close: a client that ends its stream after whole requests (shutdown(SHUT_WR)) sends
      no more, it has not left: its requests are answered, then the connection is closed
      (uvicorn takes the end of the stream for a disconnect and drops them). A request cut
      short by it never completes: that connection is closed at once. The end of the stream
      alone does not tell a half-close from a client that closed the connection (and whose
      requests are withdrawn, sparing the work): a Unix socket tells at once, and a TCP client
      that has closed answers bytes with a reset. Those bytes are a `100 Continue` (a client
      must take a 1xx it did not ask for) before the response, and the connection is checked
      every _LEFT_CHECK_S until its response is sent;
    - the drain (uvicorn's `shutdown`): uvicorn closes every connection between requests at
      once, and with it a request that has begun to arrive on it (read, or still in the
      socket), or that the client sends just then: an active client's connection is between
      requests for a moment after each response. Here such a connection waits _DRAIN_IDLE_S
      for its next request, which is answered, as one in flight is, with `Connection: close`;
    - the keep-alive timeout spares a connection whose next request waits in the socket unread
      (the event loop was busy): it is served. What no server can spare is a request whose
      first byte arrives after the close: its client finds the connection closed with nothing
      read, and can tell that nothing of it was done.
    """

    _in_head = True  # awaiting or reading a request head
    _heads = 0  # heads parsed on this connection
    _head_bytes = 0
    _open = False  # a request has begun to arrive and not all of it has
    _draining = False
    _lingering = False
    _dropped = 0  # bytes read and dropped while lingering

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._dropped += len(data)
            if self._dropped > _DISCARD_BYTES:
                self.transport.abort()
            return
        in_head, heads = self._in_head, self._heads
        super().data_received(data)
        still = in_head and self._in_head and self._heads == heads
        if still and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()

    def eof_received(self) -> bool | None:
        """True keeps the connection open to answer the requests already whole, unless the
        client has closed both ways (left: its requests are withdrawn, as uvicorn does)."""
        last = self.pipeline[0][0] if self.pipeline else self.cycle
        if self._lingering or self._open or last is None or last.response_complete:
            return None  # the transport closes
        if self._client_left():
            return None
        last.keep_alive = False  # closed once its response is sent
        cycle = self.cycle
        if not cycle.response_started and cycle.scope["http_version"] == "1.1":
            # a TCP client that closed both ways answers bytes with a reset: the check sees it
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        self.loop.call_later(_LEFT_CHECK_S, self._check_client)
        return True

    def shutdown(self) -> None:
        self._draining = True  # on_headers_complete: each request read from now is the last
        if self.cycle is not None and not self.cycle.response_complete:
            super().shutdown()  # the request in flight is the last
        elif not self._lingering:
            self.loop.call_later(_DRAIN_IDLE_S, self._drain_idle)

    def _drain_idle(self) -> None:
        """The drain's wait for a connection's next request is over: closed unless a request
        is in flight (then it closes after the response) or waits in the socket."""
        if self.transport.is_closing() or (self.cycle and not self.cycle.response_complete):
            return
        if self._unread():
            self.loop.call_later(_DRAIN_IDLE_S, self._drain_idle)
        else:
            self.end()  # a request head that has not all come on time is not waited for

    def timeout_keep_alive_handler(self) -> None:
        if not self._unread():  # a request arrives just as the connection idles out: served
            super().timeout_keep_alive_handler()

    def on_message_begin(self) -> None:
        self._open = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads += 1
        self._head_bytes = 0
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            cycle.transport = _CycleTransport(self, cycle)
            if self._draining:
                cycle.keep_alive = False

    def on_message_complete(self) -> None:
        self._open = False
        super().on_message_complete()
        self._in_head = True

    def on_response_complete(self) -> None:
        if not self._lingering:
            super().on_response_complete()

    def end(self) -> None:
        """Close the connection, lingering while its request still arrives (what a request
        cycle's close does, see _CycleTransport)."""
        if self._lingering:
            return  # closes as the lingering ends
        if self._open and not self.transport.is_closing():
            self._linger()
        else:
            self.transport.close()

    def _refuse_head(self) -> None:
        log.info("refusing a request head of over %d bytes", MAX_HEAD_BYTES)
        what = f"the request head (request line and headers) is over {MAX_HEAD_BYTES} bytes"
        body = json.dumps({"error": what}).encode()
        self.transport.write(_reply_head("431 Request Header Fields Too Large", body) + body)
        self._linger()

    def _linger(self) -> None:
        """The end of the stream after what was written; what the client still sends is read
        and dropped for _DISCARD_S at most (and _DISCARD_BYTES: past them it is reset), then the
        connection closes (at once when the client closes its end)."""
        self.transport.write_eof()
        self._lingering = True
        self.flow.resume_reading()
        self.loop.call_later(_DISCARD_S, self.transport.close)

    def _check_client(self) -> None:
        """While a half-closed connection's requests are answered: a client found gone has its
        requests withdrawn (the connection drops, as when it leaves mid-request)."""
        if self.transport.is_closing():
            return
        if self._client_left():
            log.debug("dropping a half-closed connection: its client has closed it")
            self.transport.abort()
        else:
            self.loop.call_later(_LEFT_CHECK_S, self._check_client)

    def _client_left(self) -> bool:
        """Whether the client has closed the connection both ways: a Unix socket says so once
        it has, TCP once the client has answered bytes sent to it with a reset."""
        return self._polled(0)  # POLLHUP and POLLERR, which poll always reports

    def _unread(self) -> bool:
        """Whether bytes (or the end of the stream) wait in the socket, not read yet."""
        return self._polled(select.POLLIN)

    def _polled(self, events: int) -> bool:
        sock = self.transport.get_extra_info("socket")
        # closed: a client that reset the connection leaves uvicorn's keep-alive timer armed
        if sock is None or sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), events)
        return bool(poller.poll(0))


class _CycleTransport:
    """The transport as uvicorn's request cycle sees it (it writes, asks whether the connection
    is closing, and closes it once a response says `Connection: close`): its close is the
    connection's, which lingers while the request still arrives.

    The response's head goes out with the body's first bytes, in one vectored write: uvicorn
    writes the head as the app starts its response, so a reply would take a send of its own
    for the head, and the client a wake-up, before its body."""

    def __init__(
        self, connection: _HttpToolsConnection, cycle: httptools_impl.RequestResponseCycle
    ) -> None:
        self.connection = connection
        self.cycle = cycle
        self._head: bytes | None = None  # the response's head, until the body's first write
        self._headed = False  # the head has been written (or is held)

    def write(self, data: bytes | memoryview) -> None:
        transport = self.connection.transport
        if transport.is_closing():
            # the client left: dropped, as uvicorn drops a disconnected cycle's writes (it marks
            # only the connection's last cycle so, and uvloop refuses a closed handle's write)
            return
        if self._head is not None:
            head, self._head = self._head, None
            transport.writelines((head, data))
        elif self.cycle.response_started and not self._headed:
            # an interim 100 Continue comes before the response starts; a HEAD request's
            # response has no body to write
            self._headed = True
            if self.cycle.scope["method"] == "HEAD":
                transport.write(data)
            else:
                self._head = data
        else:
            transport.write(data)

    def is_closing(self) -> bool:
        return self.connection._lingering or self.connection.transport.is_closing()

    def close(self) -> None:
        if self._head is not None:  # a response that ends with its head
            head, self._head = self._head, None
            self.connection.transport.write(head)
        self.connection.end()


# During the drain, how long a connection between requests waits for its next request before
# it closes: an active client sends it within moments of its last response.
_DRAIN_IDLE_S = 1.0
# How often a half-closed connection whose requests are being answered checks that its client
# is still there: a client that has closed both ways has its requests withdrawn within this.
_LEFT_CHECK_S = 0.1
_DISCARD_S = 1.0  # how long a lingering connection discards the client's bytes at most
_DISCARD_BYTES = 1 << 20  # and how many: past them it is reset


def _reply_head(status: str, body: bytes) -> bytes:
    """The head of a JSON error in the service's shape, closing the connection."""
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
    return (head + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()


async def client_gone(receive: Receive) -> None:
    """Returns once the client has gone (its body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _no_target(scope: Scope, size: int) -> None:  # noqa: ARG001 (a BodySink)
    return None


def _flag_over_capacity(app: object) -> object:
    async def flagged(scope: Scope, receive: Receive, send: Send) -> None:
        scope[OVER_CAPACITY] = True
        await app(scope, receive, send)

    return flagged
