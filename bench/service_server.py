"""The service as the service benchmarks run it: `create_app` on one layer made where it runs,
plus `/bench/...` routes that time the same layer in the same process. An internal entry point:
`moe-serve bench service` starts it in its own process,

    python -m moe_serve.bench.service_server --layer demo|deepseek-v3|... --port 8901
        [--backend triton] [--shared-intermediate 2048] [--max-batch-tokens 1024] [--http h11]
        [--loop asyncio] [--grpc-port 8001] [--allow-shared-memory] [--spans]

`--layer demo` serves the seeded demo layer (bf16) from the cache directory; any shape of
bench/shapes.py is drawn at random on the device with a stored router (and a shared expert
when `--shared-intermediate` is given), so an 11 GB DeepSeek-V3 layer is never written to disk.

POST /bench/bare {"tokens": [1, 64, ...]} times, for each token count, the forward as the server
runs it (graph replay where the layer has graphs, else the eager layer) on random inputs already
on the device, with kernels/timing.py (CUDA events, L2 not flushed: back-to-back forwards, as
served). Call it only while no load runs.

POST /bench/path {"tokens": [1, 64]} times one request at a time through each level of the
server's own path, inside this process, by the host clock (bench/request_path.py says which
level is which), so that a one-client HTTP latency can be split into where its time goes.

POST /bench/forwards returns the forwards run since its last call, by batch size (how many, their
device time in all, as the server's metrics recorded them), and starts counting afresh: the
benchmark compares each size with the bare forward of that size.

GET /bench/spans (with `--spans`) returns the OpenTelemetry spans the service recorded since its
last call (service/tracing.py: each request's server span, its body's receive and reply's send
events, `queue` and `forward`), and forgets them: `--spans` installs a tracer provider that keeps
them in memory, as a tracing back end would receive them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import BaseModel

from ..kernels.config import MoEConfig
from ..kernels.layer import LayerWeights
from ..kernels.tensors import ForwardInputs
from ..kernels.timing import Timer, TimingPlan
from ..service import logs
from ..service.core.runtime import LayerLoader
from ..service.engine.interface import LayerSource, ServedLayer, StageTimes
from ..service.frontends.supervisor import FrontEnds
from ..service.http.app import create_app
from ..service.http.server import listen, server_config
from ..service.interpreter import collect_less
from ..service.metrics import Metrics
from ..service.settings import Settings
from .random_layer import random_layer
from .shapes import SHAPES

log = logging.getLogger(__name__)

DEMO = "demo"
_BARE_PLAN = TimingPlan(warmup=3, min_iters=20, max_iters=500, budget_s=0.25)


@dataclass
class RandomLayer:
    name: str
    config: MoEConfig
    weights: LayerWeights
    device: torch.device


def layer_loader(layer: str, shared_intermediate: int | None) -> LayerLoader:
    """A loader for create_app: the demo layer from disk, or a random layer of a bench shape."""

    def load(settings: Settings, devices: Sequence[torch.device]) -> list[LayerSource]:
        device = devices[0]  # one layer
        if layer == DEMO:
            from ..weights.demo import ensure_demo_layers
            from ..weights.load import load_layer

            path = next(p for p in ensure_demo_layers(settings.cache_dir) if p.name == DEMO)
            return [load_layer(path, device)]
        cfg = SHAPES[layer]
        weights = random_layer(cfg, device, router=True, shared_intermediate=shared_intermediate)
        return [RandomLayer(layer, cfg, weights, device)]

    return load


class BareRequest(BaseModel):
    tokens: list[int]


class BareTiming(BaseModel):
    tokens: int
    median_us: float
    p90_us: float
    graphs: bool  # timed as a graph replay


def time_bare(served: ServedLayer, device: torch.device, tokens: list[int]) -> list[BareTiming]:
    """The served layer's forward alone, at each token count, on random device inputs."""
    cfg = served.config
    timer = Timer(device, _BARE_PLAN, flush_l2=False)
    generator = torch.Generator(device).manual_seed(1)
    timings = []
    with torch.inference_mode():
        for t in tokens:
            hidden = torch.randn(t, cfg.hidden_size, generator=generator, device=device)
            logits = None
            if not served.has_router:
                logits = torch.randn(t, cfg.num_experts, generator=generator, device=device)
            inputs = ForwardInputs(hidden.to(cfg.dtype), logits)
            graphs = served.graphs
            replay = graphs is not None and t <= graphs.max_tokens
            run = graphs.forward if replay else served.layer.forward
            timing = timer.measure(lambda run=run, inputs=inputs: run(inputs))
            timings.append(BareTiming(tokens=t, median_us=timing.median_us, p90_us=timing.p90_us,
                                      graphs=replay))  # fmt: skip
    return timings


class ForwardSize(BaseModel):
    tokens: int  # the batch's rows (before any graph bucket's padding)
    forwards: int
    seconds: float  # their device time in all


