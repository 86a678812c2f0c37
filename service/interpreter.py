"""Process-wide interpreter settings of a serving process (the engine process, a front end).

The garbage collector: a request allocates a few hundred Python objects (tasks, futures,
dataclasses, tensor wrappers), so with CPython's default thresholds (700, 10, 10) a young
collection ran every few requests, and the full ones walked the millions of objects torch and
FastAPI leave at import. `gc.freeze()` once the process has started moves everything alive then
out of every later collection, and somewhat higher thresholds make collections rarer (much
higher ones make each young collection a pause of its own). GC_THRESHOLDS were chosen with
`moe-serve bench service` (the demo layer under many clients behind front ends: throughput and
p99), comparing settings within one run, since a host's speed varies between runs.

The GIL's switch interval, in a process that runs batches on a GPU: the launcher and completer
threads hand every batch to and from the device, and behind an event loop busy with requests
they waited up to Python's default 5 ms for the GIL while the GPU idled.
"""

from __future__ import annotations

import gc
import sys

GC_THRESHOLDS = (5_000, 20, 20)
GIL_SWITCH_S = 0.0005


def collect_less() -> None:
    """Once in a serving process, as it starts to serve: not in a library call or a test
    process, where what is alive at the call would never be collected."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def switch_gil_often() -> None:
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
