"""The stored CPU sample result, and runs built from it with other points."""

from __future__ import annotations

from pathlib import Path

from moe_serve.bench.kernel_bench import read_run
from moe_serve.bench.schema import BenchRun, Point

SAMPLE = Path(__file__).parent / "data" / "sample-cpu.json"


def sample_run(points: list[Point] | None = None) -> BenchRun:
    """The stored sample, with its points replaced when `points` is given."""
    run = read_run(SAMPLE)
    return run if points is None else run.model_copy(update={"points": points})