class ForwardSizes:
    """The forwards a server's metrics record, counted by batch size until taken."""

    def __init__(self, metrics: Metrics) -> None:
        self._lock = threading.Lock()
        self._by_tokens: dict[int, tuple[int, float]] = {}
        record = metrics.record_batch

        def record_batch(
            layer: str, backend: str, tokens: int, expert_tokens: torch.Tensor,
            times: StageTimes, queued_s: Sequence[float] = (),
        ) -> None:  # fmt: skip
            with self._lock:
                forwards, seconds = self._by_tokens.get(tokens, (0, 0.0))
                self._by_tokens[tokens] = (forwards + 1, seconds + times.forward_s)
            record(layer, backend, tokens, expert_tokens, times, queued_s)

        metrics.record_batch = record_batch  # type: ignore[method-assign]

    def take(self) -> list[ForwardSize]:
        with self._lock:
            taken, self._by_tokens = self._by_tokens, {}
        return [ForwardSize(tokens=t, forwards=n, seconds=s) for t, (n, s) in sorted(taken.items())]


bare_router = APIRouter(prefix="/bench", tags=["bench"])


class PathTiming(BaseModel):
    tokens: int
    level: str
    median_us: float
    p90_us: float


@bare_router.post("/path")
async def path(body: BareRequest, request: Request) -> list[PathTiming]:
    from .request_path import time_levels

    runtime = request.app.state.runtime
    return [PathTiming(**t) for t in await time_levels(runtime, body.tokens)]


@bare_router.post("/forwards")
async def forwards(request: Request) -> list[ForwardSize]:
    state = request.app.state
    if getattr(state, "forward_sizes", None) is None:  # counting starts with the first call
        state.forward_sizes = ForwardSizes(state.runtime.metrics)
    return state.forward_sizes.take()


class RecordedSpan(BaseModel):
    trace: str  # the request's trace id, hex
    name: str
    start_ns: int  # time.time_ns() clock
    end_ns: int


_recorded: InMemorySpanExporter | None = None  # with --spans


def record_spans() -> None:
    """Keep every span the service records from here on (before create_app: the app instruments
    itself when a tracer provider is installed)."""
    global _recorded
    _recorded = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_recorded))
    trace.set_tracer_provider(provider)


@bare_router.get("/spans")
async def spans() -> list[RecordedSpan]:
    if _recorded is None:
        return []
    finished = _recorded.get_finished_spans()
    _recorded.clear()
    return [
        RecordedSpan(trace=f"{s.context.trace_id:032x}", name=s.name, start_ns=s.start_time,
                     end_ns=s.end_time)
        for s in finished
    ]  # fmt: skip


@bare_router.post("/bare")
async def bare(body: BareRequest, request: Request) -> list[BareTiming]:
    engine = request.app.state.runtime.engine
    served = next(iter(engine.layers.values()))
    return await asyncio.to_thread(time_bare, served, served.device, body.tokens)


def build_settings(args: argparse.Namespace) -> Settings:
    return Settings(
        device=args.device,
        backend=args.backend,
        max_batch_tokens=args.max_batch_tokens,
        max_queue=args.max_queue,
        cuda_graphs=args.cuda_graphs,
        log_level=args.log_level,
        cache_dir=args.cache_dir,
        max_body_bytes=256 << 20,
        http_workers=args.http_workers,
        grpc_port=args.grpc_port,
        metrics_port=0,  # the benchmark scrapes /metrics on the HTTP port
        allow_shared_memory=args.allow_shared_memory,
    )


def build_app(
    settings: Settings, args: argparse.Namespace, front_ends: FrontEnds | None
) -> FastAPI:
    logs.configure(settings.log_level, settings.log_format)
    app = create_app(settings, layer_loader(args.layer, args.shared_intermediate), front_ends)
    app.include_router(bare_router)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", required=True, help=f"{DEMO} or one of {', '.join(SHAPES)}")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--shared-intermediate", type=int)
    parser.add_argument("--max-batch-tokens", type=int, default=1024)
    parser.add_argument("--max-queue", type=int, default=4096)
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--cache-dir", type=Path, default=Settings().cache_dir)
    parser.add_argument("--http-workers", type=int, default=0, help="front-end processes")
    parser.add_argument("--grpc-port", type=int, default=0, help="KServe gRPC; 0: off")
    parser.add_argument("--allow-shared-memory", action="store_true", help="Triton's extension")
    parser.add_argument("--http", default="auto", help="uvicorn's parser: auto, h11, httptools")
    parser.add_argument("--loop", default="auto", help="uvicorn's loop: auto, asyncio, uvloop")
    parser.add_argument("--spans", action="store_true", help="keep spans for GET /bench/spans")
    args = parser.parse_args(argv)
    if args.layer != DEMO and args.layer not in SHAPES:
        parser.error(f"unknown layer {args.layer!r}")
    settings = build_settings(args)
    if args.spans:
        record_spans()
    collect_less()  # as `moe-serve serve` does
    if args.http_workers:  # as `moe-serve serve --http-workers N` runs
        front_ends = FrontEnds(settings, listen("127.0.0.1", args.port))
        app = build_app(settings, args, front_ends)
        uvicorn.Server(server_config(app, settings, str(front_ends.http_path))).run()
        return 0
    app = build_app(settings, args, None)
    config = server_config(app, settings)  # as `moe-serve serve` runs it
    if (args.http, args.loop) != ("auto", "auto"):  # the benchmark's variant on another stack
        config = uvicorn.Config(app, http=args.http, loop=args.loop, log_config=None)
    uvicorn.Server(config).run(sockets=[listen("127.0.0.1", args.port)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
