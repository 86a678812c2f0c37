"""The engine's end of the front-end channel (`service/channel.py`): binary forwards whose bodies
the front-end processes laid in their arenas, run through the same `serve_blob` as a forward
that reached this process over HTTP, the reply blob written back into the arena."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from service.batcher import RequestOptions
from service.body_arena import BodyArena, Region
from service.channel import read_frame, write_frame
from service.deps import Runtime, ready
from service.errors import ServiceError
from service.routes.forward import serve_blob
from service.wire import run_sized

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
        running: dict[int, tuple[asyncio.Task, asyncio.Event]] = {}
        try:
            while (frame := await read_frame(reader)) is not None:
                if "forward" in frame:
                    rid, gone = frame["forward"], asyncio.Event()
                    task = asyncio.create_task(self._forward(frame, arena, gone, writer))
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
            arena.close()

    async def _forward(
        self, frame: dict, arena: BodyArena, gone: asyncio.Event, writer: asyncio.StreamWriter
    ) -> None:
        region = Region(frame["offset"], frame["body_bytes"], frame["reply_capacity"])
        reply: dict = {"reply": frame["forward"]}
        try:
            runtime = ready(self.runtime)
            served = runtime.engine.get(frame["layer"])
            parts = await serve_blob(
                served,
                runtime.batcher,
                runtime.metrics,
                arena.body(region),
                RequestOptions(),
                False,
                gone.wait,
            )
            size = sum(map(len, parts))
            if size > region.reply_capacity:
                raise ServiceError(
                    f"the reply of {size} bytes does not fit its {region.reply_capacity}-byte room"
                )
            out = arena.reply(region, size)
            await run_sized(size, lambda: _copy(parts, out))
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


def _copy(parts: list[bytes | memoryview], out: memoryview) -> None:
    at = 0
    for part in parts:
        out[at : at + len(part)] = part
        at += len(part)
