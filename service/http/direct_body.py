"""A plain binary forward's body read by the connection straight into the memory it is served
from: pinned host memory in one process on a GPU, the front end's arena region behind
`--http-workers`.

uvicorn hands a body to the app in chunks: each is copied into a bytes object, appended to the
request's buffer and taken by the app's task at its next turn of the event loop, which copies it
once more into place: for a DeepSeek-V3-sized body, most of a request's host time
(`bench/request_timeline.py` stamps it). Here the connection's protocol is an
asyncio BufferedProtocol (uvloop and asyncio both read into the buffer it names): once the head
of a request that a `BodySink` takes is parsed, the socket is read into that body's own memory,
and the app awaits one future. Every other request's bytes go through a reused buffer to
uvicorn's parser as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httptools
from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..errors import body_cut, body_stalled

DIRECT_BODY = "moe_serve.direct_body"  # scope key: the request's DirectBody
_SCRATCH_BYTES = 256 << 10  # what the event loop reads at once for everything else (uvloop's)
# What it reads at once while it awaits a request head: the bytes after the head in that read go
# through the parser (which copies them into a bytes object) and are copied again into a direct
# body's target, so a read of the whole scratch would pass a quarter of a DeepSeek-V3-sized body
# that way. A head may be larger (MAX_HEAD_BYTES): it is parsed over several reads.
_HEAD_READ_BYTES = 16 << 10

Holder = TypeVar("Holder")


@dataclass(frozen=True)
class BodyTarget(Generic[Holder]):
    """Where a body goes (`into`: exactly its Content-Length bytes) and what the app serves it
    from (`holder`: the pinned memory with the reply's room, the arena region). `release` gives
    the holder back where no request will ever serve it (a request queued behind another on its
    connection when the client goes away: uvicorn never starts it); None: nothing to give back
    (memory the collector frees)."""

    into: memoryview
    holder: Holder
    release: Callable[[], None] | None = None


# (a request's scope once its head is parsed, its Content-Length) -> where its body goes, or
# None: the app reads it as usual. Called on the event loop for every request with a body.
BodySink = Callable[[Scope, int], BodyTarget[Any] | None]


class DirectBody(Generic[Holder]):
    """A body on its way into its target; the app awaits `read`. `left`: done once the
    connection is lost, the client gone (the connection's own, shared by its requests: the app
    adds callbacks to it, never cancels it), so a request in flight is withdrawn without a task
    that waits on `receive` for the disconnect."""

    def __init__(self, target: BodyTarget[Holder], left: asyncio.Future[None]) -> None:
        self.target = target
        self.left = left
        self.at = 0  # bytes of the body arrived
        self._into: memoryview | None = target.into  # None once discarded
        # False: the client left
        self._arrived: asyncio.Future[bool] = left.get_loop().create_future()

    @property
    def missing(self) -> int:
        return len(self.target.into) - self.at

    def room(self, scratch: memoryview) -> memoryview:
        """Where the socket's next bytes go: the body's own memory, or scratch once discarded."""
        return scratch[: self.missing] if self._into is None else self._into[self.at :]

    def advance(self, nbytes: int) -> None:
        self.at += nbytes

    def take(self, chunk: bytes) -> None:
        """Body bytes that came with the head (the parser saw them)."""
        if self._into is not None:
            self._into[self.at : self.at + len(chunk)] = chunk
        self.at += len(chunk)

    def arrive(self, complete: bool) -> None:
        if not self._arrived.done():
            self._arrived.set_result(complete)

    async def read(self, timeout_s: float) -> Holder:
        """The holder once the whole body is in it; 408 when it stalls past `timeout_s`, 499 when
        the client closes the connection first."""
        if not self._arrived.done():  # a large body may still be arriving as the app starts
            try:
                async with asyncio.timeout(timeout_s):
                    # awaited as it is (a shield would wake this task a turn of the event loop
                    # later); cancelled with the wait, it is never set nor read again
                    await self._arrived
            except TimeoutError:
                self.discard()
                raise body_stalled(timeout_s, self.at) from None
        if not self._arrived.result():
            raise body_cut(self.at)
        return self.target.holder

    def discard(self) -> None:
        """The app is done with the target (it answered early, or gave up waiting): the rest of
        the body is read and dropped, the connection carries on, the target is never written
        again. Nothing once the body has arrived."""
        self._into = None

    def abandon(self) -> None:
        """No request will serve this body (its connection is lost with it queued): the target
        is never written again and its holder goes back (`BodyTarget.release`)."""
        self.discard()
        self.arrive(False)
        if self.target.release is not None:
            self.target.release()


def _parser(protocol: HttpToolsProtocol) -> httptools.HttpRequestParser:
    """A parser as uvicorn's protocol makes one."""
    parser = httptools.HttpRequestParser(protocol)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)
    return parser


class DirectBodyProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, reading the socket into a buffer it names: the body's own
    memory while a `body_sink` target fills, else a reused buffer handed to the parser. The
    transport talks to it through a `BufferedConnection`."""

    body_sink: BodySink  # set by the subclass service.http.server makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._head_scratch = self._scratch[:_HEAD_READ_BYTES]
        self._awaiting_head = True
        self._direct: DirectBody[Any] | None = None
        self._left: asyncio.Future[None] = self.loop.create_future()  # DirectBody.left

    def get_buffer(self, sizehint: int) -> memoryview:  # noqa: ARG002 (asyncio's signature)
        if self._direct is not None:
            return self._direct.room(self._scratch)
        return self._head_scratch if self._awaiting_head else self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct is None:
            self.data_received(self._scratch[:nbytes])
            return
        self._direct.advance(nbytes)
        if self._direct.missing == 0:
            # the parser saw the head and the body's first bytes at most: a new one reads on
            self.parser = _parser(self)
            self.on_message_complete()

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        super().on_headers_complete()
        size = self._content_length()
        cycle = self.cycle
        if size is None or cycle is None or cycle.scope is not self.scope:
            return  # no body, chunked, or an upgrade (no cycle of its own)
        target = self.body_sink(self.scope, size)
        if target is None:
            return
        self._direct = DirectBody(target, self._left)
        self.scope[DIRECT_BODY] = self._direct  # the app's task has not run yet
        if cycle.waiting_for_100_continue:  # the app never asks for the body: ask for it here
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False

    def on_body(self, body: bytes) -> None:
        if self._direct is None:
            super().on_body(body)
        else:
            self._direct.take(body)

    def on_message_complete(self) -> None:
        self._awaiting_head = True
        if self._direct is not None:
            self._direct.arrive(True)
            self._direct = None
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._direct is not None:
            self._direct.arrive(False)
            self._direct = None
        for cycle, _ in self.pipeline:  # queued behind the request in flight: never started now
            if (queued := cycle.scope.get(DIRECT_BODY)) is not None:
                queued.abandon()
        if not self._left.done():
            self._left.set_result(None)
        super().connection_lost(exc)

    def _content_length(self) -> int | None:
        """The body's declared size; None without one, with two, or with Transfer-Encoding."""
        sizes = [v for k, v in self.headers if k == b"content-length"]
        chunked = any(k == b"transfer-encoding" for k, _ in self.headers)
        if chunked or len(sizes) != 1 or not sizes[0].isdigit() or int(sizes[0]) == 0:
            return None
        return int(sizes[0])


class BufferedConnection(asyncio.BufferedProtocol):
    """What the transport sees of a DirectBodyProtocol: uvloop reads into a protocol's buffer
    only when the protocol is not an asyncio.Protocol, as uvicorn's are."""

    def __init__(self, http: DirectBodyProtocol) -> None:
        self.http = http

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.http.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.http.buffer_updated(nbytes)
