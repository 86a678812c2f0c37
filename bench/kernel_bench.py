"""`moe-serve bench kernels`: every available backend on every shape, load and token count.

Per shape: weights are drawn on the device (bench.random_layer), router logits for each load
(bench.router_loads), hidden states for the largest token count; a point with M tokens takes the
first M rows, so the first `check_rows` rows are the same at every M and the reference backend's
output for them is computed once. Each backend is built once per shape; at every point its
output is checked against that reference *before* it is timed, then it is timed with routing
excluded and included and, where it can be captured, as served: the whole layer replayed from
a CUDA graph of exactly that many tokens (checked too); it is freed before the next backend is
built. `auto` among the backends: after the others, the layer `--backend auto` builds from the
rule these timings make (bench/auto_table.py), timed the same way; then, at each point, auto and
the member it runs there (built once more) are timed as served, interleaved member, auto, auto,
member, so that each is timed once first and once second of a pair: a layer timed right after
other heavy work runs slower, and auto, timed after every other backend, would otherwise be
compared with member rows timed in another state of the GPU. Auto's row records the median of
its two interleaved times and of its member's (`served_beside_us`, `member_beside_us`).

Reference rule: the `reference*` backends dequantise every hit expert to float32 on each call
(hundreds of milliseconds at full size), so they are timed only up to `reference_max_tokens`
tokens (64 by default). They still check every other backend at every token count.

Tolerance on the checked rows (relative L2 error against the float32 reference): the table in
kernels/accuracy.py, which the tests use too; fp8-tensor gets more, since its activation scale
depends on all M rows while the reference saw only the checked rows.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from ..kernels.accuracy import relative_error, tolerance
from ..kernels.config import MoEConfig
from ..kernels.layer import LayerWeights, MoELayer, build_layer
from ..kernels.layer_graphs import LayerGraphs, can_capture
from ..kernels.registry import experts_backends
from ..kernels.routing import route
from ..kernels.selection import Rule, RuleTable, rule_key, select
from ..kernels.tensors import ForwardInputs, Routing
from ..kernels.timing import Timer, TimingPlan
from . import ceilings as measured
from .auto_table import shape_rule
from .environment import capture
from .random_layer import random_layer
from .roofline import Ceilings, Work, bound, count_work
from .router_loads import Load, router_logits
from .schema import (
    AUTO_ROW,
    BackendResult,
    BenchRun,
    CeilingsResult,
    Environment,
    Point,
    Settings,
    ShapeResult,
    write_result,
)
from .shapes import SHAPES, precision

log = logging.getLogger(__name__)

REFERENCE_BACKENDS = frozenset({"reference", "reference-batched"})
# `--backends triton,triton+invariant`: the backend built batch-invariant, timed beside itself
INVARIANT = "+invariant"


def bench_name(layer: MoELayer) -> str:
    """The layer's backend as results name it: with INVARIANT when built batch-invariant."""
    return layer.kernel.experts.name + (INVARIANT if layer.batch_invariant else "")


