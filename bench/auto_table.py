"""`moe-serve bench tune --mode rules --from RUN.json`: the rule table `--backend auto` follows
(`kernels/tuned/auto_<gpu>.json`, read by kernels/selection.py), from a kernel benchmark run.

One rule per layer shape of the run, keyed `<scheme>/<shape class>` (`selection.rule_key`), from
the uniform load's points, each backend checked against the reference first (the backends that
failed or were wrong are never ranked):
- `served_us`: each backend's median time as the service runs it, at every token count: the
  whole-layer forward replayed from a CUDA graph where the backend captures (`captured` names
  those), uncaptured where it cannot; `fastest`: the fastest there per count; `plan`: what auto
  runs, per token count (`rules.token_plan`: the backend closest to the fastest alone, or
  a pair switching once where that lowers the worst ratio to the fastest by more than 1%);
- `times_us`: the modular forward uncaptured on fixed routing, its `order` (backends timed at
  every count, by geometric mean) and, where both ran, the token count from which DeepGEMM
  beats our Triton experts for good (`triton-or-deep-gemm` switches there).

The composed backend is not ranked on its own measurement: `triton-or-deep-gemm` switches at
the count this table sets, so its `times_us` row is derived, at each count, from the backend it
would run there; it is never part of a plan (its members are). Nor is auto's own row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..kernels.registry import experts_backends
from ..kernels.rules import COMPOSED, make_rule, plan_text
from ..kernels.selection import rule_key
from ..kernels.tuned import PROVENANCE, TUNED_DIR
from .schema import AUTO_ROW, BackendResult, BenchRun, gpu_name
from .shapes import SHAPES

LOAD = "uniform"  # the load the rules are measured under (random router logits)


def _served(
    rows: dict[int, list[BackendResult]], failed: dict[str, str]
) -> tuple[dict[str, dict[str, float]], set[str]]:
    """Served medians by tokens and backend, and the backends captured. A backend captured at
    some count but not at another is not served there (its times would mix modes)."""
    known = experts_backends()  # not NAME+invariant: auto runs the default builds
    results = [
        (m, r) for m, row in rows.items() for r in row
        if r.correct and r.served() and r.backend in known
    ]  # fmt: skip
    captured = {r.backend for _, r in results if r.captured is not None}
    served: dict[str, dict[str, float]] = {str(m): {} for m in rows}
    for m, r in results:
        if r.backend in captured and r.captured is None:
            failed.setdefault(r.backend, f"M={m}: not captured: {r.not_captured}")
        else:
            served[str(m)][r.backend] = r.served().median_us
    return served, captured


def shape_rule(shape: str, rows: dict[int, list[BackendResult]]) -> dict:
    """One shape's rule from its uniform-load results, by token count."""
    times: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}  # backend -> why it was not ranked (its first failure)
    rows = {m: [r for r in rows[m] if r.backend not in COMPOSED | {AUTO_ROW}] for m in sorted(rows)}
    for tokens, results in rows.items():
        row = times.setdefault(str(tokens), {})
        for r in results:
            if r.error is not None:
                failed.setdefault(r.backend, f"M={tokens}: {r.error}")
            elif not r.correct:
                error = r.rel_error if r.captured_rel_error is None else r.captured_rel_error
                failed.setdefault(r.backend, f"M={tokens}: relative error {error:.3g}")
            elif r.routing_excluded is not None:
                row[r.backend] = r.routing_excluded.median_us
    served, captured = _served(rows, failed)
    body = {"shape": shape, **make_rule(served, frozenset(captured), times), "failed": failed}
    if not body["order"]:
        raise ValueError(f"shape {shape}: no backend was timed correctly at every token count")
    return body


