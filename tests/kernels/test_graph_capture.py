"""kernels/graph_capture.py: no garbage collection while a CUDA graph captures."""

from __future__ import annotations

import gc

import pytest
import torch

from moe_serve.kernels.graph_capture import (
    capturing,
    capturing_phases,
    phase_boundary,
    replay_of,
)


class FakeGraph:
    """A stand-in CUDA graph that records whether the collector ran while it captured, and the
    work marked between its capture's begin and end."""

    def __init__(self, log: list[tuple[str, object]]) -> None:
        self.log = log
        self.pool: object = None

    def capture_begin(self, pool: object = None, capture_error_mode: str = "") -> None:
        assert capture_error_mode == "thread_local"
        self.pool = pool
        self.log.append(("begin", gc.isenabled()))

    def capture_end(self) -> None:
        self.log.append(("end", self))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """torch.cuda's graphs, streams and synchronize replaced by stand-ins (these run without a
    GPU); returns the log of the graphs' captures."""
    log: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(log))
    monkeypatch.setattr(torch.cuda, "Stream", lambda **_kwargs: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return log


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_during_a_capture_and_as_it_was_after(
    fake_cuda: list[tuple[str, object]], enabled_before: bool
) -> None:
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        graph = FakeGraph(fake_cuda)
        with capturing(graph):
            assert not gc.isenabled()
        assert fake_cuda == [("begin", False), ("end", graph)]
        assert gc.isenabled() is enabled_before
        with pytest.raises(RuntimeError), capturing(FakeGraph(fake_cuda)):
            raise RuntimeError("a capture that fails")
        assert fake_cuda[-1][0] == "end"  # the stream is not left capturing
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()


def test_the_collector_stays_off_until_the_last_of_overlapping_captures_ends(
    fake_cuda: list[tuple[str, object]],
) -> None:
    """Two threads' captures overlapping (a repository load beside another layer's): the first
    to end must not turn the collector back on under the other."""
    was = gc.isenabled()
    gc.enable()
    try:
        first, second = capturing(FakeGraph(fake_cuda)), capturing(FakeGraph(fake_cuda))
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert not gc.isenabled()
        second.__exit__(None, None, None)
        assert gc.isenabled()
        assert [entry for entry in fake_cuda if entry[0] == "begin"] == [("begin", False)] * 2
    finally:
        (gc.enable if was else gc.disable)()


def test_each_phase_boundary_ends_one_graph_and_begins_the_next_in_the_same_pool(
    fake_cuda: list[tuple[str, object]],
) -> None:
    pool = ("pool", 7)
    with capturing_phases(pool) as graphs:
        phase_boundary()
        assert len(graphs) == 2
        phase_boundary()
    assert len(graphs) == 3
    assert [g.pool for g in graphs] == [pool] * 3
    ends = [entry[1] for entry in fake_cuda if entry[0] == "end"]
    assert ends == graphs  # each graph's capture ended once, in order
    assert [entry[0] for entry in fake_cuda] == ["begin", "end"] * 3


def test_a_boundary_outside_a_phased_capture_changes_nothing(
    fake_cuda: list[tuple[str, object]],
) -> None:
    phase_boundary()  # eager work
    assert fake_cuda == []
    graph = FakeGraph(fake_cuda)
    with capturing(graph):
        phase_boundary()  # a plain capture (other ranks' graphs) keeps one graph
    with capturing_phases() as graphs:
        phase_boundary()
    phase_boundary()  # the phased capture's boundaries ended with it
    assert len(graphs) == 2
    assert [entry[1] for entry in fake_cuda if entry[0] == "end"] == [graph, *graphs]


@pytest.mark.gpu
def test_an_unreachable_graph_is_not_collected_while_another_captures() -> None:
    """What breaks a layer's capture: a collection during a capture frees another graph, whose
    reset CUDA refuses while a stream captures, invalidating the capture."""
    x = torch.ones(4, device="cuda")

    def leave_a_graph_in_a_cycle() -> None:
        old = torch.cuda.CUDAGraph()
        with capturing(old):
            x.add_(1)
        cycle: list = [old]
        cycle.append(cycle)  # unreachable once this returns, freed only by the collector

    leave_a_graph_in_a_cycle()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        y = x * 2
        junk = [[] for _ in range(100_000)]  # enough new containers for automatic collections
    del junk
    x.fill_(3)
    graph.replay()
    assert y.tolist() == [6.0] * 4
    gc.collect()  # the old graph goes now, outside any capture


@pytest.mark.gpu
def test_graphs_capture_on_a_stream_above_the_default_priority() -> None:
    """What lets the captured forward's own kernels go before its side stream's (module doc)."""
    default = torch.cuda.Stream().priority
    graph = torch.cuda.CUDAGraph()
    x = torch.ones(4, device="cuda")
    with capturing(graph):
        priority = torch.cuda.current_stream().priority
        x.add_(1)
    assert priority < default
    graph.replay()
    assert x.tolist() == [2.0] * 4


@pytest.mark.gpu
def test_the_phases_of_a_capture_replay_its_work_in_order_on_any_streams() -> None:
    x = torch.ones(4, device="cuda")
    with capturing_phases() as graphs:
        y = x * 2  # allocated in the first graph, read by the second
        phase_boundary()
        z = y + 1
    assert len(graphs) == 2
    x.fill_(3)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):
        graphs[0].replay()
    second.wait_stream(first)
    with torch.cuda.stream(second):
        graphs[1].replay()
    torch.cuda.synchronize()
    assert z.tolist() == [7.0] * 4


@pytest.mark.gpu
def test_replay_of_runs_the_call_once_then_replays_its_device_work_without_it() -> None:
    x = torch.ones(4, device="cuda")
    out = torch.zeros(4, device="cuda")
    calls = []

    def work() -> None:
        calls.append(1)
        out.copy_(x * 2)

    replay = replay_of(work)
    assert len(calls) == 2  # the warm-up call and the captured one
    x.fill_(5)
    replay()
    torch.cuda.synchronize()
    assert out.tolist() == [10.0] * 4 and len(calls) == 2
