"""bench/ep_timeline.py: two ranks' traces laid side by side on their broadcasts' ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.bench import ep_timeline


def _trace(path: Path, kernels: list[tuple[str, float, float]], cat: str = "kernel") -> Path:
    events = [{"ph": "X", "cat": cat, "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1e6})
    path.write_text(json.dumps({"traceEvents": events}))
    return path


BROADCAST = "ncclDevKernel_Broadcast_RING_LL"
REDUCE = "ncclDevKernel_Reduce_Sum_f32_RING_LL"


def _forward(at: float, route_us: float, work_us: float, wait_us: float) -> list[tuple]:
    """A forward from `at`: routing, the broadcast (ends 100 us after it starts), the experts,
    then the reduce (waits `wait_us`, then 50 us)."""
    bcast = at + route_us
    return [
        ("router", at, route_us),
        (BROADCAST, bcast, 100.0),
        ("experts", bcast + 100, work_us),
        (REDUCE, bcast + 100 + work_us, wait_us + 50),
    ]


def test_ranks_are_aligned_on_the_broadcast_end_and_the_later_one_shows(tmp_path: Path) -> None:
    # rank 0: 300 us of routing, 4 ms of work; rank 1 (its own clock, 1 s off): no routing,
    # 3 ms of work, so it reaches the reduce 1 ms earlier and waits there; one forward more
    rank0 = [k for i in range(3) for k in _forward(i * 10_000.0, 300, 4000, 0)]
    rank1 = _forward(-20_000.0, 0, 3000, 1000)  # the forward rank 0 did not profile
    rank1 += [k for i in range(3) for k in _forward(1e6 + i * 10_000.0 + 300, 0, 3000, 1000)]
    rank1.append(("Memcpy HtoD (Pinned -> Device)", 1e6 + 500, 40))  # a copy: not work
    medians = ep_timeline.timeline({
        "rank 0": _trace(tmp_path / "r0.json", rank0),
        "rank 1": _trace(tmp_path / "r1.json", rank1),
    })  # fmt: skip
    assert medians["rank 0"] == {
        "broadcast": pytest.approx(-0.1), "reduce": pytest.approx(4.0),
        "reduce end": pytest.approx(4.05), "busy": pytest.approx(4.0),
    }  # fmt: skip
    assert medians["rank 1"]["reduce"] == pytest.approx(3.0)
    assert medians["rank 1"]["busy"] == pytest.approx(3.0)  # the copy is not work
    assert "| rank 1 | -0.100 | 3.000 | 4.050 | 3.000 |" in ep_timeline.render(medians)


def test_a_trace_without_matching_collectives_is_refused(tmp_path: Path) -> None:
    trace = _trace(tmp_path / "t.json", [(BROADCAST, 0.0, 10.0)])
    with pytest.raises(ValueError, match="1 broadcasts but 0 reduces"):
        ep_timeline.timeline({"rank 0": trace})


def test_a_missing_trace_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"profile-ep\.trace\.json"):
        ep_timeline.write_ep_timeline(tmp_path)


def test_the_ranks_side_by_side_are_written_beside_their_traces(tmp_path: Path) -> None:
    _trace(tmp_path / "profile-ep.trace.json", _forward(0.0, 300, 4000, 0))
    _trace(tmp_path / "profile-ep-rank1.trace.json", _forward(1e6 + 300, 0, 3000, 1000))
    table = ep_timeline.write_ep_timeline(tmp_path)
    assert (tmp_path / "ep-timeline.md").read_text() == table
    assert "| rank 1 | -0.100 | 3.000 | 4.050 | 3.000 |" in table
