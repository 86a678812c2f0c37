"""`moe-serve bench report --mode plot FILE`: PNGs beside a kernel-benchmark result file.

- FILE-time.png: median forward time (routing excluded) against tokens, one panel per shape and
  load, one line per backend, the roofline dashed;
- FILE-roofline.png: the achieved fraction of the roofline against tokens, same panels.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from ..kernels.arith import ceil_div
from .schema import BenchRun, Point

_PANEL_INCHES = (5.0, 3.2)


def _panels(run: BenchRun) -> list[tuple[str, str, list[Point]]]:
    """(shape, load, its points by token count) in the run's shape and load order."""
    grouped: dict[tuple[str, str], list[Point]] = defaultdict(list)
    for p in run.points:
        grouped[(p.shape, p.load)].append(p)
    return [
        (shape.name, load, sorted(grouped[(shape.name, load)], key=lambda p: p.tokens))
        for shape in run.shapes
        for load in run.settings.loads
        if grouped[(shape.name, load)]
    ]


def _series(points: list[Point], field: str) -> dict[str, tuple[list[int], list[float]]]:
    """backend -> (tokens, values) of `field` ("median_us" or a BackendResult fraction)."""
    series: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    for p in points:
        for r in p.results:
            if r.routing_excluded is None:
                continue
            value = r.routing_excluded.median_us if field == "median_us" else getattr(r, field)
            series[r.backend][0].append(p.tokens)
            series[r.backend][1].append(value)
    return series


Draw = Callable[[Axes, list[Point], dict[str, tuple]], None]


def _figure(run: BenchRun, draw: Draw) -> Figure:
    panels = _panels(run)
    # one colour per backend in every panel, so a line is recognisable across shapes
    backends = sorted({r.backend for p in run.points for r in p.results})
    # tab20 pairs a dark and a light shade of 10 hues: the 10 dark ones first
    colors = {b: colormaps["tab20"]((2 * i) % 20 + (i // 10) % 2) for i, b in enumerate(backends)}
    cols = len(run.settings.loads)
    rows = max(1, ceil_div(len(panels), cols))
    fig = Figure(figsize=(_PANEL_INCHES[0] * cols, _PANEL_INCHES[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, (shape, load, points) in zip(axes, panels, strict=False):
        draw(ax, points, colors)
        ax.set_title(f"{shape}, {load} load", fontsize=10)
        ax.set_xscale("log", base=2)
        tokens = [p.tokens for p in points]
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    env = run.environment
    fig.suptitle(f"{env.device}, commit {env.commit}, torch {env.torch}", fontsize=11)
    return fig


def _draw_time(ax: Axes, points: list[Point], colors: dict[str, tuple]) -> None:
    for backend, (tokens, us) in sorted(_series(points, "median_us").items()):
        ax.plot(tokens, us, marker="o", markersize=3, label=backend, color=colors[backend])
    ax.plot(
        [p.tokens for p in points],
        [p.roofline_us for p in points],
        "k--",
        label="roofline",
    )
    ax.set_yscale("log")
    ax.set_ylabel("median forward (us)")


def _draw_fraction(ax: Axes, points: list[Point], colors: dict[str, tuple]) -> None:
    for backend, (tokens, fraction) in sorted(_series(points, "achieved_fraction").items()):
        ax.plot(tokens, fraction, marker="o", markersize=3, label=backend, color=colors[backend])
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction of roofline")


def plot_run(run: BenchRun, json_path: Path) -> list[Path]:
    """Write the two PNGs beside `json_path`; return their paths."""
    written = []
    for suffix, draw in (("time", _draw_time), ("roofline", _draw_fraction)):
        path = json_path.with_name(f"{json_path.stem}-{suffix}.png")
        _figure(run, draw).savefig(path, dpi=110)
        written.append(path)
    return written
