"""The socket between an HTTP front-end process and the engine process (`--http-workers`).

Frames are a 4-byte little-endian length, then a JSON object. A front end sends
`{"hello": arena path, "size": bytes}` once (the engine maps its arena and answers
`{"hello": "ok"}`), then per binary forward `{"forward": id, "layer", "offset", "body_bytes",
"reply_capacity", "finite", "layer_dtype"}` (the body lies in the arena at that region; `finite`:
the front end found every value finite, so the engine need not read them; `layer_dtype`, sent
for a JSON forward: the reply's output in the layer's dtype, not the body's), `{"cancel": id}`
when its client goes away, and `{"done": route, "status", "seconds"}` once a request is answered
(the engine keeps every metric). The engine answers each forward exactly once, `{"reply": id,
"status", "bytes"}` with the reply blob in the region's reply part, or with `"error"` and
`"headers"`; until then the region is the engine's.
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

from service.body_arena import BodyArena, Region

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")


async def read_frame(reader: asyncio.StreamReader) -> dict | None:
    """The next frame, or None once the other side has closed the socket."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        return json.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def write_frame(writer: asyncio.StreamWriter, frame: dict) -> None:
    data = json.dumps(frame, separators=(",", ":")).encode()
    writer.write(_LENGTH.pack(len(data)) + data)  # frames are small: no flow control


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
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None

    async def connect(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        write_frame(self._writer, {"hello": str(self.arena.path), "size": self.arena.size})
        answer = await read_frame(reader)
        if answer != {"hello": "ok"}:
            raise ConnectionError(f"the engine refused the arena: {answer}")
        self.connected = True
        self._reading = asyncio.create_task(self._read(reader))

    async def close(self) -> None:
        self.on_lost = lambda: None  # closed on purpose
        if self._writer is not None:
            self._writer.close()
        if self._reading is not None:
            await self._reading

    async def forward(
        self,
        layer: str,
        region: Region,
        finite: bool,
        gone: Callable[[], Awaitable],
        layer_dtype: bool = False,
    ) -> Reply:
        """The engine's answer to the body in `region`; `gone()` returning first withdraws it.
        The region is the engine's until it answers: the caller frees it after reading the
        reply, or, if the caller is cancelled, the answer's arrival does."""
        rid = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._pending[rid] = answer
        frame = {"forward": rid, "layer": layer, "offset": region.offset, "finite": finite}
        if layer_dtype:
            frame["layer_dtype"] = True
        write_frame(self._writer, frame | _sizes(region))
        watch = asyncio.ensure_future(gone())
        try:
            await asyncio.wait((answer, watch), return_when=asyncio.FIRST_COMPLETED)
            if not answer.done() and self.connected:
                write_frame(self._writer, {"cancel": rid})
            return await asyncio.shield(answer)  # a withdrawn request is answered too (499)
        except asyncio.CancelledError:
            if self.connected:
                write_frame(self._writer, {"cancel": rid})
            answer.add_done_callback(lambda _: self.arena.free(region))
            raise
        finally:
            watch.cancel()

    def done(self, route: str, status: int, seconds: float) -> None:
        if self.connected:
            write_frame(self._writer, {"done": route, "status": status, "seconds": seconds})

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while (frame := await read_frame(reader)) is not None:
            answer = self._pending.pop(frame["reply"])
            answer.set_result(Reply(frame["status"], **_reply_fields(frame)))
        self.connected = False
        for answer in self._pending.values():
            answer.set_result(ENGINE_GONE)
        self._pending.clear()
        self.on_lost()


def _sizes(region: Region) -> dict[str, int]:
    return {"body_bytes": region.body_bytes, "reply_capacity": region.reply_capacity}


def _reply_fields(frame: dict) -> dict:
    return {k: frame[k] for k in ("error", "headers") if k in frame} | {
        "nbytes": frame.get("bytes", 0)
    }
