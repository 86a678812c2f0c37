"""The one way this code captures a CUDA graph.

Python's garbage collector is held off while a graph captures: a collection that frees an
unreachable CUDAGraph (a replaced layer's, an earlier test's) resets it, which CUDA refuses while a
stream captures, and that invalidates the capture in progress ("operation failed due to a
previous error during capture", as tests/kernels/test_layer_graphs_gpu.py can meet it).
torch no longer collects before a capture unless TORCH_CUDAGRAPH_GC is set. Collections wait
until the capture ends.

thread_local: the service's other threads (the completer waiting on events, another layer's
launches) may make CUDA calls meanwhile, which a global capture would refuse.

Graphs capture on a stream of high priority, and a captured kernel keeps the priority of the
stream it was captured on (torch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority).
Work forked onto a stream of default priority inside the capture (the shared experts' side
stream, kernels/modular.py) then gives way to the forward's own chain: when an SM frees, the
chain's next block goes first. Without it, the one-token DeepSeek-V3 forward's single-program
align kernel waits behind the shared experts' GEMM blocks, several times its own time.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class _CollectorHold:
    """The collector off while any thread captures, as it was once the last capture ends (a
    layer loaded from the repository captures while another may)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._captures = 0
        self._was_enabled = False

    def begin(self) -> None:
        with self._lock:
            if self._captures == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._captures += 1

    def end(self) -> None:
        with self._lock:
            self._captures -= 1
            if self._captures == 0 and self._was_enabled:
                gc.enable()


_HOLD = _CollectorHold()
CAPTURE_PRIORITY = -1  # above the default 0 (CUDA: lower numbers run first; torch clamps)


class _Phases(threading.local):
    """The capture in progress on this thread that `phase_boundary` splits (None: none)."""

    graphs: list[torch.cuda.CUDAGraph] | None = None
    pool: tuple[int, int] | None = None


_PHASES = _Phases()


@contextmanager
def _capture(
    graphs: list[torch.cuda.CUDAGraph], pool: tuple[int, int] | None, phased: bool
) -> Iterator[None]:
    """Capture into graphs[0] (and, `phased`, into a new graph at each phase boundary) on the
    current device, on a high-priority stream from torch's pool (each capture takes the next:
    threads may capture at once), the collector off meanwhile. As `torch.cuda.graph`, with a
    graph that may change on the way."""
    _HOLD.begin()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # free blocks go back to CUDA: the graph's pool may need them
        with torch.cuda.stream(torch.cuda.Stream(priority=CAPTURE_PRIORITY)):
            graphs[0].capture_begin(pool=pool, capture_error_mode="thread_local")
            outer = _PHASES.graphs, _PHASES.pool
            _PHASES.graphs, _PHASES.pool = (graphs, pool) if phased else (None, None)
            try:
                yield
            finally:
                _PHASES.graphs, _PHASES.pool = outer
                graphs[-1].capture_end()
    finally:
        _HOLD.end()


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None) -> Iterator[None]:
    """Capture the work in this block into `graph` (in `pool`, a graph pool handle, if given);
    a `phase_boundary` within it changes nothing."""
    with _capture([graph], pool, phased=False):
        yield


def replay_of(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` called once (it compiles and allocates), then captured into a graph: the graph's
    replay, which runs fn's device work with no host launches (the benchmarks and the tile
    search time kernels as a served layer replays them)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        fn()
    return graph.replay


@contextmanager
def capturing_phases(pool: tuple[int, int] | None = None) -> Iterator[list[torch.cuda.CUDAGraph]]:
    """Capture the work in this block into one graph per phase: each `phase_boundary` the work
    meets ends the graph so far and begins the next, in the same pool, on the same stream. The
    list yielded fills as the capture goes; replayed in order, the graphs do the whole work, and
    on streams of their own a phase of one forward may run beside a later phase of another.

    Expert parallelism's sender (kernels/prepare_finalize/naive_ep.py) marks where its first
    collective begins and where its last ends: what comes before (the prologue) and after (the
    epilogue) needs no other rank, so the service's pipeline runs them on its copy streams
    while the neighbouring batches' collectives and experts run (service/pipeline.py)."""
    graphs = [torch.cuda.CUDAGraph()]
    with _capture(graphs, pool, phased=True):
        yield graphs


def phase_boundary() -> None:
    """Within `capturing_phases` on this thread: end the graph captured so far and begin the
    next. Elsewhere (eager work, or `capturing`) nothing. Work forked onto other streams must
    have joined the capture stream by then (CUDA refuses to end a capture otherwise)."""
    graphs = _PHASES.graphs
    if graphs is None:
        return
    graphs[-1].capture_end()
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=_PHASES.pool, capture_error_mode="thread_local")
    graphs.append(graph)
