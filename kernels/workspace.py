"""Persistent scratch buffers, grown on demand and reused across calls and layers."""

from __future__ import annotations

import math

import torch


class Workspace:
    """Named byte buffers on one device. `get` returns a typed view; it allocates only when a
    buffer must grow, so a second call of the same or a smaller size allocates nothing.

    Several layers may share one Workspace as long as their forwards do not overlap in time
    (the service runs every forward on one worker thread).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0  # how many times a buffer was (re)allocated

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            self._buffers[name] = buf
            self.allocations += 1
        return buf[:nbytes].view(dtype).view(shape)

    def reserve(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        for name, (shape, dtype) in shapes.items():
            self.get(name, shape, dtype)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())
