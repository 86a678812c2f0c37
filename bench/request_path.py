"""Where one request's time goes: each level of the server's path timed alone, one request at a
time, beside the one-client HTTP latency of the same layer: `moe-serve bench service --mode
path`.

For each layer a bench server (bench/service_server.py) is started, in one process and behind
front ends, and timed at each level, by the host clock, medians:

| level | what one call does |
| --- | --- |
| device | the captured forward replayed on inputs already on the device, then a device sync |
| engine | `Engine.start(...).result()`: a pageable CPU part in, the output back (batch of one) |
| engine-pinned | the same from pinned memory into pinned memory (the front ends' arena path) |
| batcher | `DynamicBatcher.submit`: queue, launch, completion (pageable part) |
| batcher-pinned | the same with pinned inputs and `output_into` |
| batcher-cuda | float32 inputs and `output_into` on the device (CUDA shared memory's forward) |
| infer-cuda | `inference.infer` of a KServe request whose tensors lie in a CUDA region |
| blob | `serve_blob`: decode a safetensors body, submit, encode the reply (one process) |
| blob-into | `serve_blob_into`: the engine's side of a front end's forward (pinned arena) |
| http | one client over HTTP (a lean keep-alive client, `load_gen.run_one_client`), one process |
| http-front-ends | the same through the front-end processes (`--front-ends`) |
| http-floor | the same body posted to bench/echo_server.py (client, loopback and HTTP alone) |

The levels up to blob-into run inside the server (POST /bench/path); consecutive levels differ by
one stage.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import safetensors.torch
import torch

from ..kernels.tensors import ForwardInputs
from ..service.codecs.kserve import (
    SHM_BYTE_SIZE,
    SHM_OFFSET,
    SHM_REGION,
    InferInput,
    InferRequest,
    RequestedOutput,
)
from ..service.core import inference
from ..service.core.forward import LayerCall, serve_blob, serve_blob_into
from ..service.engine.batcher import RequestOptions
from ..service.triton.shared_memory import DeviceRegion
from .load_gen import run_one_client
from .schema import Environment, write_result
from .service_bench import _free_port, _tcp_ready, http_ready, process

_BUDGET_S = 0.5  # timed work per level and token count
_MIN_CALLS, _MAX_CALLS, _WARMUP = 30, 2000, 10
_HTTP_SECONDS = 4.0


async def _timed(call: Callable[[], Awaitable[object] | object]) -> tuple[float, float]:
    """Median and p90 seconds of `call` (awaited when it returns an awaitable)."""

    async def once() -> float:
        started = time.perf_counter()
        result = call()
        if asyncio.iscoroutine(result):
            await result
        return time.perf_counter() - started

    for _ in range(_WARMUP):
        await once()
    samples: list[float] = []
    deadline = time.perf_counter() + _BUDGET_S
    while len(samples) < _MIN_CALLS or (
        time.perf_counter() < deadline and len(samples) < _MAX_CALLS
    ):
        samples.append(await once())
    return statistics.median(samples), statistics.quantiles(samples, n=10)[8]


async def time_levels(runtime, tokens: list[int]) -> list[dict]:
    """Each in-process level at each token count: dicts of tokens, level, median_us, p90_us."""
    engine, batcher, metrics = runtime.engine, runtime.batcher, runtime.metrics
    served = next(iter(engine.layers.values()))
    cfg, name = served.config, served.name
    layer_call = LayerCall(served, batcher, metrics)
    cuda = served.device.type == "cuda"
    generator = torch.Generator().manual_seed(2)
    never = asyncio.get_running_loop().create_future()  # the client stays
    rows = []
    for t in tokens:
        hidden = torch.randn(t, cfg.hidden_size, generator=generator).to(cfg.dtype)
        logits = None if served.has_router else torch.randn(t, cfg.num_experts)
        cpu = ForwardInputs(hidden, logits)
        blob = safetensors.torch.save(
            {"hidden_states": hidden} | ({} if logits is None else {"router_logits": logits})
        )
        levels: dict[str, Callable[[], object]] = {}
        if cuda and served.graphs is not None and t <= served.graphs.max_tokens:
            on_device = ForwardInputs(
                hidden.to(served.device), None if logits is None else logits.to(served.device)
            )

            def device(on_device=on_device) -> None:
                served.graphs.forward(on_device)
                torch.cuda.synchronize(served.device)

            levels["device"] = device
        levels["engine"] = lambda cpu=cpu: engine.start(name, [cpu]).result()
        if cuda:
            pinned = ForwardInputs(hidden.pin_memory(), None if logits is None else logits)
            into = torch.empty_like(hidden).pin_memory()
            levels["engine-pinned"] = lambda p=pinned, o=into: engine.start(name, [p], [o]).result()
        levels["batcher"] = lambda cpu=cpu: batcher.submit(name, cpu)
        if cuda:
            levels["batcher-pinned"] = lambda p=pinned, o=into: batcher.submit(
                name, p, output_into=o
            )
            # float32 rows on the device in and out: a CUDA shared-memory request's forward
            gpu = ForwardInputs(
                hidden.float().to(served.device),
                None if logits is None else logits.to(served.device),
            )
            gpu_into = torch.empty_like(gpu.hidden_states)
            levels["batcher-cuda"] = lambda g=gpu, o=gpu_into: batcher.submit(
                name, g, output_into=o
            )
            if runtime.shared_memory.allowed:
                request = _cuda_region_request(runtime, served, gpu.hidden_states)
                levels["infer-cuda"] = lambda r=request: inference.infer(runtime, name, "", r, {})
        levels["blob"] = lambda b=blob: serve_blob(layer_call, b, RequestOptions(), False, never)
        if cuda and logits is None:
            arena = torch.empty(2 * len(blob) + (64 << 10), dtype=torch.uint8).pin_memory()
            view = memoryview(arena.numpy())
            view[: len(blob)] = blob
            body, reply = view[: len(blob)], view[len(blob) :]
            levels["blob-into"] = lambda b=body, r=reply: serve_blob_into(
                layer_call, b, r, True, never
            )
        for level, call in levels.items():
            median, p90 = await _timed(call)
            rows.append({"tokens": t, "level": level, "median_us": median * 1e6,
                         "p90_us": p90 * 1e6})  # fmt: skip
    return rows


def _cuda_region_request(runtime, served, rows: torch.Tensor) -> InferRequest:
    """A KServe request whose input `rows` (float32, on the layer's GPU) and output lie in a
    CUDA region of their own, registered as a client's would be (without the IPC handle, which
    one process cannot open for itself)."""
    nbytes = rows.numel() * rows.element_size()
    memory = torch.empty(2 * nbytes, dtype=torch.uint8, device=served.device)
    memory[:nbytes].copy_(rows.flatten().view(torch.uint8))
    region = f"bench-path-{rows.shape[0]}"
    runtime.shared_memory.regions[region] = DeviceRegion(
        region, memory, served.device.index or 0, None
    )
    place = {SHM_REGION: region, SHM_BYTE_SIZE: nbytes}
    return InferRequest(
        inputs=[InferInput(name="hidden_states", shape=list(rows.shape), datatype="FP32",
                           parameters=place)],
        outputs=[RequestedOutput(name="output", parameters=place | {SHM_OFFSET: nbytes})],
    )  # fmt: skip


def _http_level(url: str, body: Path, level: str, tokens: int) -> dict:
    load = run_one_client(url, body.read_bytes(), "application/octet-stream", _HTTP_SECONDS)
    if not load.latencies_s or load.errors:
        raise RuntimeError(f"{level}: {load.errors or 'no answers'}")
    median = statistics.median(load.latencies_s)
    p90 = statistics.quantiles(load.latencies_s, n=10)[8]
    return {"tokens": tokens, "level": level, "median_us": median * 1e6, "p90_us": p90 * 1e6}


def _bodies(hidden_size: int, tokens: list[int], where: Path) -> dict[int, Path]:
    generator = torch.Generator().manual_seed(3)
    files = {}
    for t in tokens:
        hidden = torch.randn(t, hidden_size, generator=generator).bfloat16()
        files[t] = where / f"path-{hidden_size}-{t}.safetensors"
        files[t].write_bytes(safetensors.torch.save({"hidden_states": hidden}))
    return files


def server_command(layer: str, port: int, front_ends: int, shared: int) -> list[str]:
    """bench/service_server.py serving `layer` (the demo layer has no shared expert to add)."""
    command = [sys.executable, "-m", "moe_serve.bench.service_server", "--layer", layer,
               "--port", str(port), "--http-workers", str(front_ends),
               "--allow-shared-memory"]  # fmt: skip
    return command if layer == "demo" else [*command, "--shared-intermediate", str(shared)]


def measure_layer(
    layer: str, tokens: list[int], work: Path, logs: Path, shared: int, front_ends: int
) -> list[dict]:
    rows: list[dict] = []
    for workers in sorted({0, front_ends}):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        command = server_command(layer, port, workers, shared)
        with process(command, logs / f"{layer}-{workers}.log", http_ready(url), 600):
            hidden = httpx.get(f"{url}/v1/layers/{layer}").json()["hidden_size"]
            bodies = _bodies(hidden, tokens, work)
            forward = f"{url}/v1/layers/{layer}/forward"
            if not workers:
                bare = httpx.post(f"{url}/bench/bare", json={"tokens": tokens}, timeout=600)
                rows += [{"tokens": b["tokens"], "level": "bare (CUDA events)",
                          "median_us": b["median_us"], "p90_us": b["p90_us"]}
                         for b in bare.json()]  # fmt: skip
                path = httpx.post(f"{url}/bench/path", json={"tokens": tokens}, timeout=600)
                rows += path.json()
            level = "http-front-ends" if workers else "http"
            rows += [_http_level(forward, bodies[t], level, t) for t in tokens]
    echo_port = _free_port()
    echo = [sys.executable, "-m", "moe_serve.bench.echo_server", "--port", str(echo_port)]
    with process(echo, logs / "echo.log", _tcp_ready(echo_port), 60):
        rows += [
            _http_level(f"http://127.0.0.1:{echo_port}/echo", bodies[t], "http-floor", t)
            for t in tokens
        ]
    return rows


def render(result: dict) -> str:
    env = Environment.model_validate(result["environment"])
    lines = [f"# One request, level by level: {env.device}, commit {env.commit}", ""]
    for layer, rows in result["layers"].items():
        tokens = sorted({r["tokens"] for r in rows})
        levels = list(dict.fromkeys(r["level"] for r in rows))
        lines += [f"## {layer}", "", "| level | " + " | ".join(f"{t} tok p50 us" for t in tokens)
                  + " |", "| --- |" + " ---: |" * len(tokens)]  # fmt: skip
        for level in levels:
            cells = []
            for t in tokens:
                hit = [r for r in rows if r["level"] == level and r["tokens"] == t]
                cells.append(f"{hit[0]['median_us']:.0f}" if hit else "-")
            lines.append(f"| {level} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def run(
    layers: list[str], tokens: int, shared: int, front_ends: int, env: Environment, path: Path
) -> dict:
    """Each layer at one token and at `tokens`; writes `path` (after each layer) and its .md."""
    logs = path.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    result: dict = {"environment": env.model_dump(), "layers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for layer in layers:
            counts = sorted({1, tokens})
            rows = measure_layer(layer, counts, Path(tmp), logs, shared, front_ends)
            result["layers"][layer] = rows
            write_result(path, result, render(result))
    return result
