"""Where a forward's time goes: torch's profiler over a device's kernels, as a table. Used by
`bench.ep_service --profile` on rank 0 and, through the `profile_start`/`profile_stop`
commands, on the other expert-parallel ranks (service/ep_worker.py)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

ROWS = 30  # kernels listed, the longest first


def kernel_profiler(device: torch.device) -> profile:
    """A profiler of `device`'s work: its GPU kernels (CUDA graph replays included) on a GPU,
    the CPU's ops elsewhere. Enter it (or .start()) to begin."""
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    return profile(activities=[activity])


def kernel_table(prof: profile, device: torch.device) -> str:
    """A stopped profiler's kernels by total time."""
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=ROWS, max_name_column_width=90)
