"""`--http-workers N`: the engine process's N HTTP front-end processes
(`service/frontends/front_end.py`).

This process keeps the layers, the GPU, the batcher, gRPC and every metric; it serves HTTP on a
Unix socket (the front ends relay there what they do not serve themselves) and the channel
(`service/frontends/channel_server.py`), and publishes its probe state with a heartbeat
(`service/frontends/engine_state.py`), from which the front ends answer the probes. The front
ends share the public socket. One that dies is started again (and counted in
`moe_serve_front_end_restarts_total`); on SIGTERM they stop taking connections and finish their
requests first, then this process drains as it does alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import Counter

from .. import off_loop
from ..core.runtime import Runtime
from ..http.route_methods import RouteMethods
from ..settings import Settings
from .arena import shm_dir
from .channel_server import ChannelServer
from .engine_state import HEARTBEAT_S, STALE_S, StateBlock
from .front_end import FrontEndConfig

log = logging.getLogger(__name__)

_QUICK_DEATH_S = 5.0  # a front end that dies sooner after its start waits before the next one
_RESTART_PAUSE_S = 1.0


class FrontEnds:
    def __init__(self, settings: Settings, listener: socket.socket) -> None:
        self.count = settings.front_ends()
        self.listener = listener
        remove_stale_directories(shm_dir())
        prefix = f"{DIRECTORY_PREFIX}{os.getpid()}-"
        self.directory = Path(tempfile.mkdtemp(prefix=prefix, dir=shm_dir()))
        self.http_path = self.directory / "http.sock"  # the engine's HTTP server
        self.state = StateBlock.create(self.directory / "state")
        self.settings = settings
        self.config: FrontEndConfig | None = None  # once started
        self._processes: list[asyncio.subprocess.Process | None] = [None] * self.count
        self._supervising: list[asyncio.Task] = []
        self._channel: ChannelServer | None = None
        self._beating: asyncio.Task | None = None
        self._runtime: Runtime | None = None
        self._stopping = False

    async def start(self, runtime: Runtime, routes: list[RouteMethods]) -> None:
        """Start the front ends, which answer a method `routes` (the engine's) do not take."""
        settings, token = self.settings, self.settings.api_token
        self.config = FrontEndConfig(
            listen_fd=self.listener.fileno(),
            engine_http=str(self.http_path),
            engine_channel=str(self.directory / "channel.sock"),
            engine_state=str(self.state.path),
            engine_stale_s=STALE_S,
            arena_dir=str(self.directory),
            api_token=None if token is None else token.get_secret_value(),
            max_connections=settings.max_connections,
            read_timeout_s=settings.read_timeout_s,
            max_body_bytes=settings.max_body_bytes,
            json_here_bytes=json_here_bytes(settings),
            max_json_bytes=settings.max_json_bytes,
            drain_timeout_s=settings.drain_timeout_s,
            stay_awake=settings.torch_device().type == "cuda",
            log_level=settings.log_level,
            log_format=settings.log_format,
            routes=routes,
        )
        self._runtime = runtime
        loop = asyncio.get_running_loop()
        # written on this event loop alone, whichever thread changed the state (or a signal)
        runtime.on_change = lambda: loop.call_soon_threadsafe(self._publish)
        self._beating = asyncio.create_task(self._beat())  # publishes before the front ends start
        self._channel = ChannelServer(runtime, Path(self.config.engine_channel))
        await self._channel.start()
        # a scrape counts what the front ends answered until it
        self._settle, runtime.metrics.settle = runtime.metrics.settle, self._channel.settle
        restarts = runtime.metrics.front_end_restarts
        self._supervising = [
            asyncio.create_task(self._supervise(i, restarts)) for i in range(self.count)
        ]

    def terminate(self) -> None:
        """SIGTERM to every front end: each stops taking connections and drains. This process
        lets go of the public socket too: while any process holds it open, the kernel goes on
        queueing connections that no one will take (they would hang until the drain ends);
        once every holder has closed it, a new connection is refused at once."""
        self._stopping = True
        self.listener.close()
        for process in self._processes:
            if process is not None and process.returncode is None:
                process.terminate()

    async def stop(self, timeout_s: float) -> None:
        """Drain the front ends (killed after `timeout_s`), then close the channel."""
        self.terminate()
        _, running = await asyncio.wait(self._supervising, timeout=timeout_s + 1)
        for process in self._processes:
            if process is not None and process.returncode is None:
                log.warning("front end %d did not stop in %g s: killed", process.pid, timeout_s)
                process.kill()
        await asyncio.gather(*running, return_exceptions=True)
        if self._channel is not None:
            self._runtime.metrics.settle = self._settle
            await self._channel.close()
        if self._beating is not None:
            self._beating.cancel()
            self._beating = None  # and a change still scheduled publishes nothing
            self._runtime.on_change = lambda: None
        self.state.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _publish(self) -> None:
        if self._beating is not None:
            self.state.write(self._runtime.probe_state())

    async def _beat(self) -> None:
        """The state every HEARTBEAT_S, from this event loop: its time stamp is the heartbeat
        that tells the front ends this loop runs (the engine's own layers change without a
        notice too: a model loaded or unloaded shows at the next beat)."""
        while True:
            self._publish()
            await asyncio.sleep(HEARTBEAT_S)

    async def _supervise(self, index: int, restarts: Counter) -> None:
        while not self._stopping:
            started = time.monotonic()
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "moe_serve.service.frontends.front_end",
                env=os.environ | self.config.to_env(),
                pass_fds=(self.listener.fileno(),),
            )
            self._processes[index] = process
            code = await process.wait()
            if self._stopping:
                return
            log.warning(
                "front end %d (pid %d) exited with %d: restarting", index, process.pid, code
            )
            restarts.inc()
            if time.monotonic() - started < _QUICK_DEATH_S:
                await asyncio.sleep(_RESTART_PAUSE_S)


DIRECTORY_PREFIX = "moe-serve-"  # then the engine's pid: its sockets and the arenas


def remove_stale_directories(where: Path) -> None:
    """Remove what engines that are gone (killed: no stop ran) left in `where`."""
    for path in where.glob(f"{DIRECTORY_PREFIX}*-*"):
        pid = path.name.removeprefix(DIRECTORY_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s, left by engine process %s", path, pid)
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def json_here_bytes(settings: Settings) -> int:
    """The largest JSON forward a front end decodes itself: on a GPU engine a larger one goes to
    the engine as its text, through the front end's arena, and is read on the device
    (service/codecs/json_device.py). Up to the size JSON work may take on an event loop, the
    front end's own core does it: the engine's host time is every request's."""
    if settings.torch_device().type == "cuda":
        return min(settings.max_json_bytes, off_loop.JSON.on_loop_bytes)
    return settings.max_json_bytes
