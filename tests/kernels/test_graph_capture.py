"""kernels/graph_capture.py: no garbage collection while a CUDA graph captures."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import pytest
import torch

from kernels.graph_capture import capturing


@pytest.fixture
def fake_capture(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """torch.cuda.graph replaced by a recorder of whether the collector ran during it (and
    torch.cuda.Stream by a stand-in: these run without a GPU)."""
    seen: list[bool] = []

    @contextmanager
    def graph(*_args, **_kwargs):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda **_kwargs: None)
    return seen


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_during_a_capture_and_as_it_was_after(
    fake_capture: list[bool], enabled_before: bool
) -> None:
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        with capturing(object()):
            assert not gc.isenabled()
        assert fake_capture == [False]
        assert gc.isenabled() is enabled_before
        with pytest.raises(RuntimeError), capturing(object()):
            raise RuntimeError("a capture that fails")
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()


def test_the_collector_stays_off_until_the_last_of_overlapping_captures_ends(
    fake_capture: list[bool],
) -> None:
    """Two threads' captures overlapping (a repository load beside another layer's): the first
    to end must not turn the collector back on under the other."""
    was = gc.isenabled()
    gc.enable()
    try:
        first, second = capturing(object()), capturing(object())
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert not gc.isenabled()
        second.__exit__(None, None, None)
        assert gc.isenabled()
        assert fake_capture == [False, False]
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.gpu
def test_an_unreachable_graph_is_not_collected_while_another_captures() -> None:
    """What broke a layer's capture on the H200: a collection during a capture freed another
    graph, whose reset CUDA refuses while a stream captures, invalidating the capture."""
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
