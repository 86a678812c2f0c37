"""The socket between an HTTP front-end process and the engine process (`--http-workers`).

It carries records: a kind (1 byte), the payload's length (4 bytes, little-endian), the payload.
The per-request kinds are fixed structs, so a request costs the engine's event loop a few
struct unpacks rather than JSON; the first record one side writes in a turn of its event loop
goes out at once and the others of that turn in one write at its end, and each read hands over
every whole record it brought.

A front end sends HELLO once, JSON `{"hello": arena path, "size": bytes}` (the engine maps its
arena and answers HELLO `{"hello": "ok"}`), then per forward FORWARD (id, offset, body_bytes,
reply_capacity, layer_dtype, then the layer's name: a safetensors body lies in the arena at that
region; `layer_dtype`, set for a JSON forward the front end decoded: the reply's output in the
layer's dtype, not the body's) or FORWARD_JSON (id, offset, body_bytes, reply_capacity, then the
layer's name: a JSON body lies there as its client sent it, and the reply is JSON), CANCEL (id)
when its client goes away, and DONE (status, seconds, then the route) once a request is
answered (the engine keeps every metric). The engine answers each forward exactly once: REPLY
(id, status, bytes) with the reply in the region's reply part, or, for a JSON reply longer than
that part, followed by the reply itself; or ERROR (id, status, then JSON `{"error",
"headers"}`). Until then the region is the engine's.

DONE is no request's business: it waits for the next record the front end sends (after which it
goes, in the same write) or LATER_S at most, so that it costs neither side a wake-up of its own.
To count every request answered before a scrape, the engine sends SETTLE (empty): the front end
sends what it holds, then SETTLE back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import count
from pathlib import Path

from ..awake import Awake
from .arena import BodyArena, Region

log = logging.getLogger(__name__)

HELLO, FORWARD, FORWARD_JSON, CANCEL, DONE, REPLY, ERROR, SETTLE = b"HFJCDRES"  # record kinds
_HEAD = struct.Struct("<BI")  # kind, payload bytes
# id, offset, body_bytes, reply_capacity, layer_dtype; then the name
FORWARD_FIELDS = struct.Struct("<QQQQ?")
FORWARD_JSON_FIELDS = struct.Struct("<QQQQ")  # id, offset, body_bytes, reply_capacity; the name
CANCEL_FIELDS = struct.Struct("<Q")  # id
DONE_FIELDS = struct.Struct("<Hd")  # status, seconds; then the route
REPLY_FIELDS = struct.Struct("<QHQ")  # id, status, reply bytes; then the reply, if not in place
ERROR_FIELDS = struct.Struct("<QH")  # id, status; then JSON {"error", "headers"}
# How long a record sent `later` waits for the next record at most: what the metrics of a front
# end's requests lag by between scrapes (a scrape settles them)
LATER_S = 0.1


class RecordReader:
    """Bytes as they arrive -> whole records (kind, payload); a record cut by a read waits for
    the rest, gathered in a buffer that grows as it arrives (a reply carried whole is copied
    once, not once per read)."""

    def __init__(self, max_record_bytes: int | None = None) -> None:
        self._rest = bytearray()
        self._max = max_record_bytes
        self.too_long: str | None = None  # why reading stopped: a record over the maximum

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The whole records that `data` completes, in order (perhaps none yet); none from a
        record longer than `max_record_bytes` on (`too_long` says so), which is not gathered."""
        if self.too_long:
            return []
        if self._rest:
            self._rest += data
            data = self._rest
        records, at, end = [], 0, len(data)
        with memoryview(data) as view:
            while end - at >= _HEAD.size:
                kind, size = _HEAD.unpack_from(view, at)
                if self._max is not None and size > self._max:
                    self.too_long = f"a record of {size} bytes, over the {self._max} allowed"
                    break
                start = at + _HEAD.size
                if end - start < size:
                    break
                records.append((kind, bytes(view[start : start + size])))
                at = start + size
        if data is self._rest:
            del self._rest[:at]
        elif at < end:
            self._rest = bytearray(data[at:])
        return records


class RecordProtocol(asyncio.Protocol):
    """One end of the channel's socket: each read's whole records handed to `on_records` as
    they arrive, in the read's own callback (no task waits on a stream for them: a record is
    acted on a turn of the event loop sooner), and `on_lost` called once the socket closes."""

    def __init__(
        self,
        on_records: Callable[[list[tuple[int, bytes]]], None],
        on_lost: Callable[[], None],
        max_record_bytes: int | None = None,
    ) -> None:
        self.on_records = on_records
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._reader = RecordReader(max_record_bytes)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if records := self._reader.feed(data):
            self.on_records(records)
        if self._reader.too_long:
            self.refuse(self._reader.too_long)

    def refuse(self, why: str) -> None:
        """Drop the connection: the other side sent what no end of the channel sends."""
        log.warning("the channel's other end sent %s: its connection is closed", why)
        self.on_records = _drop
        if self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool:
        return False  # the transport closes: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 (asyncio's signature)
        self.on_lost()


