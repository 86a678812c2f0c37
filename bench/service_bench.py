"""`moe-serve bench service` (`--mode load`): the service as deployed, under load, in one run.

For each layer (the demo layer; a DeepSeek-V3-sized fp8-block layer with a router and a shared
expert, drawn on the device) a server (bench/service_server.py) runs in its own process and is
loaded at each concurrency level with 64-token bf16 binary bodies that differ, so routing
differs (hey, several processes; a Python client where hey is absent), then one client with
1-token and with JSON bodies. Per level the server's /metrics give the forwards it ran, their
device time (CUDA events) and the tokens each carried, and the bench server counts its forwards
by batch size (`/bench/forwards`); afterwards the server times its own bare forward at every
size formed (`/bench/bare`), and each level is compared with the bare forward of its own sizes.
Each layer is served by one process and behind front-end processes (`--no-one-process`: only
behind them). Then: the demo layer with batching off (`--max-batch-tokens` = one request) at
the most clients; the demo layer on uvicorn's pure-Python stack (h11, asyncio loop) beside the
default (httptools and uvloop where installed); and the load generator's own capacity against a
trivial server (bench/echo_server.py) with the same bodies. Every part is guarded: one that
fails is recorded and the others run.

While each level's load runs, and for a moment with no load once each server is ready (the
floor), a side prober in a process of its own (bench/load_gen.py `SideProber`: a raw socket,
one keep-alive connection) sends GET /health and GET /v2/health/ready in turn every 10 ms and
times each from sending it to its whole response; a probe not answered 200 within 1 s failed.

Writes the result (everything) and its .md (the tables, the targets last), the servers' logs in
a folder beside them, and prints the tables.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import safetensors.torch
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from .http_bench import percentiles_ms
from .load_gen import (
    PROBE_INTERVAL_S,
    PROBE_PATHS,
    Load,
    Probes,
    SideProber,
    hey_binary,
    run_hey,
    run_one_client,
    run_python,
)
from .schema import Environment, write_result
from .shapes import SHAPES

log = logging.getLogger(__name__)

BINARY = "application/octet-stream"
JSON = "application/json"
DEMO = "demo"
STAGES = ("queue", "decode", "stage", "h2d", "forward", "d2h", "encode")
_READY_POLL_S = 0.5
_IDLE_PROBE_S = 1.0
PROBE_TARGET_MS = 0.5  # p50 of a probe answered by a front end, under any load


@dataclass(frozen=True)
class ServiceBenchConfig:
    layers: tuple[str, ...] = ("deepseek-v3", DEMO)  # demo, or a shape of bench/shapes.py
    clients: tuple[int, ...] = (1, 16, 64, 256)
    tokens: int = 64  # per request
    duration_s: float = 4.0  # per level
    device: str = "auto"
    backend: str = "triton"
    shared_intermediate: int = 2048  # the shared expert of random layers (DeepSeek-V3's size)
    bodies: int = 8  # different request bodies, one hey process each
    max_batch_tokens: int = 1024
    budget_s: float = 480.0  # no part starts after this many seconds
    generator: str = "auto"  # auto (hey if on PATH), hey or python
    ready_timeout_s: float = 300.0  # a server's load, warm-up and captures
    stack_variant: bool = True  # also the demo layer on h11 + asyncio
    # also each layer (and batching off) behind this many HTTP front-end processes; 0: not
    http_workers: int = 8
    one_process: bool = True  # the one-process variants; False: only behind the front ends

    def __post_init__(self) -> None:
        for layer in self.layers:
            if layer != DEMO and layer not in SHAPES:
                raise ValueError(f"unknown layer {layer!r}: {DEMO} or one of {', '.join(SHAPES)}")
        if self.http_workers < 0:
            raise ValueError(f"http_workers must be >= 0, got {self.http_workers}")
        if not self.one_process and not self.http_workers:
            raise ValueError("nothing to serve: neither one process nor front ends")
        if self.generator not in ("auto", "hey", "python"):
            raise ValueError(f"generator must be auto, hey or python, got {self.generator!r}")
        if not self.clients or min(self.clients) < 1 or self.tokens < 1 or self.bodies < 1:
            raise ValueError("clients, tokens and bodies must be positive")


class ProbeStats(BaseModel):
    """The side prober's probes: answered (200) ones' latencies, the others as failures."""

    probes: int  # sent
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    failures: dict[str, int] = {}  # "PATH STATUS", "PATH timeout" or "PATH ERROR" -> count


def probe_stats(probes: Probes | None) -> ProbeStats | None:
    """None where the prober came back with nothing."""
    if probes is None:
        return None
    p50, _, p99 = percentiles_ms(probes.latencies_s)
    worst = max(probes.latencies_s, default=None)
    return ProbeStats(
        probes=probes.sent,
        p50_ms=p50,
        p99_ms=p99,
        max_ms=None if worst is None else worst * 1e3,
        failures=probes.failures,
    )


class LevelResult(BaseModel):
    layer: str
    variant: str  # "default", "N front ends", "batching off[, N front ends]", "h11+asyncio", "echo"
    body: str  # binary or json
    tokens: int  # per request
    clients: int
    generator: str
    ok: int
    errors: dict[str, int]
    elapsed_s: float
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    forwards: int | None = None  # forwards the server ran during the level
    server_forward_ms: float | None = None  # mean device time of one forward
    tokens_per_forward: float | None = None
    gpu_busy: float | None = None  # forward device time / wall time
    stage_ms: dict[str, float] = {}  # mean per stage (see service.metrics.STAGES)
    # batch size -> (forwards, their device time in s), from the server's /bench/forwards
    forward_sizes: dict[int, tuple[int, float]] = {}
    bare_forward_ms: float | None = None  # the bare forward, averaged over the same batch sizes
    tokens_per_s_vs_bare: float | None = None  # service tokens/s over the bare forward's there
    # the batch size whose served forward exceeds its bare one most: (tokens, served ms, bare ms)
    worst_size: tuple[int, float, float] | None = None
    probe: ProbeStats | None = None  # the side prober's, while the load ran


class ServerRun(BaseModel):
    layer: str
    variant: str
    options: list[str]
    seconds_to_ready: float | None = None
    idle_probe: ProbeStats | None = None  # the side prober's, with no load
    layer_info: dict = {}
    bare: dict[int, dict] = {}  # tokens -> BareTiming as the server returned it
    levels: list[LevelResult] = []


class Check(BaseModel):
    target: str
    figure: str
    met: bool | None  # None: not measured


class ServiceBenchResult(BaseModel):
    environment: Environment
    config: dict
    http_stack: dict[str, bool]  # which fast parts uvicorn finds here
    runs: list[ServerRun] = []
    echo: list[LevelResult] = []
    failures: dict[str, str] = {}
    checks: list[Check] = []


@dataclass
class Bodies:
    """One layer's request bodies, in memory and as files (hey reads files)."""

    binary: list[bytes]
    files: list[Path]
    one_token: bytes
    one_token_file: Path
    json: bytes


