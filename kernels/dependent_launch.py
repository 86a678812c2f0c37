"""Programmatic dependent launch (Hopper and later) for the Triton kernels of one forward.

A kernel launched with `launch_pdl=True` may start while the kernel before it in its stream still
runs: its launch and the start of its programs hide behind that kernel's last wave. A small
DeepSeek-V3 forward chains six small-to-mid kernels (quantiser, align, GEMM1, quantiser, GEMM2,
top-k sum; per pair, four: no align, GEMM2 sums), each waiting for the one before, and the
served forward puts its own around them (a replay's first kernel, the router, the routing, the
stats pass after the experts): in a profiler trace each launch leaves a gap of a microsecond or
two, a visible share of the forward.

The rule every kernel launched this way keeps: each program calls `begin` before its first load
or store of memory any other kernel reads or writes (only arithmetic on arguments and program
ids comes before it). Because every program waits there, a kernel that starts early cannot see
the output of one further back unfinished: the kernel just before it ended only after its own
programs' waits. A kernel launched without it (torch's) waits for all before it as usual; one
launched with it after torch's starts when that one ends. Inside a CUDA graph capture the
launches become programmatic edges. `moe-serve bench kernels` times the one-token forwards it
shortens.

Triton's CPU interpreter has no grid dependency control: there `PDL` is False, so `begin`
compiles to nothing, and the launch's `launch_pdl=False` is an option it ignores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_math import interpreted

_CAPABILITY = (9, 0)  # griddepcontrol: Hopper onwards


def dependent_launch(device: torch.device) -> bool:
    """Whether this code's Triton kernels on `device` launch as programmatic dependents: compiled
    (not the interpreter) on a GPU of compute capability 9.0 or later. Pass it as both the
    kernel's `PDL` and its `launch_pdl`."""
    return device.type == "cuda" and not interpreted() and _capable(torch.device(device).index)


@functools.cache
def _capable(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= _CAPABILITY


@triton.jit
def begin(PDL: tl.constexpr):
    """Wait until the kernel before this one in the stream has ended and its writes are visible,
    then let the next kernel launch once every program of this one has come here (its programs
    then wait on the SMs this one's last wave leaves free, not behind its launch)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
