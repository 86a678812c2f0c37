"""One replay of a captured forward kernel by kernel, from the traces of `moe-serve bench kernels
--mode profile` (bench/layer_profile.py), written beside each as its .timeline.md.

The profiled replays run back to back on one stream, so the trace's kernels (copies and fills
included) fall into N runs of equal length, in time order. Within a run a kernel is known by its
name and its rank among that run's kernels of the name (the grouped GEMM's first and second
launch are GEMM1 and GEMM2), so that two kernels side by side on two streams may start in
either order. Per kernel, in the order of its median start: that start (us after its replay's
first kernel started) and its median duration; then the median end of a replay. This is where
a forward's time goes between its kernels, what runs beside what and what waits.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .ep_timeline import Kernel, read_kernels


@dataclass(frozen=True)
class TimelineRow:
    name: str
    nth: int  # this name's nth kernel of the replay, from 0
    start_us: float  # median, after the replay's first kernel started
    duration_us: float  # median


@dataclass(frozen=True)
class Timeline:
    rows: list[TimelineRow]
    end_us: float  # median end of a replay's last kernel, after its first started


def replay_timeline(kernels: list[Kernel], replays: int) -> Timeline:
    """Kernels of `replays` back-to-back replays, by start -> the median replay."""
    if replays < 1 or not kernels or len(kernels) % replays:
        raise ValueError(
            f"{len(kernels)} kernels do not split into {replays} replays of the same kernels"
        )
    per_replay = len(kernels) // replays
    starts: dict[tuple[str, int], list[float]] = {}
    durations: dict[tuple[str, int], list[float]] = {}
    ends = []
    for r in range(replays):
        run = kernels[r * per_replay : (r + 1) * per_replay]
        zero, seen = run[0].start_us, Counter()
        for k in run:
            key = (k.name, seen[k.name])
            seen[k.name] += 1
            starts.setdefault(key, []).append(k.start_us - zero)
            durations.setdefault(key, []).append(k.end_us - k.start_us)
        ends.append(max(k.end_us for k in run) - zero)
    if any(len(times) != replays for times in starts.values()):
        raise ValueError("the replays do not run the same kernels: not one replay's timeline")
    rows = [
        TimelineRow(name, nth, statistics.median(times), statistics.median(durations[name, nth]))
        for (name, nth), times in starts.items()
    ]
    return Timeline(sorted(rows, key=lambda row: row.start_us), statistics.median(ends))


def render(timeline: Timeline, title: str) -> str:
    lines = [
        f"# {title}",
        "",
        "kernel | nth | start us | duration us | end us",
        "--- | --- | --- | --- | ---",
    ]
    for row in timeline.rows:
        name = row.name if len(row.name) <= 60 else row.name[:57] + "..."
        end = row.start_us + row.duration_us
        lines.append(f"{name} | {row.nth} | {row.start_us:.1f} | {row.duration_us:.1f} | {end:.1f}")
    lines.append(f"replay ends | | | | {timeline.end_us:.1f}")
    return "\n".join(lines) + "\n"


def timeline_path(trace: Path) -> Path:
    return trace.with_name(trace.name.removesuffix(".trace.json") + ".timeline.md")


def write_timeline(trace: Path, replays: int, title: str) -> Timeline:
    """The trace's median replay -> its .timeline.md beside it."""
    timeline = replay_timeline(read_kernels(trace), replays)
    timeline_path(trace).write_text(render(timeline, title))
    return timeline
