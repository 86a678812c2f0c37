"""The engine's end of the front-end channel (`--http-workers`) under load, on the CPU: what one
binary forward costs the engine process's event loop, apart from the batcher and the device:
`moe-serve bench service --mode channel`.

The engine side runs in this process: the real ChannelServer (service/frontends/channel_server.py)
and serve_blob_into, in front of a stub batcher that answers every request submitted in one turn of
the event loop on the next, together (as a finished batch does), and with each arena taken as
registered with CUDA (a GPU engine's direct path: the reply's header written in place, the
output left to the device). `--front-ends` processes hold `--clients` forwards in flight
between them through the real EngineClient (service/frontends/channel.py), as the HTTP front
ends do (a forward, its answer, a "done" report); the bodies (`--tokens` bf16 rows of the
layer's hidden size, values found finite) are laid once in each process's arena and reused.
Reports the requests per second the engine answered and its CPU time per request (all its
threads, over the timed window).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..kernels.config import MoEConfig, RoutingConfig
from ..service.core.runtime import Runtime
from ..service.errors import UnknownLayer
from ..service.frontends import channel_server
from ..service.frontends.arena import BodyArena, shm_dir
from ..service.frontends.channel import EngineClient
from ..service.frontends.channel_server import ChannelServer
from ..service.frontends.front_end import ARENA_BYTES
from ..service.http.plain_forward import FORWARD_PATH
from ..service.metrics import Metrics
from ..service.settings import Settings
from .schema import Environment, write_result

LAYER = "deepseek-v3"
WARM_UP_S = 1.0


@dataclass(frozen=True)
class _Served:
    """What serve_blob_into reads of a served layer."""

    name: str
    config: MoEConfig
    backend: str = "stub"
    has_router: bool = True


class _Engine:
    enqueues = True  # the GPU engine's direct path

    def __init__(self, served: _Served) -> None:
        self.layers = {served.name: served}

    def get(self, name: str) -> _Served:
        if name not in self.layers:
            raise UnknownLayer(f"no layer named {name!r}")
        return self.layers[name]


class _AnswerNextTurn:
    """A batcher whose every request submitted in one turn of the loop is answered on the next."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.answered = 0
        self._waiting: list[asyncio.Future] = []

    async def submit(self, name, inputs, options=None, output_into=None) -> None:  # noqa: ARG002
        self.engine.get(name)
        future = asyncio.get_running_loop().create_future()
        if not self._waiting:
            asyncio.get_running_loop().call_soon(self._answer)
        self._waiting.append(future)
        await future

    def _answer(self) -> None:
        for future in self._waiting:
            if not future.done():
                future.set_result(None)
        self.answered += len(self._waiting)
        self._waiting = []


