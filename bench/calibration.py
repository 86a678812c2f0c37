"""`moe-serve bench tune --mode calibrate`: the service's self-calibration (kernels/calibrate.py)
on random layers of the named shapes, as `serve --calibrate always` runs it at start-up, with
the time it took and its rules beside this GPU's tuned table.

Per shape: the layer drawn on the GPU (clients send router logits, as in the kernel benchmark
the tuned tables come from), calibrated at the graph buckets of `--max-batch-tokens`; then the
calibrated rule as markdown (bench/auto_table.py `summary`) and, where the tuned table has a rule
for the layer, both plans side by side: at each token count the tuned rule measured, the served
time of the backend the calibrated plan runs there over that of the backend the tuned plan runs
(from the tuned table's times; 1.000: the same choice), and the same at the calibration's buckets
from its own times.
"""

from __future__ import annotations

import logging
import time

import torch

from ..kernels.calibrate import calibrate
from ..kernels.rules import plan_text
from ..kernels.selection import Rule, rule_for, rule_key
from .auto_table import summary
from .random_layer import random_layer
from .shapes import SHAPES

log = logging.getLogger(__name__)


def runs_at(plan: list | tuple, tokens: int) -> str:
    """The backend a plan runs at `tokens`."""
    return [name for start, name in plan if start <= tokens][-1]


def ratios(served_us: dict[str, dict[str, float]], plan: list, against: list | tuple) -> list[str]:
    """Per count, the time of `plan`'s backend over `against`'s, where both were timed."""
    cells = []
    for m, row in served_us.items():
        mine, theirs = runs_at(plan, int(m)), runs_at(against, int(m))
        if mine in row and theirs in row:
            cells.append(f"M={m} {row[mine] / row[theirs]:.3f}")
        else:
            cells.append(f"M={m} -")
    return cells


def compare(body: dict, tuned: Rule, source: str) -> list[str]:
    """The calibrated plan beside the tuned rule's, as markdown lines."""
    tuned_plan = [list(step) for step in tuned.plan]
    return [
        f"Tuned ({source}): {plan_text(tuned_plan)}.",
        "",
        "Calibrated plan's served time over the tuned plan's, by the tuned table's times: "
        + ", ".join(ratios(tuned.served_us, body["plan"], tuned_plan)),
        "",
        "The same by the calibration's times: "
        + ", ".join(ratios(body["served_us"], body["plan"], tuned_plan)),
    ]


def calibrate_shapes(
    shapes: list[str], max_batch_tokens: int, budget_s: float, device: torch.device
) -> str:
    """Calibrate each shape on `device`; the markdown report."""
    lines = [f"# Self-calibration on {torch.cuda.get_device_name(device)}"]
    for name in shapes:
        cfg = SHAPES[name]
        weights = random_layer(cfg, device)
        started = time.perf_counter()
        table, measured = calibrate(cfg, weights, device, max_batch_tokens, budget_s=budget_s)
        seconds = time.perf_counter() - started
        del weights
        torch.cuda.empty_cache()
        key = rule_key(cfg)
        body = table["rules"][key] | {"shape": name}
        log.info("%s: calibrated in %.1f s: %s", name, seconds, plan_text(body["plan"]))
        stopped = f"; {measured.stopped}" if measured.stopped else ""
        lines += [
            "",
            f"## {name} ({key}): calibrated in {seconds:.1f} s (budget {budget_s:g} s{stopped})",
            "",
            f"Calibrated: {plan_text(body['plan']) or 'no backend timed at every bucket'}.",
            "",
        ]
        tuned, tuned_table = rule_for(cfg, device)
        if tuned is not None and tuned.plan:
            lines += [*compare(body, tuned, f"{tuned_table.source} at {tuned_table.commit}"), ""]
        else:
            lines += ["No tuned rule for this layer on this GPU.", ""]
        lines.append(summary(table | {"rules": {key: body}}).split("\n", 1)[1].strip())
    return "\n".join(lines) + "\n"
