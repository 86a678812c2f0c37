"""The engine's end of the front-end channel (`service/frontends/channel.py`): forwards whose
bodies the front-end processes laid in their arenas, run through the forward core
(service/core/forward.py, as a forward that reached this process over HTTP: `serve_blob_into`
for a safetensors body, `serve_json_into` for a JSON one), the reply written back into the
arena."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.forward import LayerCall, serve_blob_into, serve_json_into
from ..core.runtime import Runtime, ready
from ..errors import ServiceError
from .arena import BodyArena, Region
from .channel import (
    CANCEL,
    CANCEL_FIELDS,
    DONE,
    DONE_FIELDS,
    ERROR,
    FORWARD,
    FORWARD_FIELDS,
    FORWARD_JSON,
    FORWARD_JSON_FIELDS,
    HELLO,
    REPLY,
    REPLY_FIELDS,
    SETTLE,
    RecordProtocol,
    RecordWriter,
    error_payload,
    hello,
)

log = logging.getLogger(__name__)
# A front end sends small records (HELLO's arena path, a forward's fields and layer name):
# a longer one is refused before it is gathered
MAX_FRONT_END_RECORD_BYTES = 64 << 10
# How long a scrape waits for the front ends' DONE records (`settle`) at most: one that does not
# answer (stopped, or its event loop blocked) is not waited for, and while a SETTLE sent to it
# is older than that, later scrapes neither wait for it nor send it another
SETTLE_S = 0.5


class ChannelServer:
    def __init__(self, runtime: Runtime, path: Path) -> None:
        self.runtime = runtime
        self.path = path
        self._server: asyncio.Server | None = None
        self._links: set[_FrontEndLink] = set()  # the front ends connected

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accept, self.path)

    def _accept(self) -> RecordProtocol:
        link = _FrontEndLink(self.runtime, self._links)
        self._links.add(link)
        return link.protocol

    async def settle(self) -> None:
        """Returns once every front end has sent the DONE records of the requests it answered
        before (SETTLE_S at most): a scrape then counts them."""
        links = [link for link in self._links if link.arena is not None and not link.overdue()]
        waits = [link.settle() for link in links]
        if waits:
            await asyncio.wait(waits, timeout=SETTLE_S)

    async def close(self) -> None:
        """Stop accepting front ends and end the connections left (call once they have stopped:
        their requests finish); returns once each one's forwards are withdrawn and its arena
        unmapped."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        links = list(self._links)
        for link in links:
            link.end()
        await asyncio.gather(*(link.ended for link in links))