def _body(tokens: int, hidden: int) -> bytes:
    """A safetensors blob of zeros: hidden_states [tokens, hidden] in bf16 (built torch-free)."""
    nbytes = tokens * hidden * 2
    entry = {"dtype": "BF16", "shape": [tokens, hidden], "data_offsets": [0, nbytes]}
    header = json.dumps({"hidden_states": entry}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + bytes(nbytes)


def _front_end(path: str, in_flight: int, body: bytes, loop: str) -> None:
    """One front-end process: `in_flight` forwards always under way, until it is killed."""

    async def run() -> None:
        # beside the socket, in the directory the engine's side removes: a front end killed
        # before its connection is made leaves no file behind
        arena = BodyArena.create(Path(path).parent, ARENA_BYTES)
        client = EngineClient(Path(path), arena, on_lost=lambda: None)
        try:
            await client.connect()
        finally:
            arena.unlink()  # mapped by both processes, or the connection failed: no file left
        regions = [arena.allocate(len(body)) for _ in range(in_flight)]
        if None in regions:
            raise SystemExit(f"{in_flight} bodies do not fit an arena: add front ends")
        never = asyncio.get_running_loop().create_future()  # the clients stay

        async def client_loop(region) -> None:
            arena.body(region)[:] = body
            while True:
                started = time.perf_counter()
                reply = await client.forward(LAYER, region, never)
                client.done(FORWARD_PATH, reply.status, time.perf_counter() - started)

        await asyncio.gather(*map(client_loop, regions))

    _run(run(), loop)


def _run(main, loop: str) -> None:
    if loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


@dataclass(frozen=True)
class ChannelLoad:
    front_ends: int  # front-end processes
    clients: int  # forwards in flight in all
    seconds: float  # the timed window
    tokens: int  # rows per request
    hidden: int  # H (DeepSeek-V3: 7168)
    loop: str = "uvloop"  # the event loop of every process: uvloop or asyncio


async def _engine(load: ChannelLoad) -> dict:
    pin, unpin = channel_server._pin, channel_server._unpin
    channel_server._pin = lambda _arena: 1  # as if CUDA registered the arena
    channel_server._unpin = lambda _arena: None
    try:
        return await _measure(load)
    finally:
        channel_server._pin, channel_server._unpin = pin, unpin


async def _measure(load: ChannelLoad) -> dict:
    served = _Served(LAYER, MoEConfig(256, load.hidden, 2048, RoutingConfig(top_k=8)))
    metrics = Metrics()
    metrics.add_layer(LAYER, served.config.num_experts)
    engine = _Engine(served)
    batcher = _AnswerNextTurn(engine)
    runtime = Runtime(Settings(device="cpu"), metrics, engine, batcher, not_ready=None)
    with tempfile.TemporaryDirectory(prefix="moe-serve-bench-", dir=shm_dir()) as directory:
        path = Path(directory) / "channel.sock"
        server = ChannelServer(runtime, path)
        await server.start()
        spawn = multiprocessing.get_context("spawn")
        body = _body(load.tokens, load.hidden)
        shares = [load.clients // load.front_ends] * load.front_ends
        for i in range(load.clients % load.front_ends):
            shares[i] += 1
        processes = [
            spawn.Process(target=_front_end, args=(str(path), n, body, load.loop), daemon=True)
            for n in shares
        ]
        for p in processes:
            p.start()
        try:
            while batcher.answered < load.clients:  # every front end up and answered
                if not all(p.is_alive() for p in processes):
                    raise RuntimeError("a front-end process exited (its error is above)")
                await asyncio.sleep(0.05)
            await asyncio.sleep(WARM_UP_S)
            answered, cpu, wall = batcher.answered, time.process_time(), time.perf_counter()
            await asyncio.sleep(load.seconds)
            answered = batcher.answered - answered
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        finally:
            for p in processes:
                p.kill()
                p.join()
            # returns once each front end's connection has ended (its forwards withdrawn, its
            # arena unmapped): before the stand-ins for CUDA registration are put back
            await server.close()
    return {
        "front_ends": load.front_ends,
        "clients": load.clients,
        "tokens": load.tokens,
        "hidden": load.hidden,
        "requests_per_s": answered / wall,
        "engine_cpu_us_per_request": cpu / answered * 1e6,
        "engine_cpu_busy": cpu / wall,
    }


def measure(load: ChannelLoad) -> dict:
    """One timed window: requests/s, engine CPU microseconds per request and busy fraction."""
    holder: dict = {}

    async def run() -> None:
        holder.update(await _engine(load))

    _run(run(), load.loop)
    return holder


def render(result: dict) -> str:
    env = Environment.model_validate(result["environment"])
    lines = [
        f"# The engine's end of the front ends' channel: {env.device}, commit {env.commit}",
        "",
        "| front ends | in flight | tokens x H | req/s | engine CPU us / request | CPU busy |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['front_ends']} | {r['clients']} | {r['tokens']}x{r['hidden']} "
        f"| {r['requests_per_s']:,.0f} | {r['engine_cpu_us_per_request']:.1f} "
        f"| {r['engine_cpu_busy']:.0%} |"
        for r in result["rows"]
    ]
    return "\n".join(lines) + "\n"


def run(loads: list[ChannelLoad], env: Environment, path: Path) -> dict:
    """Each load in turn; writes `path` and its .md."""
    result = {"environment": env.model_dump(), "rows": [measure(load) for load in loads]}
    write_result(path, result, render(result))
    return result
