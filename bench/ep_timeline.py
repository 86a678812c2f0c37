"""Expert-parallel ranks' forwards side by side, from the traces `moe-serve bench ep --profile`
writes (DIR/profile-ep.trace.json, DIR/profile-ep-rank*.trace.json).

Each forward of the sender mode holds one broadcast (rank 0's tokens to every rank) and one
reduce (every rank's partial sums onto rank 0), and a broadcast ends on every rank at about
the same moment: that end is each forward's time zero here, on every rank, so that the ranks'
clocks need not agree. Per rank, medians over the forwards every rank profiled (the other
ranks profile one forward more, their first, which is left out):

- `broadcast`: its broadcast kernel starts (the rank is ready to send or receive; rank 0 routes
  before it, the others wait there);
- `reduce`: its reduce kernel starts (its experts are done); `reduce end`;
- `busy`: kernel time between the broadcast's end and the reduce's start (work, not waiting);
  where a rank reaches the reduce later than another, that rank is the forward's critical path.
Where a forward's own kernels began is not told: a rank's eager kernels of other batches in
flight (staging, checks) fall between its graphs, and under the profiler the host, not the
device, spaces the forwards.

`write_ep_timeline` writes the table to DIR/ep-timeline.md.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

POINTS = ("broadcast", "reduce", "reduce end", "busy")


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float


def read_kernels(trace: Path) -> list[Kernel]:
    """The GPU kernels and copies of a Chrome trace, by start."""
    events = json.loads(trace.read_text())["traceEvents"]
    found = [
        Kernel(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(found, key=lambda k: k.start_us)


def forward_points(kernels: list[Kernel]) -> list[dict[str, float]]:
    """Per forward (one broadcast, then one reduce), the POINTS in ms from its broadcast's end."""
    broadcasts = [k for k in kernels if "Broadcast" in k.name]
    reduces = [k for k in kernels if "Reduce" in k.name and "nccl" in k.name]
    if len(broadcasts) != len(reduces):
        raise ValueError(f"{len(broadcasts)} broadcasts but {len(reduces)} reduces in the trace")
    forwards = []
    for broadcast, reduce in zip(broadcasts, reduces, strict=True):
        zero = broadcast.end_us
        busy = sum(
            k.end_us - k.start_us
            for k in kernels
            if zero <= k.start_us < reduce.start_us and "Memcpy" not in k.name
        )
        forwards.append({
            "broadcast": (broadcast.start_us - zero) / 1e3,
            "reduce": (reduce.start_us - zero) / 1e3,
            "reduce end": (reduce.end_us - zero) / 1e3,
            "busy": busy / 1e3,
        })  # fmt: skip
    return forwards


def timeline(traces: dict[str, Path]) -> dict[str, dict[str, float]]:
    """Rank name -> the median of each point over the forwards every rank profiled."""
    per_rank = {rank: forward_points(read_kernels(path)) for rank, path in traces.items()}
    common = min(len(f) for f in per_rank.values())
    if common == 0:
        raise ValueError("a trace holds no forward")
    return {
        rank: {p: statistics.median(f[p] for f in forwards[-common:]) for p in POINTS}
        for rank, forwards in per_rank.items()
    }


def render(medians: dict[str, dict[str, float]]) -> str:
    lines = [
        "ms from each forward's broadcast end (medians over the forwards every rank profiled)",
        "",
        "| rank | " + " | ".join(POINTS) + " |",
        "|" + " --- |" * (len(POINTS) + 1),
    ]
    lines += [
        f"| {rank} | " + " | ".join(f"{points[p]:.3f}" for p in POINTS) + " |"
        for rank, points in medians.items()
    ]
    return "\n".join(lines) + "\n"


def write_ep_timeline(directory: Path) -> str:
    """The ranks' traces in `directory` side by side -> DIR/ep-timeline.md; the table."""
    traces = {"rank 0": directory / "profile-ep.trace.json"}
    for path in sorted(directory.glob("profile-ep-rank*.trace.json")):
        traces[f"rank {path.name.removeprefix('profile-ep-rank').split('.')[0]}"] = path
    missing = [str(p) for p in traces.values() if not p.exists()]
    if missing or len(traces) < 2:
        missing = missing or ["rank 1+"]
        raise ValueError(f"needs rank 0's and another rank's traces; missing: {missing}")
    table = render(timeline(traces))
    (directory / "ep-timeline.md").write_text(table)
    return table
