"""Benchmark results as pydantic models: this module is their documentation.

Every stored result, of any benchmark, is one JSON object with an `environment` (`Environment`:
the GPU, the commit measured, when, and the command that makes the run), stored as
bench/results/<gpu>/<bench>-<date>-<commit>.json (`result_path`); `moe-serve bench report` reads
them all. The rest of this module is the kernel benchmark's result (`BenchRun`).

One JSON file holds one run: where it ran, the ceilings measured there, the layer shapes, and
one `Point` per (shape, load, tokens) with every backend's times. Times are microseconds of one
full layer forward; `routing_excluded` times `ModularKernel.forward(hidden, routing)` with the
routing computed beforehand, `routing_included` times `MoELayer.forward` from router logits.
Derived figures (`achieved_fraction`, `ratio_to_best`, ...) are computed from the
routing-excluded median, the figure the roofline bounds.

Served mode, as the service runs a layer: `captured` times the whole-layer forward (routing from
the router logits, experts) replayed from a CUDA graph of exactly that many tokens
(kernels/layer_graphs.py), for backends that can be captured; the others are served uncaptured,
so their served time is `routing_included` and `not_captured` says why. `auto`'s rule table
ranks backends by served time (bench/auto_table.py). The row `auto` (`--backends ...,auto`) is
the layer `--backend auto` builds from the rule this run's uniform-load timings make for the
shape, timed as built; the shape's `auto` names what it built. Auto's row names the `member` it
runs at the point and holds `served_beside_us` and `member_beside_us`: auto and that member
timed as served, interleaved (member, auto, auto, member, twice; the median of each's four),
the comparison `auto_beside_ratio` judges auto by, since the member rows are timed apart from
auto's.
Results without these fields (older runs) are read with them absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..kernels.timing import Timing

SCHEMA_VERSION = 1
AUTO_ROW = "auto"  # the backend name of auto's own row


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Environment(_Model):
    """Where a result comes from: every stored result (of any benchmark) holds one, as its
    `environment`; bench/results/<gpu>/<bench>-<date>-<commit>.json names it (`result_path`)."""

    device: str  # the GPU, e.g. "NVIDIA H100 80GB HBM3", or "cpu"
    device_type: Literal["cuda", "cpu"]
    gpus: int = 1  # GPUs the run used (expert parallelism: its N)
    commit: str  # git commit of the code measured ("-dirty" when the tree had changes)
    created: str  # ISO 8601 UTC; its date names the file
    command: str | None = None  # the `moe-serve bench ...` command that makes this run
    # the software stack; None where the run did not record it (or, driver and cuda, on a CPU)
    driver: str | None = None  # NVIDIA driver version
    torch: str | None = None
    cuda: str | None = None  # CUDA runtime torch was built with
    triton: str | None = None
    python: str | None = None

    def date(self) -> str:
        return self.created[:10]


def gpu_name(device: str) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "h100": a result's folder under bench/results."""
    words = device.lower().replace("nvidia", "").split()
    return words[0] if words else "device"


def write_result(path: Path, result: BaseModel | dict, markdown: str | None = None) -> None:
    """The result as JSON at `path` (and `markdown` beside it as .md), each written atomically,
    so that a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (
        result.model_dump_json(indent=1)
        if isinstance(result, BaseModel)
        else json.dumps(result, indent=1)
    )
    files = [(path, text + "\n")] + ([(path.with_suffix(".md"), markdown)] if markdown else [])
    for target, content in files:
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(content)
        os.replace(tmp, target)


def result_path(results: Path, env: Environment, bench: str, suffix: str = ".json") -> Path:
    """results/<gpu>/<bench>-<date>-<commit>.json: where a run of `bench` is stored."""
    return results / gpu_name(env.device) / f"{bench}-{env.date()}-{env.commit}{suffix}"


class Settings(_Model):
    tokens: list[int]
    loads: list[str]
    reference_max_tokens: int  # the reference backends run only up to this many tokens
    check_rows: int  # rows of each output compared with the reference backend
    warmup: int
    min_iters: int
    max_iters: int
    budget_s: float  # timed work aimed for per backend and point


class CeilingsResult(_Model):
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written per second
    gemm_flops_per_s: dict[str, float]  # precision ("bf16", "fp8", ...) -> dense GEMM FLOP/s


class ShapeResult(_Model):
    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    scheme: str
    activation: str
    dtype: str
    precision: str  # key into CeilingsResult.gemm_flops_per_s
    weight_bytes: int  # all experts' weights, scales and biases
    auto: str | None  # the backend `auto` picks (with an AUTO_ROW: the one it built) here
    not_run: dict[str, str] = Field(default_factory=dict)  # backend -> why it was not timed


class BackendResult(_Model):
    backend: str
    routing_excluded: Timing | None = None
    routing_included: Timing | None = None
    rel_error: float | None = None  # ||out - reference|| / ||reference|| on the checked rows
    correct: bool = False  # rel_error within the scheme's tolerance (see bench.kernel_bench)
    error: str | None = None  # why this backend failed at this point
    captured: Timing | None = None  # the whole-layer forward replayed from a CUDA graph
    captured_rel_error: float | None = None  # the replay's rel_error (in `correct` too)
    not_captured: str | None = None  # why `captured` is None (the backend syncs, CPU, ...)
    achieved_fraction: float | None = None  # roofline time / median
    bandwidth_fraction: float | None = None  # (bytes / median) / copy bandwidth
    compute_fraction: float | None = None  # (flops / median) / GEMM peak
    ratio_to_best: float | None = None  # median / best correct backend's median (>= 1)
    member: str | None = None  # auto's row: the backend it runs at this point
    served_beside_us: float | None = None  # auto's row: its served median, timed beside member
    member_beside_us: float | None = None  # auto's row: member's served median, timed beside it

    def served(self) -> Timing | None:
        """The whole-layer forward as served: captured where the backend captures."""
        return self.captured or self.routing_included


class Point(_Model):
    shape: str
    load: str  # "uniform" or "skewed", see bench.router_loads
    tokens: int
    experts_hit: int
    bytes: int  # that must move, see bench.roofline
    flops: int
    memory_us: float  # bytes / copy bandwidth
    compute_us: float  # flops / GEMM peak of the shape's precision
    roofline_us: float  # max of the two
    bound_by: Literal["memory", "compute"]
    best: str | None  # fastest correct backend
    auto_ratio: float | None  # auto's backend median / best median, when auto's ran here
    best_served: str | None = None  # fastest correct backend as served (BackendResult.served)
    auto_served_ratio: float | None = None  # auto's served median / best_served's
    auto_beside_ratio: float | None = None  # auto's served_beside_us / its member_beside_us
    # the served median of the member auto runs here (its own row) / best_served's
    member_served_ratio: float | None = None
    results: list[BackendResult]


class BenchRun(_Model):
    schema_version: Literal[1] = SCHEMA_VERSION
    environment: Environment
    settings: Settings
    ceilings: CeilingsResult
    shapes: list[ShapeResult]
    points: list[Point]
    shapes_not_run: dict[str, str] = Field(default_factory=dict)  # shape -> why (time limit)
