"""The socket between an HTTP front-end process and the engine process (`--http-workers`).

It carries records: a kind (1 byte), the payload's length (4 bytes, little-endian), the payload.
The per-request kinds are fixed structs, so a request costs the engine's event loop a few
struct unpacks rather than JSON; the first record one side writes in a turn of its event loop
goes out at once and the others of that turn in one write at its end, and each read hands over
every whole record it brought.

A front end sends HELLO once, JSON `{"hello": arena path, "size": bytes}` (the engine maps its
arena and answers HELLO `{"hello": "ok"}`), then per binary forward FORWARD (id, offset,
body_bytes, reply_capacity, layer_dtype, then the layer's name: the body lies in the arena at
that region; `layer_dtype`, set for a JSON forward: the reply's output in the layer's dtype,
not the body's), CANCEL (id) when its client goes away, and DONE (status, seconds, then the
route) once a request is answered (the engine keeps every metric). The engine answers each
forward exactly once: REPLY (id, status, bytes) with the reply blob in the region's reply part,
or ERROR (id, status, then JSON `{"error", "headers"}`); until then the region is the engine's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

from .arena import BodyArena, Region

log = logging.getLogger(__name__)

HELLO, FORWARD, CANCEL, DONE, REPLY, ERROR = b"HFCDRE"  # record kinds
_HEAD = struct.Struct("<BI")  # kind, payload bytes
# id, offset, body_bytes, reply_capacity, layer_dtype; then the name
FORWARD_FIELDS = struct.Struct("<QQQQ?")
CANCEL_FIELDS = struct.Struct("<Q")  # id
DONE_FIELDS = struct.Struct("<Hd")  # status, seconds; then the route
REPLY_FIELDS = struct.Struct("<QHQ")  # id, status, reply bytes
ERROR_FIELDS = struct.Struct("<QH")  # id, status; then JSON {"error", "headers"}
_READ_BYTES = 1 << 16


class RecordReader:
    """Bytes as they arrive -> whole records (kind, payload); a record cut by a read waits for
    the rest."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._rest = b""

    async def read(self) -> list[tuple[int, bytes]] | None:
        """The whole records of the next read (perhaps none yet), or None once the other side
        has closed the socket."""
        try:
            data = await self._reader.read(_READ_BYTES)
        except ConnectionError:
            return None
        if not data:
            return None
        if self._rest:
            data = self._rest + data
        records, at, end = [], 0, len(data)
        while end - at >= _HEAD.size:
            kind, size = _HEAD.unpack_from(data, at)
            start = at + _HEAD.size
            if end - start < size:
                break
            records.append((kind, data[start : start + size]))
            at = start + size
        self._rest = data[at:]
        return records


class RecordWriter:
    """Records to one socket: the first of a turn of the event loop goes out at once (a lone
    reply waits neither for the end of the turn nor for what the loop runs before it: a batch's
    metrics), those that follow it in the turn together at its end."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending = bytearray()
        self._in_turn = False  # a record went out this turn: the next ones wait for `flush`

    def send(self, kind: int, payload: bytes) -> None:
        if self._in_turn:
            self._pending += _HEAD.pack(kind, len(payload))
            self._pending += payload
            return
        self._in_turn = True
        asyncio.get_running_loop().call_soon(self.flush)
        self._write(_HEAD.pack(kind, len(payload)) + payload)

    def flush(self) -> None:
        self._in_turn = False
        self._write(self._pending)
        self._pending = bytearray()

    def _write(self, data: bytes | bytearray) -> None:
        if data and not self._writer.is_closing():  # records are small: no flow control
            self._writer.write(data)

    def close(self) -> None:
        self.flush()
        self._writer.close()


def hello(payload: dict) -> bytes:
    return json.dumps(payload).encode()


def error_payload(rid: int, status: int, error: str, headers: dict[str, str]) -> bytes:
    details = json.dumps({"error": error, "headers": headers}).encode()
    return ERROR_FIELDS.pack(rid, status) + details


@dataclass(frozen=True)
class Reply:
    status: int
    nbytes: int = 0  # the reply blob's size in the region (status 200)
    error: str = ""
    headers: dict[str, str] = field(default_factory=dict)


ENGINE_GONE = Reply(503, error="the engine process is gone; retry", headers={"Retry-After": "1"})


class EngineClient:
    """A front end's end of the channel: forwards bodies laid in its arena to the engine."""

    def __init__(self, path: Path, arena: BodyArena, on_lost: Callable[[], None]) -> None:
        self.path = path
        self.arena = arena
        self.on_lost = on_lost  # the engine closed the channel (it stopped or died)
        self.connected = False
        self._ids = count()
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._out: RecordWriter | None = None
        self._reading: asyncio.Task | None = None

    async def connect(self) -> None:
        reader, writer = await asyncio.open_unix_connection(self.path)
        self._out = RecordWriter(writer)
        self._out.send(HELLO, hello({"hello": str(self.arena.path), "size": self.arena.size}))
        records = RecordReader(reader)
        answer: list | None = []
        while answer == []:
            answer = await records.read()
        if answer is None or answer[0][0] != HELLO or json.loads(answer[0][1]) != {"hello": "ok"}:
            self._out.close()
            raise ConnectionError(f"the engine refused the arena: {answer}")
        self.connected = True
        self._reading = asyncio.create_task(self._read(records))

    async def close(self) -> None:
        self.on_lost = lambda: None  # closed on purpose
        if self._out is not None:
            self._out.close()
        if self._reading is not None:
            await self._reading

    async def forward(
        self,
        layer: str,
        region: Region,
        gone: Callable[[], Awaitable],
        layer_dtype: bool = False,
    ) -> Reply:
        """The engine's answer to the body in `region`; `gone()` returning first withdraws it.
        The region is the engine's until it answers: the caller frees it after reading the
        reply, or, if the caller is cancelled, the answer's arrival does."""
        rid = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._pending[rid] = answer
        fields = (rid, region.offset, region.body_bytes, region.reply_capacity, layer_dtype)
        self._out.send(FORWARD, FORWARD_FIELDS.pack(*fields) + layer.encode())
        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait((answer, watch), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done() and self.connected:
                self._out.send(CANCEL, CANCEL_FIELDS.pack(rid))
            return await asyncio.shield(answer)  # a withdrawn request is answered too (499)
        except asyncio.CancelledError:
            if self.connected:
                self._out.send(CANCEL, CANCEL_FIELDS.pack(rid))
            answer.add_done_callback(lambda _: self.arena.free(region))
            raise
        finally:
            watch.cancel()

    def done(self, route: str, status: int, seconds: float) -> None:
        if self.connected:
            self._out.send(DONE, DONE_FIELDS.pack(status, seconds) + route.encode())

    async def _read(self, records: RecordReader) -> None:
        while (got := await records.read()) is not None:
            for kind, payload in got:
                if kind == REPLY:
                    rid, status, nbytes = REPLY_FIELDS.unpack(payload)
                    self._pending.pop(rid).set_result(Reply(status, nbytes))
                elif kind == ERROR:
                    rid, status = ERROR_FIELDS.unpack_from(payload)
                    details = json.loads(payload[ERROR_FIELDS.size :])
                    self._pending.pop(rid).set_result(Reply(status, **details))
        self.connected = False
        for answer in self._pending.values():
            answer.set_result(ENGINE_GONE)
        self._pending.clear()
        self.on_lost()
