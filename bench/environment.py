"""Where a benchmark ran: device, driver, library versions and the commit measured."""

from __future__ import annotations

import platform
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import torch

from .schema import Environment

_REPO = Path(__file__).resolve().parent.parent


def _command_output(args: list[str]) -> str | None:
    """stdout of a short command, or None when it is missing or fails."""
    if shutil.which(args[0]) is None:
        return None
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30, cwd=_REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def current_commit() -> str:
    """Short HEAD hash, "-dirty" when tracked files differ from it; "unknown" outside git."""
    head = _command_output(["git", "rev-parse", "--short", "HEAD"])
    if head is None:
        return "unknown"
    changed = _command_output(["git", "status", "--porcelain", "--untracked-files=no"])
    return f"{head}-dirty" if changed else head


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def capture(
    device: torch.device, commit: str | None = None, command: str | None = None, gpus: int = 1
) -> Environment:
    """Describe `device` and the software stack; `commit` overrides what git says, `command` is
    the `moe-serve bench ...` command of the run, `gpus` how many GPUs it used."""
    is_cuda = device.type == "cuda"
    driver = None
    if is_cuda:
        out = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        driver = out.splitlines()[0] if out else None
    return Environment(
        device=torch.cuda.get_device_name(device) if is_cuda else "cpu",
        device_type="cuda" if is_cuda else "cpu",
        gpus=gpus,
        commit=commit or current_commit(),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        command=command,
        driver=driver,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=_triton_version(),
        python=platform.python_version(),
    )