def _drop(records: list[tuple[int, bytes]]) -> None:
    """Records read after a connection was refused, until its close."""


class RecordWriter:
    """Records to one socket: the first of a turn of the event loop goes out at once (a lone
    reply waits neither for the end of the turn nor for what the loop runs before it: a batch's
    metrics), those that follow it in the turn together at its end. A record sent `later` waits
    for the next one sent, and goes right after it, or LATER_S at most."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._transport = transport
        self._pending = bytearray()
        self._in_turn = False  # a record went out this turn: the next ones wait for `flush`
        self._later = bytearray()
        self._later_timer: asyncio.TimerHandle | None = None

    def send(self, kind: int, payload: bytes) -> None:
        record = _HEAD.pack(kind, len(payload)) + payload
        if self._later:
            record += self._later
            self._later = bytearray()
        self._send(record)

    def later(self, kind: int, payload: bytes) -> None:
        self._later += _HEAD.pack(kind, len(payload))
        self._later += payload
        if self._later_timer is None:
            self._later_timer = asyncio.get_running_loop().call_later(LATER_S, self.send_later)

    def send_later(self) -> None:
        """What waits to go `later`, now (as a record sent now goes)."""
        self._later_timer = None
        if self._later:
            records, self._later = self._later, bytearray()
            self._send(records)

    def _send(self, records: bytes | bytearray) -> None:
        if self._in_turn:
            self._pending += records
            return
        self._in_turn = True
        asyncio.get_running_loop().call_soon(self.flush)
        self._write(records)

    def flush(self) -> None:
        self._in_turn = False
        self._write(self._pending)
        self._pending = bytearray()

    def _write(self, data: bytes | bytearray) -> None:
        # no flow control: records are small but for a reply carried whole, which the other
        # side reads as it comes (RecordProtocol)
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        if self._later_timer is not None:
            self._later_timer.cancel()
        self._pending += self._later
        self._later = bytearray()
        self.flush()
        self._transport.close()


def hello(payload: dict) -> bytes:
    return json.dumps(payload).encode()


def error_payload(rid: int, status: int, error: str, headers: dict[str, str]) -> bytes:
    details = json.dumps({"error": error, "headers": headers}).encode()
    return ERROR_FIELDS.pack(rid, status) + details


@dataclass(frozen=True)
class Reply:
    status: int
    nbytes: int = 0  # the reply's size (status 200)
    error: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    data: memoryview | None = None  # the reply where it did not fit the region, else None


ENGINE_GONE = Reply(503, error="the engine process is gone; retry", headers={"Retry-After": "1"})


class EngineClient:
    """A front end's end of the channel: forwards bodies laid in its arena to the engine."""

    def __init__(
        self,
        path: Path,
        arena: BodyArena,
        on_lost: Callable[[], None],
        stay_awake: bool = False,
    ) -> None:
        self.path = path
        self.arena = arena
        self.on_lost = on_lost  # the engine closed the channel (it stopped or died)
        self.connected = False
        self._ids = count()
        # id -> the answer its caller awaits, and its region
        self._pending: dict[int, tuple[asyncio.Future[Reply], Region]] = {}
        self._out: RecordWriter | None = None
        self._hello: asyncio.Future[list | None] | None = None  # the engine's answer to HELLO
        self._closed: asyncio.Future[None] | None = None  # done once the socket has closed
        # `stay_awake` (an engine on a GPU): awake while a forward is the engine's, and a moment
        # after, so that its reply, then the client's next request, are read as they arrive; an
        # engine on the CPU needs every core for its forwards
        self.awake = Awake(allowed=lambda: stay_awake)

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        self._hello, self._closed = loop.create_future(), loop.create_future()
        transport, protocol = await loop.create_unix_connection(
            lambda: RecordProtocol(self._on_hello, self._lost), self.path
        )
        self._out = RecordWriter(transport)
        self._out.send(HELLO, hello({"hello": str(self.arena.path), "size": self.arena.size}))
        answer = await self._hello
        if answer is None or answer[0][0] != HELLO or json.loads(answer[0][1]) != {"hello": "ok"}:
            self._out.close()
            raise ConnectionError(f"the engine refused the arena: {answer}")
        self.connected = True
        protocol.on_records = self._on_records
        self._on_records(answer[1:])  # what the engine sent after its answer (a scrape's SETTLE)

    async def close(self) -> None:
        self.on_lost = lambda: None  # closed on purpose
        if self._out is not None:
            self._out.close()
            await self._closed

    async def forward(
        self,
        layer: str,
        region: Region,
        gone: asyncio.Future,
        layer_dtype: bool = False,
    ) -> Reply:
        """The engine's answer to the safetensors body in `region`; withdrawn once `gone` is
        done (the client left: a future of the caller's, which this only adds a callback to).
        The region is the engine's until it answers: the caller frees it after reading the
        reply, or, if the caller is cancelled, the answer's arrival does."""
        fields = (region.offset, region.body_bytes, region.reply_capacity, layer_dtype)
        return await self._ask(FORWARD, FORWARD_FIELDS, fields, layer, region, gone)

    async def forward_json(self, layer: str, region: Region, gone: asyncio.Future) -> Reply:
        """As `forward`, for the JSON body in `region`: the engine parses it and answers JSON."""
        fields = (region.offset, region.body_bytes, region.reply_capacity)
        return await self._ask(FORWARD_JSON, FORWARD_JSON_FIELDS, fields, layer, region, gone)

    async def _ask(
        self,
        kind: int,
        layout: struct.Struct,
        fields: tuple,
        layer: str,
        region: Region,
        gone: asyncio.Future,
    ) -> Reply:
        """The request's answer, awaited as it is: no watcher task, nor asyncio.wait, per
        request (each costs the event loop turns between the reply's arrival and the response,
        `moe-serve bench service --mode path`). A withdrawn request is answered too (499)."""
        rid = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._pending[rid] = (answer, region)
        self._out.send(kind, layout.pack(rid, *fields) + layer.encode())
        withdraw = partial(self._withdraw, rid)
        gone.add_done_callback(withdraw)
        self.awake.hold()
        try:
            return await answer
        except asyncio.CancelledError:
            if answer.cancelled():  # still the engine's: its answer frees the region (_read)
                self._withdraw(rid)
            else:  # answered as the caller was cancelled: no one reads the reply
                self.arena.free(region)
            raise
        finally:
            self.awake.release()
            gone.remove_done_callback(withdraw)

    def _withdraw(self, rid: int, _: object = None) -> None:
        """CANCEL for request `rid`, unless the engine has answered it."""
        if rid in self._pending and self.connected:
            self._out.send(CANCEL, CANCEL_FIELDS.pack(rid))

    def done(self, route: str, status: int, seconds: float) -> None:
        """A request this front end answered, for the engine's metrics (sent `later`)."""
        if self.connected:
            self._out.later(DONE, DONE_FIELDS.pack(status, seconds) + route.encode())

    def _on_hello(self, records: list[tuple[int, bytes]]) -> None:
        """The engine's answer to HELLO, then what it sends until `connect` takes them."""
        if not self._hello.done():
            self._hello.set_result(records)
        elif self._hello.result() is not None:
            self._hello.result().extend(records)

    def _on_records(self, records: list[tuple[int, bytes]]) -> None:
        for kind, payload in records:
            if kind == REPLY:
                rid, status, nbytes = REPLY_FIELDS.unpack_from(payload)
                data = memoryview(payload)[REPLY_FIELDS.size :] or None
                self._answer(rid, Reply(status, nbytes, data=data))
            elif kind == ERROR:
                rid, status = ERROR_FIELDS.unpack_from(payload)
                details = json.loads(payload[ERROR_FIELDS.size :])
                self._answer(rid, Reply(status, **details))
            elif kind == SETTLE:  # what waits to go later, then SETTLE: the engine scrapes
                self._out.later(SETTLE, b"")
                self._out.send_later()

    def _lost(self) -> None:
        """The socket has closed: every forward still the engine's is answered ENGINE_GONE."""
        connected, self.connected = self.connected, False
        if not self._hello.done():  # closed before the engine answered HELLO
            self._hello.set_result(None)
        for rid in list(self._pending):
            self._answer(rid, ENGINE_GONE)
        self._closed.set_result(None)
        if connected:
            self.on_lost()

    def _answer(self, rid: int, reply: Reply) -> None:
        """The engine has answered request `rid`: its region is no longer the engine's."""
        answer, region = self._pending.pop(rid)
        if answer.cancelled():  # its caller gave up waiting
            self.arena.free(region)
        else:
            answer.set_result(reply)
