"""bench/replay_timeline.py: the median replay of a captured forward from its trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.bench import replay_timeline
from moe_serve.bench.ep_timeline import Kernel


def _replays(offsets: list[float], swap: list[bool]) -> list[Kernel]:
    """Replays starting at `offsets`: route, then GEMM1 beside a shared GEMM (which of the two
    starts first as `swap` says), then GEMM2; durations grow with the replay's index."""
    kernels = []
    for i, (t, swapped) in enumerate(zip(offsets, swap, strict=True)):
        side, gemm1 = (t + 5.0, t + 6.0) if not swapped else (t + 6.0, t + 5.0)
        kernels += [
            Kernel("route", t, t + 4.0 + i),
            Kernel("shared_gemm", side, side + 20.0),
            Kernel("grouped_gemm", gemm1, gemm1 + 80.0 + i),
            Kernel("grouped_gemm", t + 90.0 + i, t + 130.0 + i),
        ]
    return sorted(kernels, key=lambda k: k.start_us)


def test_each_kernel_is_placed_by_name_and_rank_whichever_stream_started_first() -> None:
    kernels = _replays([0.0, 1000.0, 2000.0], swap=[False, True, False])
    timeline = replay_timeline.replay_timeline(kernels, replays=3)
    rows = {(r.name, r.nth): r for r in timeline.rows}
    assert set(rows) == {("route", 0), ("shared_gemm", 0), ("grouped_gemm", 0), ("grouped_gemm", 1)}
    assert rows["route", 0].duration_us == 5.0  # median of 4, 5, 6
    assert rows["shared_gemm", 0].start_us == 5.0  # 5, 6, 5
    assert rows["grouped_gemm", 0].start_us == 6.0  # 6, 5, 6
    assert rows["grouped_gemm", 1].start_us == 91.0  # GEMM2: the name's second launch
    assert timeline.end_us == 131.0
    names = [r.name for r in timeline.rows]
    assert names == ["route", "shared_gemm", "grouped_gemm", "grouped_gemm"]


@pytest.mark.parametrize("replays", [0, 2, 5])
def test_kernels_that_do_not_split_into_the_replays_are_refused(replays: int) -> None:
    kernels = _replays([0.0, 1000.0, 2000.0], swap=[False] * 3)
    if replays == 2:  # 12 kernels split into 2 runs of 6, but not runs of the same kernels
        with pytest.raises(ValueError, match="not run the same kernels"):
            replay_timeline.replay_timeline(kernels, replays)
        return
    with pytest.raises(ValueError, match="do not split"):
        replay_timeline.replay_timeline(kernels, replays)


def test_the_table_is_written_beside_the_trace(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": k.name, "ts": k.start_us, "dur": k.end_us - k.start_us}
        for k in _replays([0.0, 500.0], swap=[True, False])
    ]
    trace = tmp_path / "profile-x-M1.trace.json"
    trace.write_text(json.dumps({"traceEvents": [*events, {"ph": "X", "cat": "cpu_op"}]}))
    replay_timeline.write_timeline(trace, 2, trace.name)
    table = (tmp_path / "profile-x-M1.timeline.md").read_text()
    assert table.startswith("# profile-x-M1.trace.json\n")
    assert "grouped_gemm | 1 | 90.5 | 40.0 | 130.5" in table
    assert table.rstrip().endswith("replay ends | | | | 130.5")