@dataclass(frozen=True)
class KernelBenchConfig:
    shapes: tuple[str, ...]
    tokens: tuple[int, ...]
    device: torch.device
    backends: tuple[str, ...] | None = None  # None: every registered experts backend
    loads: tuple[Load, ...] = tuple(Load)
    reference_max_tokens: int = 64
    check_rows: int = 32
    plan: TimingPlan = field(default_factory=TimingPlan)
    seed: int = 0
    deadline_s: float | None = None  # points not reached by then are recorded as not timed

    def __post_init__(self) -> None:
        if not self.tokens or min(self.tokens) < 1:
            raise ValueError(f"token counts must be >= 1, got {self.tokens}")
        unknown = [s for s in self.shapes if s not in SHAPES]
        if unknown or not self.shapes:
            raise ValueError(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")

    def settings(self) -> Settings:
        return Settings(
            tokens=list(self.tokens),
            loads=[str(load) for load in self.loads],
            reference_max_tokens=self.reference_max_tokens,
            check_rows=self.check_rows,
            warmup=self.plan.warmup,
            min_iters=self.plan.min_iters,
            max_iters=self.plan.max_iters,
            budget_s=self.plan.budget_s,
        )


def measure_ceilings(
    config: KernelBenchConfig, timer: Timer
) -> tuple[CeilingsResult, dict[str, str]]:
    """Copy bandwidth and the GEMM peak of every precision the chosen shapes need, and why a
    peak could not be measured (fp8 before Ada, say): the shapes needing it are not run."""
    peaks, problems = {}, {}
    for name in sorted({precision(SHAPES[s]) for s in config.shapes}):
        try:
            peaks[name] = measured.gemm_peak(timer, config.device, name)
        except (RuntimeError, TypeError) as err:  # unsupported dtype or op on this device
            problems[name] = f"cannot measure the {name} GEMM peak here: {err}"
            log.error("%s", problems[name])
            continue
        log.info("%s GEMM peak: %.1f TFLOP/s", name, peaks[name] / 1e12)
    copy = measured.copy_bandwidth(timer, config.device)
    log.info("copy bandwidth: %.0f GB/s", copy / 1e9)
    return CeilingsResult(copy_bytes_per_s=copy, gemm_flops_per_s=peaks), problems


@dataclass(frozen=True)
class ShapeInputs:
    """Everything the points of one shape share; row r is the same at every token count."""

    hidden: torch.Tensor  # [max M, H] in the layer's dtype
    logits: dict[Load, torch.Tensor]  # [max M, E] float32
    routing: dict[Load, Routing]  # [max M, k]
    expected: dict[Load, torch.Tensor]  # reference output of the first check rows [R, H]

    def at(self, load: Load, m: int) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """(hidden [m, H], logits [m, E], routing [m, k]) of the point with m tokens."""
        r = self.routing[load]
        return self.hidden[:m], self.logits[load][:m], Routing(r.topk_ids[:m], r.topk_weights[:m])


def make_inputs(cfg: MoEConfig, weights: LayerWeights, config: KernelBenchConfig) -> ShapeInputs:
    device, max_m = config.device, max(config.tokens)
    generator = torch.Generator(device).manual_seed(config.seed + 1)
    hidden = torch.randn(max_m, cfg.hidden_size, generator=generator, device=device).to(cfg.dtype)
    logits, routing, expected = {}, {}, {}
    reference, _ = build_layer(cfg, weights, device, backend="reference")
    rows = min(config.check_rows, max_m)
    for i, load in enumerate(config.loads):
        logits[load] = router_logits(load, max_m, cfg.num_experts, config.seed + 2 + i, device)
        routing[load] = route(logits[load], cfg.routing, weights.router.correction_bias)
        r = routing[load]
        check = Routing(r.topk_ids[:rows], r.topk_weights[:rows])
        expected[load] = reference.kernel.forward(hidden[:rows], check)
    return ShapeInputs(hidden, logits, routing, expected)


@dataclass(frozen=True)
class Served:
    """A layer made ready to run as served at one token count."""

    forward: Callable[[], object]  # one served forward: the graph replay where captured
    output: torch.Tensor | None  # the replay's output; None where uncaptured
    not_captured: str = ""  # why uncaptured


def serve(layer: MoELayer, hidden: torch.Tensor, logits: torch.Tensor) -> Served:
    """The layer as served: captured in a CUDA graph of exactly hidden's rows and replayed, or
    its whole forward from the router logits where it cannot be captured."""
    uncaptured = partial(layer.forward, ForwardInputs(hidden, logits))
    support = can_capture(layer, hidden.device, hidden.shape[0])
    if not support:
        return Served(uncaptured, None, support.reason)
    m, with_logits = hidden.shape[0], layer.router.weight is None
    try:
        graphs = LayerGraphs(layer, hidden.device, m, with_logits)
        out = graphs.forward(ForwardInputs(hidden, logits if with_logits else None)).output
        return Served(partial(graphs.replay, m), out.output.clone())
    except Exception as err:  # a capture that fails is a result: the layer is served uncaptured
        log.warning("%s could not be captured at %d tokens: %s", layer.kernel.experts.name, m, err)
        return Served(uncaptured, None, f"capture failed: {type(err).__name__}: {err}")


def time_captured(
    layer: MoELayer, hidden: torch.Tensor, logits: torch.Tensor, timer: Timer
) -> tuple[torch.Tensor | None, dict]:
    """The layer as served, where it can be captured. Returns the replay's output (None where
    it cannot be captured) and BackendResult fields."""
    served = serve(layer, hidden, logits)
    if served.output is None:
        return None, {"not_captured": served.not_captured}
    return served.output, {"captured": timer.measure(served.forward)}


BESIDE_ORDER = ("member", "auto", "auto", "member") * 2  # each timed twice first, twice second


def time_beside(
    timer: Timer, auto: Callable[[], object], member: Callable[[], object]
) -> tuple[float, float]:
    """Median us of auto's and of its member's forward, each the median of its four timings in
    BESIDE_ORDER: the order of two timings shifts them (the GPU's clocks after the earlier
    work), so each is timed as often in either place; at a compute-bound point single timings
    of one forward spread by several percent, more than the 2% auto is judged by."""
    forwards = {"auto": auto, "member": member}
    times: dict[str, list[float]] = {"auto": [], "member": []}
    for who in BESIDE_ORDER:
        times[who].append(timer.measure(forwards[who]).median_us)
    return statistics.median(times["auto"]), statistics.median(times["member"])


def check_and_time(
    layer: MoELayer, inputs: ShapeInputs, load: Load, m: int, timer: Timer, name: str = ""
) -> BackendResult:
    """Check the backend against the reference, then time it (a wrong one too, marked wrong):
    uncaptured, then as served (captured where it can be; its replay is checked too).

    The checked output starts as NaN, so a row the backend never writes fails the check even
    where the allocator hands back memory that still holds an earlier, correct output.
    """
    hidden, logits, routing = inputs.at(load, m)
    name = name or bench_name(layer)
    expected = inputs.expected[load][:m]
    limit = tolerance(layer.cfg, checked_rows_of_larger_batch=True)

    def error(out: torch.Tensor) -> float:
        finite = torch.isfinite(out).all()
        return relative_error(out[: expected.shape[0]], expected) if finite else float("inf")

    err = error(layer.kernel.forward(hidden, routing, out=torch.full_like(hidden, float("nan"))))
    fields = {
        "routing_excluded": timer.measure(lambda: layer.kernel.forward(hidden, routing)),
        "routing_included": timer.measure(lambda: layer.forward(ForwardInputs(hidden, logits))),
    }
    replayed, captured = time_captured(layer, hidden, logits, timer)
    if replayed is not None:
        captured["captured_rel_error"] = error(replayed)
    ok = err <= limit and captured.get("captured_rel_error", 0.0) <= limit
    if not ok:
        log.warning("%s is wrong at %d tokens (%s): relative error %.3g, captured %s",
                    name, m, load, err, captured.get("captured_rel_error"))  # fmt: skip
    return BackendResult(backend=name, rel_error=err, correct=ok, **fields, **captured)


@dataclass(frozen=True)
class PointKey:
    shape: str
    load: Load
    tokens: int


def score_point(
    key: PointKey,
    work: Work,
    ceilings: Ceilings,
    results: list[BackendResult],
    auto: str | None,
) -> Point:
    """Roofline, fractions of the ceilings and ratios to the best correct backend (auto's own
    row is never the best: it runs one of the others). `auto`: auto's row, or the backend auto
    picks where the run has no such row (then it is its own member)."""
    limit = bound(work, ceilings)
    correct = [r for r in results if r.correct and r.backend != AUTO_ROW]
    timed = [r for r in correct if r.routing_excluded is not None]
    best = min(timed, key=lambda r: r.routing_excluded.median_us, default=None)
    served = [r for r in correct if r.served() is not None]
    best_served = min(served, key=lambda r: r.served().median_us, default=None)
    scored = []
    for r in results:
        if r.routing_excluded is not None:
            t = r.routing_excluded.median_us * 1e-6
            ratio = t / (best.routing_excluded.median_us * 1e-6) if best else None
            r = r.model_copy(
                update={
                    "achieved_fraction": limit.roofline_s / t,
                    "bandwidth_fraction": work.bytes / t / ceilings.copy_bytes_per_s,
                    "compute_fraction": work.flops / t / ceilings.gemm_flops_per_s,
                    "ratio_to_best": ratio,
                }
            )
        scored.append(r)
    auto_ratio = next((r.ratio_to_best for r in scored if r.backend == auto), None)
    auto_row = next((r for r in scored if r.backend == auto and r.served() is not None), None)
    auto_served_ratio = None
    if auto_row is not None and best_served is not None:
        auto_served_ratio = auto_row.served().median_us / best_served.served().median_us
    auto_beside_ratio, member = None, auto
    if auto == AUTO_ROW:
        row = next((r for r in scored if r.backend == AUTO_ROW), None)
        member = row.member if row else None
        if row and row.served_beside_us is not None and row.member_beside_us is not None:
            auto_beside_ratio = row.served_beside_us / row.member_beside_us
    member_row = next((r for r in served if r.backend == member), None)
    member_served_ratio = None
    if member_row is not None and best_served is not None:
        member_served_ratio = member_row.served().median_us / best_served.served().median_us
    return Point(
        shape=key.shape,
        load=str(key.load),
        tokens=key.tokens,
        experts_hit=work.experts_hit,
        bytes=work.bytes,
        flops=work.flops,
        memory_us=limit.memory_s * 1e6,
        compute_us=limit.compute_s * 1e6,
        roofline_us=limit.roofline_s * 1e6,
        bound_by=limit.bound_by,
        best=best.backend if best else None,
        auto_ratio=auto_ratio,
        best_served=best_served.backend if best_served else None,
        auto_served_ratio=auto_served_ratio,
        auto_beside_ratio=auto_beside_ratio,
        member_served_ratio=member_served_ratio,
        results=scored,
    )


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class KernelBench:
    """One run: the ceilings once, then shape after shape, saving the file after each shape."""

    def __init__(
        self, config: KernelBenchConfig, out: Path, env: Environment | None = None
    ) -> None:
        self.config = config
        self.out = out
        self.timer = Timer(config.device, config.plan)
        self.env = env or capture(config.device)
        self.backends = self._backends()  # unknown names fail here, before any measuring
        self.started = time.monotonic()

    def _backends(self) -> list[str]:
        known = experts_backends()
        wanted = self.config.backends or tuple(known)
        unknown = [b for b in wanted if b.removesuffix(INVARIANT) not in {*known, AUTO_ROW}]
        if unknown:
            raise ValueError(f"unknown backend(s) {unknown}; registered: {', '.join(known)}")
        return list(wanted)

    def _out_of_time(self) -> bool:
        deadline = self.config.deadline_s
        return deadline is not None and time.monotonic() - self.started > deadline

    def _time_backend(
        self,
        layer: MoELayer,
        inputs: ShapeInputs,
        results: dict[PointKey, list[BackendResult]],
        name: str = "",
        beside: Callable[[PointKey, BackendResult], BackendResult] | None = None,
    ) -> None:
        """Check and time the layer at every point; `beside` adds to each point's result."""
        name = name or bench_name(layer)
        for key in results:
            if (
                name.removesuffix(INVARIANT) in REFERENCE_BACKENDS
                and key.tokens > self.config.reference_max_tokens
            ):
                continue
            if self._out_of_time():
                error = "not timed: the run's time limit (--max-minutes) was reached"
                results[key].append(BackendResult(backend=name, error=error))
                continue
            try:
                point = check_and_time(layer, inputs, key.load, key.tokens, self.timer, name)
                results[key].append(point if beside is None else beside(key, point))
            except Exception as err:  # a failing backend is a result, not the end of the run
                log.warning("%s failed at %s: %s", name, key, err)
                results[key].append(
                    BackendResult(backend=name, error=f"{type(err).__name__}: {err}")
                )

    def _time_auto(
        self,
        name: str,
        cfg: MoEConfig,
        weights: LayerWeights,
        inputs: ShapeInputs,
        results: dict[PointKey, list[BackendResult]],
    ) -> tuple[str | None, str]:
        """Time the layer auto builds from this run's rule for the shape, as the row AUTO_ROW,
        and beside it at each point the member it runs there (`time_beside`): (the backend it
        built, why it could not be built)."""
        rows = {k.tokens: r for k, r in results.items() if k.load == Load.UNIFORM}
        if not rows:
            return None, "auto's rule comes from the uniform load: run with it"
        env, key = self.env, rule_key(cfg)
        try:
            rule = Rule.from_json(key, shape_rule(name, rows))
            table = RuleTable(env.device, env.commit, "this run", {key: rule})
            layer, selection = build_layer(cfg, weights, self.config.device, rules=table)
        except Exception as err:  # no rule, or no backend: recorded with its reason
            return None, f"{type(err).__name__}: {err}"
        log.info("%s: auto runs %s (%s)", name, selection.experts.name, selection.reason)
        built = selection.experts.name
        layers = {AUTO_ROW: layer}  # and each member auto runs, built once
        del layer

        def beside(point: PointKey, result: BackendResult) -> BackendResult:
            experts = layers[AUTO_ROW].kernel.experts
            # a registered backend runs itself at every size; auto's token switch, a member
            member = built if built in experts_backends() else experts.member(point.tokens).name
            hidden, logits, _ = inputs.at(point.load, point.tokens)
            try:
                if member not in layers:
                    layers[member], _ = build_layer(
                        cfg, weights, self.config.device, backend=member
                    )
                auto_us, member_us = time_beside(
                    self.timer,
                    serve(layers[AUTO_ROW], hidden, logits).forward,
                    serve(layers[member], hidden, logits).forward,
                )
            except Exception as err:  # auto's own row stands without the comparison
                log.warning("%s not timed beside auto at %s: %s", member, point, err)
                return result.model_copy(update={"member": member})
            update = {"member": member, "served_beside_us": auto_us, "member_beside_us": member_us}
            return result.model_copy(update=update)

        self._time_backend(layers[AUTO_ROW], inputs, results, AUTO_ROW, beside)
        layers.clear()
        _free_device_memory()
        return built, ""

    def bench_shape(self, name: str, ceilings: CeilingsResult) -> tuple[ShapeResult, list[Point]]:
        cfg, device = SHAPES[name], self.config.device
        weights = random_layer(cfg, device, self.config.seed)
        inputs = make_inputs(cfg, weights, self.config)
        keys = [PointKey(name, load, m) for load in self.config.loads for m in self.config.tokens]
        results: dict[PointKey, list[BackendResult]] = {key: [] for key in keys}
        not_run = {}
        backends = experts_backends()
        for backend in tqdm([b for b in self.backends if b != AUTO_ROW], desc=name, disable=None):
            base = backend.removesuffix(INVARIANT)
            invariant = base != backend
            support = backends[base].supports(cfg, device)
            if support and invariant:
                support = backends[base].batch_invariance(cfg)
            if not support:
                not_run[backend] = support.reason
                continue
            try:
                layer, _ = build_layer(
                    cfg, weights, device, backend=base, batch_invariant=invariant
                )
            except Exception as err:  # recorded with its reason, like an unsupported backend
                not_run[backend] = f"build failed: {type(err).__name__}: {err}"
                continue
            started = time.monotonic()
            self._time_backend(layer, inputs, results)
            log.info("%s: %s done in %.1f s", name, backend, time.monotonic() - started)
            del layer
            _free_device_memory()
        try:
            auto = select(cfg, device).experts.name
        except ValueError:
            auto = None
        ranked_by = auto
        if AUTO_ROW in self.backends:
            auto, why = self._time_auto(name, cfg, weights, inputs, results)
            ranked_by = AUTO_ROW
            if why:
                not_run[AUTO_ROW] = why
        limits = Ceilings(ceilings.copy_bytes_per_s, ceilings.gemm_flops_per_s[precision(cfg)])
        points = []
        for key in keys:
            _, _, routing = inputs.at(key.load, key.tokens)
            work = count_work(cfg, weights.experts, routing.topk_ids)
            points.append(score_point(key, work, limits, results[key], ranked_by))
        shape = ShapeResult(
            name=name,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            scheme=str(cfg.quant.scheme),
            activation=str(cfg.activation.kind),
            dtype=str(cfg.dtype).removeprefix("torch."),
            precision=precision(cfg),
            weight_bytes=weights.experts.nbytes(),
            auto=auto,
            not_run=not_run,
        )
        del weights, inputs
        _free_device_memory()
        return shape, points

    def run(self) -> BenchRun:
        with torch.inference_mode():  # as the service runs forwards
            return self._run()

    def _run(self) -> BenchRun:
        ceilings, problems = measure_ceilings(self.config, self.timer)
        result = BenchRun(
            environment=self.env,
            settings=self.config.settings(),
            ceilings=ceilings,
            shapes=[],
            points=[],
        )
        for name in self.config.shapes:
            why = problems.get(precision(SHAPES[name]))
            if why is None and self._out_of_time():
                why = "the run's time limit was reached"
            if why is None:
                try:
                    shape, points = self.bench_shape(name, ceilings)
                except Exception as err:  # e.g. out of memory drawing the weights: next shape
                    log.exception("shape %s failed", name)
                    why = f"failed: {type(err).__name__}: {err}"
                    _free_device_memory()
            if why is None:
                update = {"shapes": [*result.shapes, shape], "points": [*result.points, *points]}
            else:
                log.warning("shape %s not run: %s", name, why)
                update = {"shapes_not_run": result.shapes_not_run | {name: why}}
            result = result.model_copy(update=update)
            write_result(self.out, result)  # after each shape: a cut-off run keeps what it measured
        return result


def read_run(path: Path) -> BenchRun:
    return BenchRun.model_validate_json(path.read_text())
