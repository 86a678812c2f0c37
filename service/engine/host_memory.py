"""Host memory this process registers with CUDA (a front end's arena), and the question the
engine asks of a request's rows: are they pinned? For rows in registered memory the answer comes
from the registered ranges; torch's `is_pinned` asks the driver, microseconds of the engine's
time a request, and stays the answer for any other memory."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_PORTABLE = 1  # cudaHostRegisterPortable
# (start, end) of each registered range; replaced whole, so that a reader on another thread
# sees one tuple or the next
_registered: tuple[tuple[int, int], ...] = ()


def register(address: int, size: int) -> bool:
    """Register `size` bytes at `address` with CUDA, portable (pinned for every GPU's context:
    the layers may sit on several); whether CUDA accepted."""
    global _registered
    error = int(torch.cuda.cudart().cudaHostRegister(address, size, _PORTABLE))
    if error:
        log.warning("%d bytes of host memory not registered with CUDA (error %s)", size, error)
        return False
    _registered = (*_registered, (address, address + size))
    return True


def unregister(address: int) -> None:
    global _registered
    _registered = tuple(r for r in _registered if r[0] != address)
    torch.cuda.cudart().cudaHostUnregister(address)


def is_pinned(t: torch.Tensor) -> bool:
    """Whether a CPU tensor lies in memory pinned for CUDA."""
    begin = t.data_ptr()
    end = begin + t.numel() * t.element_size()
    return any(start <= begin and end <= stop for start, stop in _registered) or t.is_pinned()