def kernels_command(run: BenchRun) -> str:
    """The `moe-serve bench kernels` command of `run`, with the settings the run records."""
    s = run.settings
    return (
        f"moe-serve bench kernels --shapes {','.join(shape.name for shape in run.shapes)} "
        f"--tokens {','.join(map(str, s.tokens))} --loads {','.join(s.loads)} "
        f"--reference-max-tokens {s.reference_max_tokens} --check-rows {s.check_rows} "
        f"--warmup {s.warmup} --min-iters {s.min_iters} --max-iters {s.max_iters} "
        f"--budget-ms {s.budget_s * 1e3:g}"
    )


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
        rules[key] = shape_rule(shape.name, {p.tokens: p.results for p in points})
    if not rules:
        raise ValueError("the run holds no shape")
    s = run.settings
    return {
        "device": run.environment.device,
        "commit": run.environment.commit,
        "date": run.environment.created[:10],
        "command": kernels_command(run),
        "method": (
            f"medians, {LOAD} load: served_us of the whole-layer forward from router logits, "
            f"replayed from a CUDA graph of that many tokens for the backends in `captured`, "
            f"uncaptured for the others; times_us of the modular forward (prepare, experts, "
            f"finalize) on fixed routing, uncaptured. CUDA events, L2 flushed, {s.warmup} "
            f"warm-up calls, {s.min_iters}-{s.max_iters} iterations, about "
            f"{s.budget_s * 1e3:g} ms per point (kernels/timing.py); `moe-serve bench tune --mode "
            f"rules` of a `moe-serve bench kernels` run of {run.environment.created}"
        ),
        "rules": rules,
    }


def merged(table: dict, existing: dict) -> dict:
    """`existing` (a table on disk) with `table`'s rules in place of its rules of the same keys,
    the others kept; each rule names the run it was measured in (`commit`, `date`, `command`)."""
    if existing["device"] != table["device"]:
        raise ValueError(
            f"the table holds rules measured on {existing['device']}, the run {table['device']}"
        )

    def measured(body: dict) -> dict:
        return {name: body[name] for name in PROVENANCE if name in body}

    rules = {key: measured(existing) | rule for key, rule in existing["rules"].items()}
    rules |= {key: rule | measured(table) for key, rule in table["rules"].items()}
    return existing | {"rules": rules}


def _times(rows: dict[str, dict[str, float]], marked: frozenset[str] = frozenset()) -> list[str]:
    """A markdown table of median us by token count and backend (`marked` names get a `*`)."""
    backends = sorted({b for row in rows.values() for b in row})
    lines = ["| M | " + " | ".join(b + "*" * (b in marked) for b in backends) + " |"]
    lines.append("|---" * (len(backends) + 1) + "|")
    for m, row in rows.items():
        cells = [f"{row[b]:.1f}" if b in row else "-" for b in backends]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _plan_ratios(rule: dict) -> str:
    """Per count, the served time of the backend the plan runs there over the fastest: computed
    from the table's timings, not auto's own (`bench kernels --backends ...,auto` times that)."""
    ratios = []
    for m, row in rule["served_us"].items():
        name = [n for start, n in rule["plan"] if start <= int(m)][-1]
        ratios.append(f"M={m} {row[name] / min(row.values()):.3f}")
    what = "the served time of the backend it runs over the fastest (computed from the times"
    return f"{what} below, auto not timed): {', '.join(ratios)}"


def summary(table: dict) -> str:
    """The table as markdown: per rule, auto's plan, the served and the modular median times."""
    lines = [f"# {table['device']} at {table['commit']}: median us per forward"]
    for key, rule in table["rules"].items():
        lines += ["", f"## {key}: {rule['shape']} (order: {', '.join(rule['order'])})", ""]
        if "commit" in rule:
            lines += [f"Measured at commit {rule['commit']}.", ""]
        if rule.get("plan"):
            lines += [f"Auto runs {plan_text(rule['plan'])}; {_plan_ratios(rule)}.", ""]
            lines += ["Served, whole layer (* replayed from a CUDA graph):"]
            lines += ["", *_times(rule["served_us"], frozenset(rule["captured"])), ""]
            if "times_us" in rule:
                lines += ["Modular forward, fixed routing, uncaptured:", ""]
        if "times_us" in rule:  # a calibrated rule times the layer as served only
            lines += _times(rule["times_us"])
        lines += [f"- {b} not ranked: {why}" for b, why in rule["failed"].items()]
    return "\n".join(lines) + "\n"


def default_path(run: BenchRun) -> Path:
    """kernels/tuned/auto_<gpu>.json, e.g. auto_h100.json."""
    return TUNED_DIR / f"auto_{gpu_name(run.environment.device)}.json"


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
