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

`--mode front-end` puts one real HTTP front-end process (`service/frontends/front_end.py`, as
`--http-workers 1` starts it, logging each request to a file) in front of the same stub engine
and times one client (`load_gen.run_one_client`, in a process of its own), request after
request, against bench/echo_server.py (one process): the front-end hop's own cost. Forwards of 1
and `--tokens` rows and the probes the front end answers itself; for each, the client's p50 and
p90 and each server process's CPU time per request.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
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
from ..service.frontends.supervisor import FrontEnds
from ..service.http.plain_forward import BINARY, FORWARD_PATH
from ..service.http.server import listen
from ..service.metrics import Metrics
from ..service.settings import Settings
from . import echo_server
from .load_gen import run_one_client
from .schema import Environment, write_result
from .service_bench import _tcp_ready

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


@contextmanager
def _as_if_pinned() -> Iterator[None]:
    """Every arena taken as registered with CUDA (the GPU engine's direct path)."""
    pin, unpin = channel_server._pin, channel_server._unpin
    channel_server._pin = lambda _arena: 1
    channel_server._unpin = lambda _arena: None
    try:
        yield
    finally:
        channel_server._pin, channel_server._unpin = pin, unpin


def _stub_runtime(hidden: int, settings: Settings) -> tuple[Runtime, _AnswerNextTurn]:
    """A ready runtime serving LAYER of hidden size `hidden` through the stub batcher."""
    served = _Served(LAYER, MoEConfig(256, hidden, 2048, RoutingConfig(top_k=8)))
    metrics = Metrics()
    metrics.add_layer(LAYER, served.config.num_experts)
    engine = _Engine(served)
    batcher = _AnswerNextTurn(engine)
    return Runtime(settings, metrics, engine, batcher, not_ready=None), batcher


async def _engine(load: ChannelLoad) -> dict:
    with _as_if_pinned():
        return await _measure(load)


async def _measure(load: ChannelLoad) -> dict:
    runtime, batcher = _stub_runtime(load.hidden, Settings(device="cpu"))
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


# ---- --mode front-end: one client through one HTTP front end --------------------------------

PROBES = ("/health", "/ready")
_WARM_UP_REQUESTS_S = 0.3
_READY_WAIT_S = 60.0
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class FrontEndLoad:
    tokens: int  # rows of the larger forward (the other has 1)
    hidden: int
    seconds: float  # timed per request and server


# (what it is, its path, its body: None for a GET)
_Request = tuple[str, str, bytes | None]


def measure_front_end(load: FrontEndLoad, logs: Path) -> list[dict]:
    """For each request, one client's p50 and p90 and each process's CPU time per request,
    through a front end and against the echo server (its log and the front end's in `logs`)."""
    forward = FORWARD_PATH.format(name=LAYER)
    requests: list[_Request] = [
        (f"forward {t} tok", forward, _body(t, load.hidden)) for t in sorted({1, load.tokens})
    ]
    requests += [(f"GET {probe}", probe, None) for probe in PROBES]
    logs.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client:
        holder: dict = {}

        async def through() -> None:
            with _as_if_pinned():
                holder.update(await _through_front_end(load, requests, client, logs))

        _run(through(), "uvloop")
        floor = _through_echo(load, requests, client)
    return [
        {"request": name, "requests": holder[name]["requests"]}
        | {f"front_end_{k}": v for k, v in holder[name].items() if k != "requests"}
        | {f"echo_{k}": v for k, v in floor[name].items() if k != "requests"}
        for name, _, _ in requests
    ]