class _FrontEndLink:
    """One front end's connection: its arena, mapped on its HELLO, and its forwards in the
    engine: a task each, withdrawn by its CANCEL."""

    def __init__(self, runtime: Runtime, links: set[_FrontEndLink]) -> None:
        self.runtime = runtime
        self.links = links
        self.protocol = RecordProtocol(self._hello, self._lost, MAX_FRONT_END_RECORD_BYTES)
        self.arena: _Arena | None = None  # once its HELLO has mapped it
        self.out: RecordWriter | None = None
        # id -> the forward's task and the future whose result withdraws it
        self.running: dict[int, tuple[asyncio.Task, asyncio.Future]] = {}
        self._tearing_down: asyncio.Task | None = None
        self.ended = asyncio.get_running_loop().create_future()  # the connection is torn down
        # one per SETTLE sent, done as the front end answers them (in order): a scrape waits for
        # its own, as the front end may have answered one sent before after requests it counts
        # (each with the loop time it was sent)
        self._settling: deque[tuple[asyncio.Future[None], float]] = deque()

    def _hello(self, records: list[tuple[int, bytes]]) -> None:
        """The front end's first records: HELLO, which names its arena, then perhaps more."""
        self.out = RecordWriter(self.protocol.transport)
        self.protocol.on_records = _ignore  # refused: what it sends until the close is not read
        kind, payload = records[0]
        if kind != HELLO:
            self.out.close()
            return
        try:
            request = json.loads(payload)
            arena = BodyArena.attach(Path(request["hello"]), request["size"])
        except (TypeError, KeyError, ValueError, OSError) as err:
            log.error("a front end's arena could not be mapped: %s", err)
            self.out.send(HELLO, hello({"hello": f"refused: {err}"}))
            self.out.close()
            return
        self.arena = _Arena(arena)
        self.out.send(HELLO, hello({"hello": "ok"}))
        self.protocol.on_records = self.handle
        self.handle(records[1:])

    def settle(self) -> asyncio.Future[None]:
        """Done once the front end has sent what it held back (its DONE records) and SETTLE."""
        loop = asyncio.get_running_loop()
        settled = loop.create_future()
        self._settling.append((settled, loop.time()))
        self.out.send(SETTLE, b"")
        return settled

    def overdue(self) -> bool:
        """A SETTLE sent SETTLE_S ago or more is not answered yet: the front end is not reading."""
        now = asyncio.get_running_loop().time()
        return bool(self._settling) and now - self._settling[0][1] >= SETTLE_S

    def _answer_settled(self) -> None:
        if self._settling:
            self._settling.popleft()[0].set_result(None)

    def end(self) -> None:
        """Close the connection (the engine stops): torn down as when the front end closes it.
        What the front end has not read yet is dropped: one that stopped reading would
        otherwise hold the close (and the engine's exit) until it reads."""
        if self.protocol.transport is not None:
            self.protocol.transport.abort()
        else:  # accepted, never made
            self._lost()

    def _lost(self) -> None:
        if self._tearing_down is None:
            self._tearing_down = asyncio.ensure_future(self._tear_down())

    async def _tear_down(self) -> None:
        """The front end is gone: so are its clients."""
        try:
            await self.withdraw_all()
        finally:
            if self.out is not None:
                self.out.close()
            if self.arena is not None:
                _unpin(self.arena)  # no forward of this front end is left on the device
                self.arena.arena.close()
            self.links.discard(self)
            while self._settling:  # nothing more comes
                self._answer_settled()
            self.ended.set_result(None)

    def handle(self, records: list[tuple[int, bytes]]) -> None:
        for kind, payload in records:
            try:
                self._act_on(kind, payload)
            except (struct.error, UnicodeDecodeError, ValueError) as err:
                self.protocol.refuse(f"a malformed {chr(kind)!r} record ({err})")
                return

    def _act_on(self, kind: int, payload: bytes) -> None:
        """One record; ValueError (or struct's, or the layer name's decoding error) for one no
        front end sends."""
        if kind == FORWARD:
            rid, offset, body_bytes, reply_capacity, layer_dtype = FORWARD_FIELDS.unpack_from(
                payload
            )
            layer = payload[FORWARD_FIELDS.size :].decode()
            region = Region(offset, body_bytes, reply_capacity)
            self._start(rid, self._forward, layer, region, layer_dtype)
        elif kind == FORWARD_JSON:
            rid, offset, body_bytes, reply_capacity = FORWARD_JSON_FIELDS.unpack_from(payload)
            layer = payload[FORWARD_JSON_FIELDS.size :].decode()
            region = Region(offset, body_bytes, reply_capacity)
            self._start(rid, self._forward_json, layer, region)
        elif kind == CANCEL:
            (rid,) = CANCEL_FIELDS.unpack(payload)
            if rid in self.running:
                _withdraw(self.running[rid][1])
        elif kind == DONE:  # a request the front end answered itself
            status, seconds = DONE_FIELDS.unpack_from(payload)
            route = payload[DONE_FIELDS.size :].decode()
            self.runtime.metrics.observe_request(route, str(status), seconds)
        elif kind == SETTLE:  # the DONE records it held have come
            self._answer_settled()

    def _start(self, rid: int, forward: Callable[..., Awaitable[None]], *args: object) -> None:
        """`forward(rid, *args, gone)` as the forward's task, answered however it ends;
        ValueError for an id running already (its answer would go to neither)."""
        if rid in self.running:
            raise ValueError(f"forward {rid} is running already")
        gone = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._answer(rid, forward(rid, *args, gone)))
        self.running[rid] = (task, gone)
        task.add_done_callback(lambda _, rid=rid: self.running.pop(rid, None))

    async def withdraw_all(self) -> None:
        for _, gone in self.running.values():
            _withdraw(gone)
        await asyncio.gather(*(task for task, _ in self.running.values()))

    async def _answer(self, rid: int, forward: Awaitable[None]) -> None:
        """The forward, whose REPLY it sends itself; its error as an ERROR."""
        try:
            await forward
        except ServiceError as err:
            self.out.send(ERROR, error_payload(rid, err.status, err.message, err.headers))
        except Exception:
            log.exception("unhandled error in a forward from a front end")
            error = "internal error (logged by the engine process)"
            self.out.send(ERROR, error_payload(rid, 500, error, {}))

    async def _forward(
        self,
        rid: int,
        layer: str,
        region: Region,
        layer_dtype: bool,
        gone: asyncio.Future,
    ) -> None:
        arena, runtime = self.arena, ready(self.runtime)
        call = LayerCall.of(runtime, layer)
        pinned = await arena.pinned(runtime.engine.enqueues)
        size = await serve_blob_into(
            call,
            arena.arena.body(region),
            arena.arena.reply(region),
            pinned,
            gone,
            layer_dtype,
        )
        self.out.send(REPLY, REPLY_FIELDS.pack(rid, 200, size))

    async def _forward_json(
        self, rid: int, layer: str, region: Region, gone: asyncio.Future
    ) -> None:
        """The JSON body read from the arena (on a GPU engine, a large one copied to the device
        from there, and its output printed back into it); the reply written into the region's
        reply part, or, longer than that part, carried whole by the REPLY record."""
        arena, runtime = self.arena, ready(self.runtime)
        call = LayerCall.of(runtime, layer)
        await arena.pinned(runtime.engine.enqueues)
        body, room = arena.arena.body(region), arena.arena.reply(region)
        written = await serve_json_into(call, body, room, gone)
        if isinstance(written, int):
            self.out.send(REPLY, REPLY_FIELDS.pack(rid, 200, written))
        else:
            size = sum(map(len, written))
            self.out.send(REPLY, b"".join([REPLY_FIELDS.pack(rid, 200, size), *written]))


