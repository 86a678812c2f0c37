"""The one way this code captures a CUDA graph.

Python's garbage collector is held off while a graph captures: a collection that frees an
unreachable CUDAGraph (a replaced layer's, an earlier test's) resets it, which CUDA refuses while a
stream captures, and that invalidates the capture in progress ("operation failed due to a
previous error during capture"; seen on the H200 in tests/kernels/test_layer_graphs_gpu.py).
torch no longer collects before a capture unless TORCH_CUDAGRAPH_GC is set. Collections wait
until the capture ends.

thread_local: the service's other threads (the completer waiting on events, another layer's
launches) may make CUDA calls meanwhile, which a global capture would refuse.

Graphs capture on a stream of high priority, and a captured kernel keeps the priority of the
stream it was captured on (torch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority).
Work forked onto a stream of default priority inside the capture (the shared experts' side
stream, kernels/modular.py) then gives way to the forward's own chain: when an SM frees, the
chain's next block goes first. Without it, the one-token DeepSeek-V3 forward's single-program
align kernel waited behind the shared experts' GEMM blocks, 17.6 us instead of 1.8 (H100 trace,
bench/results/layer-profile-h100-2026-11-27-seventh.md).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
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


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool)` on the current device, on a high-priority stream
    from torch's pool (each capture takes the next: threads may capture at once), the collector
    off meanwhile."""
    _HOLD.begin()
    try:
        stream = torch.cuda.Stream(priority=CAPTURE_PRIORITY)
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
    finally:
        _HOLD.end()
