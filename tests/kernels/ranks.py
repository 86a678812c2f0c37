"""Spawned ranks for the expert-parallel tests: each run gets a fresh port, and a rank that
hangs fails its test instead of hanging the suite."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp

from moe_serve.service.ep.group import free_port


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int, timeout_s: float) -> None:
    """fn(rank, port, *args) in `nprocs` spawned processes; a rank's exception is raised here,
    and ranks still running after `timeout_s` are killed and the test fails."""
    ctx = mp.start_processes(
        fn, args=(free_port(), *args), nprocs=nprocs, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {nprocs} ranks did not finish in {timeout_s:g} s")