def _ignore(records: list[tuple[int, bytes]]) -> None:
    pass


def _withdraw(gone: asyncio.Future) -> None:
    if not gone.done():  # once: a CANCEL may come, then the front end's connection end
        gone.set_result(None)


@dataclass
class _Arena:
    """A front end's arena as mapped here; `pinning`: its registration with CUDA, started by
    the first forward (the others of that moment wait for it), whose result is the arena's
    address, or 0 if CUDA refused."""

    arena: BodyArena
    pinning: asyncio.Future[int] | None = None

    async def pinned(self, enqueues: bool) -> bool:
        """Whether the arena is registered with CUDA; registered first where the engine
        `enqueues` batches on a GPU (once per arena)."""
        if enqueues and self.pinning is None:
            self.pinning = asyncio.ensure_future(asyncio.to_thread(_pin, self.arena))
        return self.pinning is not None and bool(await asyncio.shield(self.pinning))


_PORTABLE = 1  # cudaHostRegisterPortable


def _pin(arena: BodyArena) -> int:
    """Register the arena with CUDA, so bodies are copied to the device and outputs back by
    DMA from where they lie; its address, or 0 if CUDA refused (it then serves through
    copies)."""
    address = torch.frombuffer(arena.view, dtype=torch.uint8).data_ptr()
    # portable: pinned for every GPU's context, as the layers may sit on several (--devices)
    error = int(torch.cuda.cudart().cudaHostRegister(address, arena.size, _PORTABLE))
    if error:
        log.warning(
            "arena %s not registered with CUDA (error %s): replies are copied", arena.path, error
        )
        return 0
    log.info("arena %s registered with CUDA: bodies and replies are copied by DMA", arena.path)
    return address


def _unpin(arena: _Arena) -> None:
    pinning = arena.pinning
    if pinning is not None and pinning.done() and not pinning.exception() and pinning.result():
        torch.cuda.cudart().cudaHostUnregister(pinning.result())
