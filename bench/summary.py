"""`moe-serve bench report --mode summary FILE`: a kernel run as markdown tables."""

from __future__ import annotations

from collections.abc import Callable

from .schema import AUTO_ROW, BenchRun, Point
from .targets import EXTERNAL_PREFIXES, OUR_TRITON, check_targets


def _cell(point: Point, backend: str) -> str:
    r = next((r for r in point.results if r.backend == backend), None)
    if r is None:
        return ""
    if r.routing_excluded is None:
        return "failed" if r.error and not r.error.startswith("not timed") else "-"
    text = f"{r.routing_excluded.median_us:,.0f}"
    if not r.correct:
        text += " (wrong)"
    return f"**{text}**" if backend == point.best else text


def times_table(run: BenchRun, load: str) -> str:
    """Median us per backend (routing excluded, best in bold), roofline and best fraction."""
    backends = sorted({r.backend for p in run.points for r in p.results})
    head = ["shape", "M", *backends, "roofline us", "best / roofline", "auto"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    autos = {s.name: s.auto or "-" for s in run.shapes}
    for p in run.points:
        if p.load != load:
            continue
        best = next((r for r in p.results if r.backend == p.best), None)
        fraction = f"{best.achieved_fraction:.0%}" if best else "-"
        cells = [p.shape, str(p.tokens), *(_cell(p, b) for b in backends)]
        cells += [f"{p.roofline_us:,.0f}", fraction, autos[p.shape]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def served_table(run: BenchRun, load: str) -> str:
    """Median us per backend as served (whole layer; * replayed from a CUDA graph)."""
    backends = sorted({r.backend for p in run.points for r in p.results})
    lines = ["| shape | M | " + " | ".join(backends) + " |", "|" + " --- |" * (2 + len(backends))]
    for p in run.points:
        if p.load != load:
            continue
        results = {r.backend: r for r in p.results}
        cells = []
        for b in backends:
            served = results[b].served() if b in results and results[b].correct else None
            text = "-" if served is None else f"{served.median_us:,.0f}"
            text += "*" if served is not None and results[b].captured is not None else ""
            cells.append(f"**{text}**" if b == p.best_served else text)
        lines.append(f"| {p.shape} | {p.tokens} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fastest(point: Point, wanted: Callable[[str], bool]) -> str:
    """ "name us" of the fastest correct backend whose name is `wanted`, "-" if none ran."""
    timed = [
        r
        for r in point.results
        if wanted(r.backend) and r.correct and r.routing_excluded is not None
    ]
    if not timed:
        return "-"
    r = min(timed, key=lambda r: r.routing_excluded.median_us)
    return f"{r.backend} {r.routing_excluded.median_us:,.0f}"


def _auto_cells(p: Point) -> list[str]:
    """Auto / the member it runs, timed beside each other (the member named), and that member
    / the fastest as served, by the rows; "-" where the result lacks one."""
    row = next((r for r in p.results if r.backend == AUTO_ROW), None)
    beside = "-"
    if p.auto_beside_ratio is not None:
        beside = f"{p.auto_beside_ratio:.3f} ({row.member})"
    member = "-" if p.member_served_ratio is None else f"{p.member_served_ratio:.3f}"
    return [beside, member]


def headline_table(run: BenchRun, load: str) -> str:
    """One line per point: the best backend against the roofline, ours against the libraries."""
    head = ["shape", "M", "best (us)", "roofline us", "best / roofline", "our Triton (us)"]
    head += ["best external (us)", "auto / member beside it", "member / best (served)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for p in run.points:
        if p.load != load:
            continue
        best = next((r for r in p.results if r.backend == p.best), None)
        cells = [
            p.shape,
            str(p.tokens),
            _fastest(p, lambda b, best=p.best: b == best),
            f"{p.roofline_us:,.1f}",
            f"{best.achieved_fraction:.0%}" if best else "-",
            _fastest(p, lambda b: b in OUR_TRITON),
            _fastest(p, lambda b: b.startswith(EXTERNAL_PREFIXES)),
            *_auto_cells(p),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_table(run: BenchRun) -> str:
    lines = ["| target | met | worst point |", "| --- | --- | --- |"]
    for check in check_targets(run):
        met = {True: "yes", False: "no", None: "not measured"}[check.met]
        lines.append(f"| {check.target} | {met} | {check.worst} |")
    return "\n".join(lines)


def render(run: BenchRun) -> str:
    env, ceilings = run.environment, run.ceilings
    peaks = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in ceilings.gemm_flops_per_s.items())
    parts = [
        f"Device {env.device} (driver {env.driver}), torch {env.torch}, triton {env.triton}, "
        f"commit {env.commit}, {env.created}.",
        f"Measured ceilings: copy {ceilings.copy_bytes_per_s / 1e9:,.4g} GB/s; GEMM {peaks}.",
    ]
    for load in run.settings.loads:
        parts += [f"Headline, {load} load (median us, routing excluded):"]
        parts += [headline_table(run, load)]
    for load in run.settings.loads:
        parts += [f"Every backend, {load} load (median us, routing excluded; best in bold):"]
        parts += [times_table(run, load)]
    for load in run.settings.loads:
        parts += [f"As served, {load} load (median us of the whole layer; * replayed from a "
                  "CUDA graph; best in bold; wrong ones left out):"]  # fmt: skip
        parts += [served_table(run, load)]
    parts += ["Targets:", targets_table(run)]
    return "\n\n".join(parts) + "\n"
