"""Where a forward's time goes: torch's profiler over a device's kernels, as a table and as a
Chrome trace (every kernel with its start, so that ranks can be laid side by side:
bench/ep_timeline.py). Used by `bench.ep_service --profile` on rank 0 and, through the
`profile_start`/`profile_stop` commands, on the other expert-parallel ranks
(service/ep/worker.py)."""

from __future__ import annotations

from pathlib import Path

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


def write_profile(prof: profile, device: torch.device, header: str, path: Path) -> None:
    """A stopped profiler's kernel table under `header` -> `path`, its trace beside it
    (`trace_path`)."""
    path.write_text(f"{header}\n{kernel_table(prof, device)}\n")
    prof.export_chrome_trace(str(trace_path(path)))


def trace_path(table: Path) -> Path:
    return table.with_suffix(".trace.json")
