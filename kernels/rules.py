"""How a rule of `--backend auto` is made from measured times: the one decision behind the
tuned rule tables (`moe-serve bench tune --mode rules`, bench/auto_table.py) and the service's
self-calibration (kernels/calibrate.py). kernels/selection.py reads the rules.

A rule's body, as `kernels/tuned/auto_<gpu>.json` holds it under `rules`:
- `served_us`: tokens -> backend -> median us of the whole-layer forward as served (replayed
  from a CUDA graph for the backends in `captured`, uncaptured for the others);
- `plan`: what auto runs, per token count (`token_plan`); `fastest`: the fastest per count;
- `times_us` (the kernel benchmark's): the modular forward uncaptured on fixed routing;
- `order`: the backends timed at every count by geometric mean (of `times_us`, else of
  `served_us`), and `deep_gemm_min_tokens`, the count from which DeepGEMM beats our Triton
  experts for good, where both were timed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import permutations

from .experts.token_switch import TritonOrDeepGemmExperts
from .registry import experts_backends
from .tensors import Format

# switches by token count itself (its threshold from this table): never a member of a plan
COMPOSED = frozenset({TritonOrDeepGemmExperts.name})
# A pair of backends replaces the best one alone only where it lowers the worst ratio to the
# fastest by more than this. Auto's target is 2% (bench/targets.py AUTO_SLACK), and `moe-serve
# bench kernels` times the same layer up to a percent or two apart within one run: a plan 1% off
# leaves the rest for that noise. A smaller gain is within the noise and not worth a second
# member's weight memory (a switch holds its larger).
SWITCH_MARGIN = 1.01

Plan = tuple[tuple[int, str], ...]  # (from this many tokens, backend), ascending, from 1


def plan_text(plan: Sequence[Sequence]) -> str:
    """A plan as reasons spell it: "triton from M=1, deep-gemm from M=512"."""
    return ", ".join(f"{name} from M={m}" for m, name in plan)


def token_plan(
    served_us: dict[str, dict[str, float]],
    candidates: list[str],
    captured: frozenset[str],
    composable: frozenset[str],
) -> Plan:
    """What auto runs, from served times: () when no candidate was timed at every count.

    Options are each candidate alone and each ordered pair of `composable` (standard-format)
    ones that both capture or both do not (a layer's CUDA graphs hold the whole layer or none of
    it), the first member below a measured count and the second from it: one switch, as the
    times cross once, so that close times alternating between counts (noise) add none. An
    option's ratio at a count is its time over the fastest of every backend timed there; the
    best option of a kind has the smallest worst ratio, then the smallest geometric mean. The
    best pair runs where its worst ratio is lower than the best single backend's by more than
    SWITCH_MARGIN, else that backend alone.
    """
    counts = sorted(served_us, key=int)
    timed = sorted(n for n in candidates if counts and all(n in served_us[m] for m in counts))
    if not timed:
        return ()
    fastest = {m: min(served_us[m].values()) for m in counts}

    def score(picks: tuple[str, ...]) -> tuple[float, float, tuple[str, ...]]:
        ratios = [served_us[m][n] / fastest[m] for m, n in zip(counts, picks, strict=True)]
        return max(ratios), math.exp(sum(map(math.log, ratios)) / len(ratios)), picks

    pairable = [n for n in timed if n in composable]
    pairs = [
        (a,) * below + (b,) * (len(counts) - below)
        for a, b in permutations(pairable, 2)
        if (a in captured) == (b in captured)
        for below in range(1, len(counts))
    ]
    worst, _, picks = min(score((n,) * len(counts)) for n in timed)
    if pairs and (pair := min(map(score, pairs)))[0] * SWITCH_MARGIN < worst:
        picks = pair[2]
    steps = [(1, picks[0])]  # below the smallest count measured: its backend
    steps += [
        (int(m), n)
        for m, n, before in zip(counts[1:], picks[1:], picks[:-1], strict=True)
        if n != before
    ]
    return tuple(steps)


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


def make_rule(
    served_us: dict[str, dict[str, float]],
    captured: frozenset[str],
    times_us: dict[str, dict[str, float]] | None = None,
) -> dict:
    """A rule's body from each backend's median times (composed backends left out).

    `times_us` (the kernel benchmark's modular forward): it ranks the backends, and gets a
    `triton-or-deep-gemm` row derived at each count from the backend that runs there; without
    it (the service's calibration, which times the layer as served only) `served_us` ranks them.
    """
    backends = experts_backends()
    standard = frozenset(n for n, cls in backends.items() if cls.format == Format.STANDARD)
    timed = sorted({n for row in served_us.values() for n in row} - COMPOSED)
    plan = token_plan(served_us, timed, captured, standard)
    body: dict = {
        "plan": [list(step) for step in plan],
        "fastest": {m: min(row, key=row.get) for m, row in served_us.items() if row},
        "served_us": served_us,
        "captured": sorted(captured),
    }
    ranked = served_us if times_us is None else times_us
    if times_us is not None:
        body["times_us"] = times_us
    if ranked and all("deep-gemm" in row and "triton" in row for row in ranked.values()):
        threshold = crossover_tokens(ranked, "deep-gemm", "triton")
        body["deep_gemm_min_tokens"] = threshold
        for m, row in (times_us or {}).items():
            pick = "deep-gemm" if threshold is not None and int(m) >= threshold else "triton"
            row["triton-or-deep-gemm"] = row[pick]
    body["order"] = list(rank_backends(ranked))
    return body
