"""`moe-serve bench auto-table RUN.json`: the rule table `--backend auto` follows
(`kernels/tuned/auto_<gpu>.json`, read by kernels/selection.py), from a kernel benchmark run.

One rule per layer shape of the run, keyed `<scheme>/<shape class>` (`selection.rule_key`):
each backend's median time at every token count of the uniform load, routing excluded (the
modular forward on fixed routing), as `moe-serve bench kernels` measured it after checking the
backend against the reference; the backends that failed or were wrong, never ranked; the order
(backends timed at every count, by geometric mean of their times); and, where both ran, the
token count from which DeepGEMM beats our Triton experts for good.

The composed backend is not ranked on its own measurement: `triton-or-deep-gemm` switches at
the count this table sets, so its row is derived, at each count, from the backend it would run
there.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from bench.environment import device_slug
from bench.schema import BenchRun, Point
from bench.shapes import SHAPES
from kernels.selection import rule_key
from kernels.tuned import TUNED_DIR

COMPOSED = frozenset({"triton-or-deep-gemm"})
LOAD = "uniform"  # the load the rules are measured under (random router logits)


def rank_backends(times_us: dict[str, dict[str, float]]) -> tuple[str, ...]:
    """Backends measured at every token count, by geometric mean of their times, fastest first
    (a tie, such as triton-or-deep-gemm running triton everywhere, goes by name)."""
    counts = list(times_us)
    common = set.intersection(*(set(times_us[m]) for m in counts)) if counts else set()

    def geomean(name: str) -> float:
        return math.exp(sum(math.log(times_us[m][name]) for m in counts) / len(counts))

    return tuple(sorted(common, key=lambda name: (geomean(name), name)))


def crossover_tokens(times_us: dict[str, dict[str, float]], fast: str, base: str) -> int | None:
    """The smallest measured token count from which `fast` beats `base` at every larger count."""
    counts = sorted((int(m) for m in times_us if {fast, base} <= set(times_us[m])), reverse=True)
    best = None
    for m in counts:
        if times_us[str(m)][fast] >= times_us[str(m)][base]:
            break
        best = m
    return best


def _rule(shape: str, points: list[Point]) -> dict:
    """One shape's rule from its uniform-load points."""
    times: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}  # backend -> why it was not ranked (its first failure)
    for point in sorted(points, key=lambda p: p.tokens):
        row = times.setdefault(str(point.tokens), {})
        for r in point.results:
            if r.backend in COMPOSED:
                continue
            if r.error is not None:
                failed.setdefault(r.backend, f"M={point.tokens}: {r.error}")
            elif not r.correct:
                failed.setdefault(r.backend, f"M={point.tokens}: relative error {r.rel_error:.3g}")
            elif r.routing_excluded is not None:
                row[r.backend] = r.routing_excluded.median_us
    body: dict = {"shape": shape, "times_us": times, "failed": failed}
    if all("deep-gemm" in row and "triton" in row for row in times.values()):
        threshold = crossover_tokens(times, "deep-gemm", "triton")
        body["deep_gemm_min_tokens"] = threshold
        for m, row in times.items():
            pick = "deep-gemm" if threshold is not None and int(m) >= threshold else "triton"
            row["triton-or-deep-gemm"] = row[pick]
    body["order"] = list(rank_backends(times))
    if not body["order"]:
        raise ValueError(f"shape {shape}: no backend was timed correctly at every token count")
    return body


def rule_table(run: BenchRun) -> dict:
    """The rule table of `run`'s shapes; ValueError when it cannot make one rule per key."""
    rules: dict[str, dict] = {}
    for shape in run.shapes:
        points = [p for p in run.points if p.shape == shape.name and p.load == LOAD]
        if not points:
            raise ValueError(f"shape {shape.name} has no {LOAD}-load points: run with that load")
        if shape.name not in SHAPES:
            raise ValueError(f"shape {shape.name} is not in bench/shapes.py")
        key = rule_key(SHAPES[shape.name])
        if key in rules:
            raise ValueError(f"shapes {rules[key]['shape']} and {shape.name} both measure {key}")
        rules[key] = _rule(shape.name, points)
    if not rules:
        raise ValueError("the run holds no shape")
    s = run.settings
    return {
        "device": run.environment.device,
        "commit": run.environment.commit,
        "method": (
            f"median of the modular forward (prepare, experts, finalize) on fixed routing, "
            f"{LOAD} load: CUDA events, L2 flushed, {s.warmup} warm-up calls, {s.min_iters}-"
            f"{s.max_iters} iterations, about {s.budget_s * 1e3:g} ms per point (bench/timing.py); "
            f"`moe-serve bench auto-table` of a `moe-serve bench kernels` run of "
            f"{run.environment.created}"
        ),
        "rules": rules,
    }


def summary(table: dict) -> str:
    """The table as markdown: per rule, the median times by token count and backend."""
    lines = [f"# {table['device']} at {table['commit']}: median us per forward"]
    for key, rule in table["rules"].items():
        backends = sorted({b for row in rule["times_us"].values() for b in row})
        lines += ["", f"## {key}: {rule['shape']} (order: {', '.join(rule['order'])})", ""]
        lines.append("| M | " + " | ".join(backends) + " |")
        lines.append("|---" * (len(backends) + 1) + "|")
        for m, row in rule["times_us"].items():
            cells = [f"{row[b]:.1f}" if b in row else "-" for b in backends]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += [f"- {b} not ranked: {why}" for b, why in rule["failed"].items()]
    return "\n".join(lines) + "\n"


def default_path(run: BenchRun) -> Path:
    """kernels/tuned/auto_<gpu>.json, e.g. auto_h100.json."""
    return TUNED_DIR / f"auto_{device_slug(run.environment)}.json"


def write_table(table: dict, path: Path) -> None:
    """The JSON at `path` and its markdown summary beside it (`.md`), each written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, text in (
        (path, json.dumps(table, indent=1) + "\n"),
        (path.with_suffix(".md"), summary(table)),
    ):
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