async def _through_front_end(
    load: FrontEndLoad, requests: list[_Request], client: Executor, logs: Path
) -> dict[str, dict]:
    """The stub engine in this process, one front end as `--http-workers 1` starts it."""
    runtime, _ = _stub_runtime(load.hidden, Settings(device="cpu", http_workers=1))
    listener = listen("127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    front_ends = FrontEnds(runtime.settings, listener)
    timed = {}
    with _stderr_to(logs / "front-end.log"):
        await front_ends.start(runtime, [])
        try:
            loop = asyncio.get_running_loop()
            started = time.monotonic()
            while not await loop.run_in_executor(client, _ready, f"{url}/ready"):
                if time.monotonic() - started > _READY_WAIT_S:
                    raise TimeoutError(f"the front end did not answer in {_READY_WAIT_S} s")
                await asyncio.sleep(0.1)
            (process,) = front_ends._processes
            for name, path, body in requests:
                own = time.process_time()
                timed[name] = await loop.run_in_executor(
                    None, _timed, client, url + path, body, load.seconds, process.pid
                )
                engine_s = time.process_time() - own
                timed[name]["engine_cpu_us"] = engine_s / timed[name]["requests"] * 1e6
        finally:
            await front_ends.stop(runtime.settings.drain_timeout_s)
    return timed


def _through_echo(load: FrontEndLoad, requests: list[_Request], client: Executor) -> dict:
    """The same requests to one echo server process."""
    listener = listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    listener.close()
    echo = multiprocessing.get_context("spawn").Process(
        target=echo_server.serve, args=(port,), daemon=True
    )
    echo.start()
    try:
        started = time.monotonic()
        while not _tcp_ready(port)():
            if time.monotonic() - started > _READY_WAIT_S or not echo.is_alive():
                raise RuntimeError("the echo server did not start")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        return {
            name: _timed(client, url + path, body, load.seconds, echo.pid)
            for name, path, body in requests
        }
    finally:
        echo.kill()
        echo.join()


def _ready(url: str) -> bool:
    """Whether a GET of `url` is answered 200."""
    try:
        return not run_one_client(url, None, "", 0.0).errors
    except OSError:
        return False


def _timed(client: Executor, url: str, body: bytes | None, seconds: float, pid: int) -> dict:
    """One client's requests to `url` in `client`'s process for `seconds` (after a warm-up):
    p50 and p90 microseconds and the server process `pid`'s CPU time per request."""
    client.submit(run_one_client, url, body, BINARY, _WARM_UP_REQUESTS_S).result()
    cpu = _cpu_s(pid)
    load = client.submit(run_one_client, url, body, BINARY, seconds).result()
    cpu = _cpu_s(pid) - cpu
    if load.errors or not load.latencies_s:
        raise RuntimeError(f"{url}: {load.errors or 'no answers'}")
    latencies = load.latencies_s
    return {
        "requests": len(latencies),
        "p50_us": statistics.median(latencies) * 1e6,
        "p90_us": statistics.quantiles(latencies, n=10)[8] * 1e6,
        "cpu_us": cpu / len(latencies) * 1e6,
    }


def _cpu_s(pid: int) -> float:
    """Process `pid`'s CPU time (user and system, all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


@contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """This process's stderr, and so the front end's log, into `path` while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as log_file:
        os.dup2(log_file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def render_front_end(result: dict) -> str:
    env = Environment.model_validate(result["environment"])
    lines = [
        f"# One client through one HTTP front end: {env.device}, commit {env.commit}",
        "",
        "The stub engine answers a forward on its next turn; CPU us: per request, each process.",
        "",
        "| request | front end p50 us | p90 us | front end CPU us | engine CPU us "
        "| echo p50 us | echo CPU us | hop p50 - echo p50 us |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['request']} | {r['front_end_p50_us']:.0f} | {r['front_end_p90_us']:.0f} "
        f"| {r['front_end_cpu_us']:.0f} | {r['front_end_engine_cpu_us']:.0f} "
        f"| {r['echo_p50_us']:.0f} | {r['echo_cpu_us']:.0f} "
        f"| {r['front_end_p50_us'] - r['echo_p50_us']:.0f} |"
        for r in result["rows"]
    ]
    return "\n".join(lines) + "\n"


def run_front_end(load: FrontEndLoad, env: Environment, path: Path) -> dict:
    """Writes `path` and its .md; the processes' logs beside it."""
    rows = measure_front_end(load, path.with_suffix(""))
    result = {"environment": env.model_dump(), "tokens": load.tokens, "hidden": load.hidden,
              "rows": rows}  # fmt: skip
    write_result(path, result, render_front_end(result))
    return result
