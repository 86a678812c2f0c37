"""The engine's end of the front-end channel (`service/channel.py`): binary forwards whose bodies
the front-end processes laid in their arenas, run through the same `serve_blob` as a forward
that reached this process over HTTP, the reply blob written back into the arena."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from service.body_arena import BodyArena, Region
from service.channel import read_frame, write_frame
from service.deps import Runtime, ready
from service.errors import ServiceError
from service.routes.forward import serve_blob_into

log = logging.getLogger(__name__)


class ChannelServer:
    def __init__(self, runtime: Runtime, path: Path) -> None:
        self.runtime = runtime
        self.path = path
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path)

    async def close(self) -> None:
        """Stop accepting front ends (call once they have stopped: their requests finish)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_frame(reader)
        try:
            arena = BodyArena.attach(Path(hello["hello"]), hello["size"])
        except (TypeError, KeyError, ValueError, OSError) as err:
            log.error("a front end's arena could not be mapped: %s", err)
            write_frame(writer, {"hello": f"refused: {err}"})
            writer.close()
            return
        write_frame(writer, {"hello": "ok"})
        mapped = _Arena(arena)
        running: dict[int, tuple[asyncio.Task, asyncio.Event]] = {}
        try:
            while (frame := await read_frame(reader)) is not None:
                if "forward" in frame:
                    rid, gone = frame["forward"], asyncio.Event()
                    task = asyncio.create_task(self._forward(frame, mapped, gone, writer))
                    running[rid] = (task, gone)
                    task.add_done_callback(lambda _, rid=rid: running.pop(rid, None))
                elif "cancel" in frame and frame["cancel"] in running:
                    running[frame["cancel"]][1].set()
                elif "done" in frame:
                    self._count(frame)
        finally:
            for _, gone in running.values():  # the front end is gone: so are its clients
                gone.set()
            await asyncio.gather(*(task for task, _ in running.values()))
            writer.close()
            _unpin(mapped)  # no forward of this front end is left on the device
            arena.close()

    async def _forward(
        self, frame: dict, arena: _Arena, gone: asyncio.Event, writer: asyncio.StreamWriter
    ) -> None:
        region = Region(frame["offset"], frame["body_bytes"], frame["reply_capacity"])
        reply: dict = {"reply": frame["forward"]}
        try:
            runtime = ready(self.runtime)
            served = runtime.engine.get(frame["layer"])
            if runtime.engine.enqueues and arena.pinning is None:  # once per arena
                arena.pinning = asyncio.ensure_future(asyncio.to_thread(_pin, arena.arena))
            pinned = arena.pinning is not None and await asyncio.shield(arena.pinning)
            size = await serve_blob_into(
                served,
                runtime.batcher,
                runtime.metrics,
                arena.arena.body(region),
                arena.arena.reply(region),
                bool(pinned),
                frame.get("finite", False),
                gone.wait,
                frame.get("layer_dtype", False),
            )
            reply |= {"status": 200, "bytes": size}
        except ServiceError as err:
            reply |= {"status": err.status, "error": err.message, "headers": err.headers}
        except Exception:
            log.exception("unhandled error in a forward from a front end")
            reply |= {"status": 500, "error": "internal error (logged by the engine process)"}
        write_frame(writer, reply)

    def _count(self, frame: dict) -> None:
        """The request metrics of a request a front end answered itself."""
        metrics = self.runtime.metrics
        route = frame["done"]
        metrics.requests.labels(route, str(frame["status"])).inc()
        metrics.request_seconds.labels(route).observe(frame["seconds"])


@dataclass
class _Arena:
    """A front end's arena as mapped here; `pinning`: its registration with CUDA, started by
    the first forward (the others of that moment wait for it), whose result is the arena's
    address, or 0 if CUDA refused."""

    arena: BodyArena
    pinning: asyncio.Future[int] | None = None


def _pin(arena: BodyArena) -> int:
    """Register the arena with CUDA, so bodies are copied to the device and outputs back by
    DMA from where they lie; its address, or 0 if CUDA refused (it then serves through
    copies)."""
    address = torch.frombuffer(arena.view, dtype=torch.uint8).data_ptr()
    error = int(torch.cuda.cudart().cudaHostRegister(address, arena.size, 0))
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
