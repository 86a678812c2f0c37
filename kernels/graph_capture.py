"""The one way this code captures a CUDA graph.

Python's garbage collector is held off while a graph captures: a collection that frees an
unreachable CUDAGraph (a replaced layer's, an earlier test's) resets it, which CUDA refuses while a
stream captures, and that invalidates the capture in progress ("operation failed due to a
previous error during capture"; seen on the H200 in tests/kernels/test_layer_graphs_gpu.py).
torch no longer collects before a capture unless TORCH_CUDAGRAPH_GC is set. Collections wait
until the capture ends.

thread_local: the service's other threads (the completer waiting on events, another layer's
launches) may make CUDA calls meanwhile, which a global capture would refuse.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool)` on the current device, the collector off meanwhile."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if collecting:
            gc.enable()
