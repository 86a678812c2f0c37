"""Where a served layer's forward goes, kernel by kernel, on one GPU: `moe-serve bench kernels
--mode profile`.

Draws a random layer of the shape with a stored router and, where the layer is DeepSeek-V3-like,
its 2048-wide shared expert (as `bench ep` and `bench service` draw it), builds it as
`serve --backend NAME` does, captures the whole layer in a CUDA graph at each token count (as
the service replays it: router, routing, experts, shared expert, the finite checks) and
replays it `replays` times under torch's profiler. For each M: the replay's median time on the
GPU (CUDA events, L2 not flushed: the service replays back to back), the sum of its kernels'
times, and DIR/profile-SHAPE-BACKEND-M{m}.txt, its kernels by total time, with a Chrome trace
and the median replay kernel by kernel (`.timeline.md`, bench/replay_timeline.py) beside it.
`--mode backends` times a layer without router and shared expert; this shows what a served
forward adds to the experts. `shared_in_line` runs the shared expert in the forward's own
stream instead of beside it (kernels/modular.py), to time the two side by side.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

import torch

from ..kernels.layer import build_layer
from ..kernels.layer_graphs import LayerGraphs
from ..kernels.tensors import ForwardInputs
from ..service.engine.profiling import kernel_profiler, trace_path, write_profile
from .random_layer import random_layer
from .replay_timeline import write_timeline
from .schema import Environment, write_result
from .shapes import SHAPES

log = logging.getLogger(__name__)

SHARED_INTERMEDIATE = 2048  # DeepSeek-V3's shared expert
WARMUP = 5


def replay_ms(graphs: LayerGraphs, m: int, replays: int) -> float:
    """Median time of one replay on the GPU, in ms."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(m)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile_point(graphs: LayerGraphs, m: int, replays: int, path: Path, header: str) -> float:
    """Profile `replays` replays at m tokens into path; returns the kernels' total us a replay."""
    with kernel_profiler(graphs.device) as prof:
        for _ in range(replays):
            graphs.replay(m)
        torch.cuda.synchronize()
    write_profile(prof, graphs.device, header, path)
    try:
        write_timeline(trace_path(path), replays, header)
    except ValueError as err:  # kernels outside the replays: the table and trace still stand
        log.warning("no timeline for %s: %s", path.name, err)
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / replays


def profile_layer(
    shape: str, backend: str, tokens: list[int], replays: int, shared_in_line: bool, out: Path
) -> dict:
    """One layer's replays at each token count, profiled into `out`: its run of the result."""
    device = torch.device("cuda", 0)
    cfg = SHAPES[shape]
    shared = SHARED_INTERMEDIATE if cfg.routing.num_groups > 1 else None
    weights = random_layer(cfg, device, router=True, shared_intermediate=shared)
    layer, _ = build_layer(cfg, weights, device, backend, chunk_tokens=max(tokens))
    if shared_in_line:
        layer.side_stream = None
    graphs = LayerGraphs(layer, device, max(tokens), with_logits=False)
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(max(tokens), cfg.hidden_size, generator=generator, device=device)
    rows = []
    for m in sorted(tokens):
        graphs.forward(ForwardInputs(hidden[:m].to(cfg.dtype)))  # copies in, captures, replays
        for _ in range(WARMUP):
            graphs.replay(m)
        median = replay_ms(graphs, m, replays)
        name = f"profile-{shape}-{backend}-M{m}.txt"
        header = f"{replays} replays of the whole {shape} layer ({backend}), M={m}"
        kernels_us = profile_point(graphs, m, replays, out / name, header)
        rows.append({"tokens": m, "replay_ms": median, "kernels_us": kernels_us, "profile": name})
        log.info("M=%d: replay %.1f us, its kernels %.1f us (%s)", m, median * 1e3, kernels_us,
                 name)  # fmt: skip
    shared_where = "in line" if layer.side_stream is None else "side stream"
    return {"shape": shape, "backend": backend, "shared": shared_where, "points": rows}


def render(result: dict) -> str:
    env = Environment.model_validate(result["environment"])
    lines = [
        f"# The whole layer as served, replayed: {env.device}, commit {env.commit}",
        "",
        "| shape | backend | shared expert | M | replay us | its kernels us |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['shape']} | {r['backend']} | {r['shared']} | {p['tokens']} "
        f"| {p['replay_ms'] * 1e3:,.1f} | {p['kernels_us']:,.1f} |"
        for r in result["runs"]
        for p in r["points"]
    ]
    return "\n".join(lines) + "\n"


def run(
    shapes: list[str],
    backends: list[str],
    tokens: list[int],
    replays: int,
    shared_in_line: bool,
    env: Environment,
    path: Path,
) -> dict:
    """Each shape with each backend; writes `path` and its .md, the profiles in a folder beside."""
    if not torch.cuda.is_available():
        raise ValueError("the layer profile needs a CUDA GPU: it profiles a captured forward")
    out = path.with_suffix("")
    out.mkdir(parents=True, exist_ok=True)
    runs = [
        profile_layer(shape, backend, tokens, replays, shared_in_line, out)
        for shape in shapes
        for backend in backends
    ]
    result = {"environment": env.model_dump(), "runs": runs}
    write_result(path, result, render(result))
    return result
