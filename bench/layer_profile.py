"""Where a served layer's forward goes, kernel by kernel, on one GPU.

    python3 -m bench.layer_profile --out OUT [--shape deepseek-v3] [--tokens 1,64,4096]
        [--backend triton] [--replays 20] [--shared-in-line]

Draws a random layer of the shape with a stored router and, where the layer is DeepSeek-V3-like,
its 2048-wide shared expert (as `bench.ep_service` and `bench service` draw it), builds it as
`serve --backend NAME` does, captures the whole layer in a CUDA graph at each token count (as
the service replays it: router, routing, experts, shared expert, the finite checks) and
replays it REPLAYS times under torch's profiler. For each M: the replay's median time on the
GPU (CUDA events, L2 not flushed: the service replays back to back), the sum of its kernels'
times, and OUT/profile-SHAPE-BACKEND-M{m}.txt, its kernels by total time, with a Chrome trace
and the median replay kernel by kernel (`.timeline.md`, bench/replay_timeline.py) beside it.
The kernel bench (`moe-serve bench kernels`) times a layer without router and shared expert;
this one shows what a served forward adds to the experts. --shared-in-line runs the
shared expert in the forward's own stream instead of beside it (kernels/modular.py), to time
the two side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from ..kernels.layer import build_layer
from ..kernels.layer_graphs import LayerGraphs
from ..kernels.tensors import ForwardInputs
from ..service.engine.profiling import kernel_profiler, trace_path, write_profile
from .random_layer import random_layer
from .replay_timeline import write_timeline
from .shapes import SHAPES

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
        sys.stdout.write(f"no timeline for {path.name}: {err}\n")
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / replays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.layer_profile", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="deepseek-v3", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="1,64,4096")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--shared-in-line", action="store_true", help="no side stream")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the profile is of a captured forward's kernels")
    tokens = sorted(int(t) for t in args.tokens.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    cfg = SHAPES[args.shape]
    shared = SHARED_INTERMEDIATE if cfg.routing.num_groups > 1 else None
    weights = random_layer(cfg, device, router=True, shared_intermediate=shared)
    layer, _ = build_layer(cfg, weights, device, args.backend, chunk_tokens=max(tokens))
    if args.shared_in_line:
        layer.side_stream = None
    graphs = LayerGraphs(layer, device, max(tokens), with_logits=False)
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(max(tokens), cfg.hidden_size, generator=generator, device=device)
    rows = []
    for m in tokens:
        graphs.forward(ForwardInputs(hidden[:m].to(cfg.dtype)))  # copies in, captures, replays
        for _ in range(WARMUP):
            graphs.replay(m)
        median = replay_ms(graphs, m, args.replays)
        name = f"profile-{args.shape}-{args.backend}-M{m}.txt"
        header = f"{args.replays} replays of the whole {args.shape} layer ({args.backend}), M={m}"
        kernels_us = profile_point(graphs, m, args.replays, args.out / name, header)
        rows.append({"tokens": m, "replay_ms": median, "kernels_us": kernels_us, "profile": name})
        sys.stdout.write(
            f"M={m}: replay {median * 1e3:.1f} us, its kernels {kernels_us:.1f} us ({name})\n"
        )
    report = {
        "shape": args.shape,
        "backend": args.backend,
        "shared": "in line" if layer.side_stream is None else "side stream",
        "device": torch.cuda.get_device_name(),
    }
    (args.out / "layer_profile.json").write_text(json.dumps(report | {"points": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