def make_bodies(hidden_size: int, tokens: int, count: int, where: Path, seed: int = 0) -> Bodies:
    """`count` different [tokens, H] bf16 safetensors bodies, a 1-token one and a JSON one."""
    generator = torch.Generator().manual_seed(seed)

    def blob(rows: int) -> bytes:
        hidden = torch.randn(rows, hidden_size, generator=generator).bfloat16()
        return safetensors.torch.save({"hidden_states": hidden})

    binary = [blob(tokens) for _ in range(count)]
    files = []
    for i, data in enumerate(binary):
        files.append(where / f"body-{hidden_size}-{tokens}-{i}.safetensors")
        files[-1].write_bytes(data)
    one = blob(1)
    one_file = where / f"body-{hidden_size}-1.safetensors"
    one_file.write_bytes(one)
    rows = torch.randn(tokens, hidden_size, generator=generator).bfloat16().float().tolist()
    return Bodies(binary, files, one, one_file, json.dumps({"hidden_states": rows}).encode())


def scrape(url: str, layer: str) -> dict[str, float]:
    """Sums and counts of the forward, batch-size and stage histograms of `layer`."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("layer") != layer or not sample.name.endswith(("_sum", "_count")):
                continue
            stage = sample.labels.get("stage")
            totals[sample.name if stage is None else f"{sample.name}:{stage}"] += sample.value
    return totals


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def level_result(
    layer: str,
    variant: str,
    body: str,
    tokens: int,
    load: Load,
    before: dict[str, float] | None,
    after: dict[str, float] | None,
) -> LevelResult:
    p50, p90, p99 = load.percentiles_ms()
    result = LevelResult(
        layer=layer,
        variant=variant,
        body=body,
        tokens=tokens,
        clients=load.clients,
        generator=load.generator,
        ok=load.ok,
        errors=load.errors,
        elapsed_s=load.elapsed_s,
        requests_per_s=load.rate,
        tokens_per_s=load.rate * tokens,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
    )
    if before is None or after is None:
        return result
    forwards = _delta(before, after, "moe_serve_forward_seconds_count")
    if forwards <= 0:
        return result
    forward_s = _delta(before, after, "moe_serve_forward_seconds_sum")
    stage_ms = {}
    for stage in STAGES:
        count = _delta(before, after, f"moe_serve_stage_seconds_count:{stage}")
        if count > 0:
            stage_ms[stage] = _delta(before, after, f"moe_serve_stage_seconds_sum:{stage}") / count
            stage_ms[stage] *= 1e3
    return result.model_copy(
        update={
            "forwards": int(forwards),
            "server_forward_ms": forward_s / forwards * 1e3,
            "tokens_per_forward": _delta(before, after, "moe_serve_batch_tokens_sum") / forwards,
            "gpu_busy": forward_s / load.elapsed_s if load.elapsed_s > 0 else None,
            "stage_ms": stage_ms,
        }
    )


def with_bare(level: LevelResult, bare: dict[int, dict]) -> LevelResult:
    """The level's figures against the bare forward of each batch size it formed."""
    sizes = level.forward_sizes
    if not sizes or any(t not in bare for t in sizes):
        return level
    bare_s = {t: bare[t]["median_us"] / 1e6 for t in sizes}
    forwards = sum(n for n, _ in sizes.values())
    bare_total_s = sum(n * bare_s[t] for t, (n, _) in sizes.items())
    bare_tokens_per_s = sum(n * t for t, (n, _) in sizes.items()) / bare_total_s
    worst = max(sizes, key=lambda t: sizes[t][1] / sizes[t][0] - bare_s[t])
    return level.model_copy(
        update={
            "bare_forward_ms": bare_total_s / forwards * 1e3,
            "tokens_per_s_vs_bare": level.tokens_per_s / bare_tokens_per_s,
            "worst_size": (worst, sizes[worst][1] / sizes[worst][0] * 1e3, bare_s[worst] * 1e3),
        }
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process(
    command: list[str],
    log_path: Path,
    ready: Callable[[], bool],
    timeout_s: float,
    env: dict[str, str] | None = None,
):
    """Run `command` in its own process group (with `env`, else this process's environment)
    until the block ends; yields seconds to ready."""
    started = time.monotonic()
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} before ready; see {log_path}")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"not ready after {timeout_s:.0f} s; see {log_path}")
            time.sleep(_READY_POLL_S)
        yield time.monotonic() - started
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def http_ready(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    return ready


def _tcp_ready(port: int) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    return ready


class ServiceBench:
    def __init__(self, config: ServiceBenchConfig, env: Environment, path: Path) -> None:
        """Writes the result to `path` (and its .md) as it goes, the logs in a folder beside."""
        self.config = config
        self.path = path
        self.out = path.with_suffix("")  # the servers' logs
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.generator = config.generator
        if self.generator == "auto":
            self.generator = "hey" if hey_binary() else "python"
        stack = {name: importlib.util.find_spec(name) is not None
                 for name in ("httptools", "uvloop")}  # fmt: skip
        self.result = ServiceBenchResult(
            environment=env,
            config={k: str(v) for k, v in asdict(config).items()},
            http_stack=stack,
        )
        self.bodies: dict[int, Bodies] = {}  # hidden size -> bodies
        self._scratch = Path(tempfile.mkdtemp(prefix="moe-serve-bodies-"))

    def _left_s(self) -> float:
        return self.config.budget_s - (time.monotonic() - self.started)

    def _attempt(self, name: str, fn: Callable[[], None]) -> None:
        """One part; a failure is recorded and logged, the run goes on."""
        if self._left_s() <= 0:
            self.result.failures[name] = "skipped: the time budget is spent"
            log.warning("%s skipped: the time budget is spent", name)
            return
        log.info("%s (%.0f s of the budget left)", name, self._left_s())
        try:
            fn()
        except Exception as err:
            log.exception("%s failed", name)
            self.result.failures[name] = f"{type(err).__name__}: {err}"
        self.save()

    def run(self) -> ServiceBenchResult:
        c = self.config
        fronted = [front_ends_variant(c.http_workers)] if c.http_workers else []
        for layer in c.layers:
            if c.one_process:
                self._attempt(f"{layer}: serve", lambda layer=layer: self._serve(layer, "default"))
            if c.one_process and not any(r.layer == layer and r.levels for r in self.result.runs):
                # measure what can be measured: the same without CUDA graphs
                self._attempt(f"{layer}: serve without CUDA graphs",
                              lambda layer=layer: self._serve(layer, "no graphs"))  # fmt: skip
            for variant in fronted:
                self._attempt(f"{layer}: {variant}",
                              lambda layer=layer, v=variant: self._serve(layer, v))  # fmt: skip
        self._attempt("load generator capacity", self._echo)
        if DEMO in c.layers and max(c.clients) > 1:
            one = ["batching off"] if c.one_process else []
            for variant in one + [f"batching off, {v}" for v in fronted]:
                self._attempt(f"{DEMO}: {variant}", lambda v=variant: self._serve(DEMO, v))
            if c.stack_variant and c.one_process:
                self._attempt(f"{DEMO}: h11+asyncio", lambda: self._serve(DEMO, "h11+asyncio"))
        self.result.checks = checks(self.result, c)
        self.save()
        return self.result

    def _server_command(self, layer: str, variant: str, port: int) -> list[str]:
        c = self.config
        command = [sys.executable, "-m", "moe_serve.bench.service_server", "--layer", layer,
                   "--port", str(port), "--device", c.device, "--backend", c.backend]  # fmt: skip
        if layer != DEMO:
            command += ["--shared-intermediate", str(c.shared_intermediate)]
        batch = c.tokens if variant.startswith("batching off") else c.max_batch_tokens
        command += ["--max-batch-tokens", str(batch)]
        if variant.endswith(front_ends_variant(c.http_workers)):
            command += ["--http-workers", str(c.http_workers)]
        if variant == "h11+asyncio":
            command += ["--http", "h11", "--loop", "asyncio"]
        if variant == "no graphs":
            command += ["--no-cuda-graphs"]
        return command

    def _serve(self, layer: str, variant: str) -> None:
        c = self.config
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        command = self._server_command(layer, variant, port)
        run = ServerRun(layer=layer, variant=variant, options=command[3:])
        self.result.runs.append(run)
        slug = variant.replace(" ", "-").replace("+", "-")
        log_path = self.out / f"server-{layer}-{slug}.log"
        timeout = min(c.ready_timeout_s, max(self._left_s(), 60.0))
        with process(command, log_path, http_ready(url), timeout) as seconds:
            run.seconds_to_ready = seconds
            run.layer_info = httpx.get(f"{url}/v1/layers/{layer}", timeout=10).json()
            with SideProber(url) as prober:
                time.sleep(_IDLE_PROBE_S)
            run.idle_probe = probe_stats(prober.probes)
            bodies = self._bodies(run.layer_info["hidden_size"])
            path = f"/v1/layers/{layer}/forward"
            if _full(variant):
                levels = [("binary", c.tokens, n) for n in c.clients]
                levels += [("binary", 1, 1), ("json", c.tokens, 1)]
            elif variant.startswith("batching off"):
                levels = [("binary", c.tokens, max(c.clients))]
            else:
                levels = [("binary", c.tokens, n) for n in sorted({1, max(c.clients)})]
            for body, tokens, clients in levels:
                if self._left_s() <= 0:
                    self.result.failures[f"{layer} {variant}: {body} {tokens} tok x {clients}"] = (
                        "skipped: the time budget is spent"
                    )
                    continue
                level = self._level(url, layer, variant, path, bodies, body, tokens, clients)
                run.levels.append(level)
                log.info("%s", _row(level))
                self.save()
            if _full(variant):
                sizes = {1, c.tokens}.union(*(lv.forward_sizes for lv in run.levels))
                timed = httpx.post(
                    f"{url}/bench/bare", json={"tokens": sorted(sizes)}, timeout=600
                ).json()
                run.bare = {t["tokens"]: t for t in timed}
                run.levels = [with_bare(lv, run.bare) for lv in run.levels]

    def _bodies(self, hidden_size: int) -> Bodies:
        if hidden_size not in self.bodies:
            self.bodies[hidden_size] = make_bodies(
                hidden_size, self.config.tokens, self.config.bodies, self._scratch
            )
        return self.bodies[hidden_size]

    def _load(self, url: str, bodies: Bodies, body: str, tokens: int, clients: int) -> Load:
        duration = self.config.duration_s
        if body == "json":
            data, files, media = [bodies.json], None, JSON
        elif tokens == 1:
            data, files, media = [bodies.one_token], [bodies.one_token_file], BINARY
        else:
            data, files, media = bodies.binary, bodies.files, BINARY
        if clients == 1:
            return run_one_client(url, data[0], media, duration)
        if self.generator == "hey" and files is not None:
            return run_hey(url, files, media, clients, duration)
        return run_python(url, data[0], media, clients, duration)

    def _level(
        self,
        url: str,
        layer: str,
        variant: str,
        path: str,
        bodies: Bodies,
        body: str,
        tokens: int,
        clients: int,
    ) -> LevelResult:
        httpx.post(f"{url}/bench/forwards", timeout=10)  # counts from here
        before = scrape(url, layer)
        with SideProber(url) as prober:
            load = self._load(url + path, bodies, body, tokens, clients)
        after = scrape(url, layer)
        level = level_result(layer, variant, body, tokens, load, before, after)
        sizes = httpx.post(f"{url}/bench/forwards", timeout=10).json()
        forward_sizes = {s["tokens"]: (s["forwards"], s["seconds"]) for s in sizes}
        update = {"forward_sizes": forward_sizes, "probe": probe_stats(prober.probes)}
        return level.model_copy(update=update)

    def _echo(self) -> None:
        """The load generator against a trivial server, with each layer's bodies."""
        port = _free_port()
        command = [sys.executable, "-m", "moe_serve.bench.echo_server", "--port", str(port)]
        clients = max(self.config.clients)
        with process(command, self.out / "echo-server.log", _tcp_ready(port), 30):
            for hidden_size, bodies in self.bodies.items():
                for tokens in (self.config.tokens, 1):
                    load = self._load(f"http://127.0.0.1:{port}/echo", bodies, "binary", tokens,
                                      clients)  # fmt: skip
                    level = level_result(f"H={hidden_size}", "echo", "binary", tokens, load,
                                         None, None)  # fmt: skip
                    self.result.echo.append(level)
                    log.info("%s", _row(level))

    def save(self) -> None:
        write_result(self.path, self.result, render(self.result))


def _ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _probe_ms(probe: ProbeStats | None) -> str:
    """p50/p99 of the answered probes."""
    return "-" if probe is None else f"{_ms(probe.p50_ms, 3)}/{_ms(probe.p99_ms, 3)}"


def _row(lv: LevelResult) -> str:
    errors = sum(lv.errors.values())
    return (
        f"| {lv.layer} | {lv.variant} | {lv.body} | {lv.tokens} | {lv.clients} "
        f"| {lv.requests_per_s:,.0f} | {lv.tokens_per_s:,.0f} | {_ms(lv.p50_ms)} "
        f"| {_ms(lv.p99_ms)} | {_ms(lv.server_forward_ms, 3)} | {_ms(lv.bare_forward_ms, 3)} "
        f"| {_ms(lv.tokens_per_forward, 0)} | {_pct(lv.gpu_busy)} "
        f"| {_pct(lv.tokens_per_s_vs_bare)} | {_probe_ms(lv.probe)} | {errors} |"
    )


_HEAD = (
    "| layer | variant | body | tok/req | clients | req/s | tok/s | p50 ms | p99 ms "
    "| server fwd ms | bare fwd ms | tok/fwd | GPU busy | tok/s vs bare | probe p50/p99 ms "
    "| errors |\n"
    + "|" + " --- |" * 16
)  # fmt: skip


def _probe_row(layer: str, variant: str, clients: str, probe: ProbeStats) -> str:
    failures = ", ".join(f"{kind}: {n}" for kind, n in sorted(probe.failures.items())) or "0"
    return (
        f"| {layer} | {variant} | {clients} | {probe.probes} | {_ms(probe.p50_ms, 3)} "
        f"| {_ms(probe.p99_ms, 3)} | {_ms(probe.max_ms, 3)} | {failures} |"
    )


def render(result: ServiceBenchResult) -> str:
    env = result.environment
    lines = [
        f"# Service benchmark: {env.device}, commit {env.commit}, {env.created}",
        "",
        f"uvicorn fast parts installed: {result.http_stack}",
        "",
        "server fwd: the mean device time of the level's forwards; bare fwd: the bare forward "
        "(graph replay, CUDA events, back to back) of each batch size the level formed, "
        "averaged over the same forwards.",
        "",
        _HEAD,
    ]
    lines += [_row(lv) for run in result.runs for lv in run.levels]
    lines += [_row(lv) for lv in result.echo]
    lines += ["", f"Probes (GET {' and '.join(PROBE_PATHS)} in turn, one every "
              f"{PROBE_INTERVAL_S * 1e3:.0f} ms on a keep-alive connection of their own, from "
              "a process of their own, timed to the whole response; idle: no load):",
              "", "| layer | variant | clients | probes | p50 ms | p99 ms | max ms | failures |",
              "|" + " --- |" * 8]  # fmt: skip
    for run in result.runs:
        if run.idle_probe is not None:
            lines.append(_probe_row(run.layer, run.variant, "idle", run.idle_probe))
        lines += [_probe_row(lv.layer, lv.variant, f"{lv.clients} ({lv.body}, {lv.tokens} tok)",
                             lv.probe) for lv in run.levels if lv.probe is not None]  # fmt: skip
    lines += ["", "Mean time per stage (ms; queue/decode/encode per request, others per batch):",
              "", "| layer | variant | clients | tok/req | " + " | ".join(STAGES) + " |",
              "|" + " --- |" * (4 + len(STAGES))]  # fmt: skip
    for run in result.runs:
        for lv in run.levels:
            stages = " | ".join(_ms(lv.stage_ms.get(s), 3) for s in STAGES)
            lines.append(f"| {lv.layer} | {lv.variant} | {lv.clients} | {lv.tokens} | {stages} |")
    lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
    met = {True: "yes", False: "NO", None: "-"}
    lines += [f"| {c.target} | {c.figure} | {met[c.met]} |" for c in result.checks]
    lines += [f"| FAILED {name} | {why} | |" for name, why in result.failures.items()]
    return "\n".join(lines) + "\n"


def front_ends_variant(http_workers: int) -> str:
    return f"{http_workers} front ends"


def _full(variant: str) -> bool:
    """Variants loaded at every level and timed bare: the layer served as it is configured."""
    return variant in ("default", "no graphs") or (
        variant.endswith("front ends") and not (variant.startswith("batching off"))
    )


def _find(
    result: ServiceBenchResult, layer: str, variant: str, body: str, tokens: int, clients: int
) -> LevelResult | None:
    for run in result.runs:
        for lv in run.levels:
            key = (lv.layer, lv.variant, lv.body, lv.tokens, lv.clients)
            if key == (layer, variant, body, tokens, clients):
                return lv
    return None


def _bare_ms(result: ServiceBenchResult, layer: str, variant: str, tokens: int) -> float | None:
    for run in result.runs:
        if run.layer == layer and run.variant == variant and tokens in run.bare:
            return run.bare[tokens]["median_us"] / 1e3
    return None


def checks(result: ServiceBenchResult, c: ServiceBenchConfig) -> list[Check]:
    """The targets against what this run measured, for the layer served by one process
    and behind front-end processes."""
    out: list[Check] = []
    served = (["default"] if c.one_process else []) + (
        [front_ends_variant(c.http_workers)] if c.http_workers else []
    )
    for layer in c.layers:
        for variant in served:
            out += _layer_checks(result, c, layer, variant)
        if c.http_workers:
            out.append(_probe_check(result, layer, front_ends_variant(c.http_workers)))
    most = max(c.clients)
    for variant in served:
        on = _find(result, DEMO, variant, "binary", c.tokens, most)
        off_variant = "batching off" + ("" if variant == "default" else f", {variant}")
        off = _find(result, DEMO, off_variant, "binary", c.tokens, most)
        if on and off and off.requests_per_s > 0:
            ratio = on.requests_per_s / off.requests_per_s
            out.append(Check(
                target=f"{DEMO}{_label(variant)}: {most} clients: batching on >= 5x batching off",
                figure=f"{on.requests_per_s:,.0f} vs {off.requests_per_s:,.0f} req/s "
                f"({ratio:.1f}x)",
                met=ratio >= 5,
            ))  # fmt: skip
    for echo in result.echo:
        hidden = int(echo.layer.removeprefix("H="))
        served = [lv.requests_per_s for run in result.runs for lv in run.levels
                  if lv.tokens == echo.tokens and lv.body == "binary"
                  and run.layer_info.get("hidden_size") == hidden]  # fmt: skip
        if served:
            out.append(Check(
                target=f"load generator, H={hidden}, {echo.tokens} tok: >= 3x the rates reported",
                figure=f"{echo.requests_per_s:,.0f} vs {max(served):,.0f} req/s",
                met=echo.requests_per_s >= 3 * max(served),
            ))  # fmt: skip
    return out


def _probe_check(result: ServiceBenchResult, layer: str, variant: str) -> Check:
    """The front ends answer the probes themselves, from the engine's published state: fast
    and never failing, however busy the engine is."""
    target = (
        f"{layer}{_label(variant)}: probes answered within {PROBE_TARGET_MS} ms p50 and never "
        "failed under load"
    )
    runs = [run for run in result.runs if (run.layer, run.variant) == (layer, variant)]
    probed = [lv for run in runs for lv in run.levels if lv.probe is not None]
    idle = next((run.idle_probe for run in runs if run.idle_probe is not None), None)
    if not probed:
        return Check(target=target, figure="not measured", met=None)
    worst = max(probed, key=lambda lv: math.inf if lv.probe.p50_ms is None else lv.probe.p50_ms)
    failed = sum(sum(lv.probe.failures.values()) for lv in probed)
    sent = sum(lv.probe.probes for lv in probed)
    p50 = worst.probe.p50_ms
    return Check(
        target=target,
        figure=f"worst p50 {_ms(p50, 3)} ms ({worst.clients} clients, {worst.body}, "
        f"{worst.tokens} tok), {failed} of {sent:,} failed, idle p50 "
        f"{_ms(None if idle is None else idle.p50_ms, 3)} ms",
        met=p50 is not None and p50 <= PROBE_TARGET_MS and failed == 0,
    )


def _label(variant: str) -> str:
    return f" ({'one process' if variant == 'default' else variant})"


def _layer_checks(
    result: ServiceBenchResult, c: ServiceBenchConfig, layer: str, variant: str
) -> list[Check]:
    out: list[Check] = []
    name = f"{layer}{_label(variant)}"
    slack = 0.5 if layer == DEMO else 1.0
    for tokens in (c.tokens, 1):
        lv = _find(result, layer, variant, "binary", tokens, 1)
        bare = _bare_ms(result, layer, variant, tokens)
        target = f"{name}: 1 client, {tokens} tok: p50 <= bare + {slack} ms"
        if lv is None or lv.p50_ms is None or bare is None:
            out.append(Check(target=target, figure="not measured", met=None))
            continue
        out.append(Check(
            target=target,
            figure=f"p50 {lv.p50_ms:.3f} ms, bare {bare:.3f} ms (+{lv.p50_ms - bare:.3f})",
            met=lv.p50_ms <= bare + slack,
        ))  # fmt: skip
    for clients in c.clients:
        lv = _find(result, layer, variant, "binary", c.tokens, clients)
        if lv is None or lv.worst_size is None:
            continue
        tokens, served, bare = lv.worst_size
        out.append(Check(
            target=f"{name}: {clients} clients: server forward <= bare + 0.2 ms at every batch "
            "size",
            figure=f"worst {served:.3f} vs {bare:.3f} ms at {tokens} tok (+{served - bare:.3f}; "
            f"{len(lv.forward_sizes)} sizes, in all {lv.server_forward_ms:.3f} vs "
            f"{lv.bare_forward_ms:.3f})",
            met=served - bare <= 0.2,
        ))  # fmt: skip
        # the GPU kept busy is the default deployment's target (front ends on a GPU host); one
        # process is an option, bound by its one event loop
        if layer != DEMO and clients >= 16 and variant != "default":
            out.append(Check(
                target=f"{name}: {clients} clients: GPU busy >= 90%, tok/s >= 90% of bare",
                figure=f"busy {_pct(lv.gpu_busy)}, tok/s {_pct(lv.tokens_per_s_vs_bare)}",
                met=(lv.gpu_busy or 0) >= 0.9 and (lv.tokens_per_s_vs_bare or 0) >= 0.9,
            ))  # fmt: skip
    binary = _find(result, layer, variant, "binary", c.tokens, 1)
    as_json = _find(result, layer, variant, "json", c.tokens, 1)
    if binary and as_json and binary.p50_ms is not None and as_json.p50_ms is not None:
        extra = as_json.p50_ms - binary.p50_ms
        out.append(Check(
            target=f"{name}: {c.tokens}-tok JSON p50 <= binary + 5 ms",
            figure=f"{as_json.p50_ms:.2f} vs {binary.p50_ms:.2f} ms (+{extra:.2f})",
            met=extra <= 5.0,
        ))  # fmt: skip
    return out
