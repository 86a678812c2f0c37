"""Host memory requests are copied into and out of, kept for the next request: a one-process
forward's body (read into it by the connection, its reply written after it) and a system
shared-memory region's inputs and outputs (service/triton/shared_memory.py). Neither then costs an
allocation and its page faults, and, where the engine runs batches on a GPU, the memory is pinned
(registered with CUDA) once, when a block is first made: the device pipeline copies an input from
it and the output into it by DMA, casting on the device (service/engine/pipeline.py), so no host
copy lies between the request and the GPU. torch's own pinned allocations are not used per
request: its cache hands out new blocks while freed ones wait, each a page-locking call of
milliseconds, and keeps every block it ever made.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

# Blocks come in powers of two from this size up, so that a request finds the block an earlier
# one of about its size gave back.
MIN_BLOCK_BYTES = 64 << 10
VIEWS_KEPT = 16  # tensors made over a block's start, kept for its next loans
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every GPU's context (--devices)


class _Block:
    """A block of copy memory (uint8, CPU) and the tensors made over its start, kept with it:
    the requests that borrow it are mostly of one shape, and making a tensor costs each of them
    host time (`bench/transport_bench.py`, system shared memory)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def view(self, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """Its first `nbytes` as a `dtype` tensor of `shape`."""
        key = (nbytes, dtype, tuple(shape))
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            view = torch.from_numpy(self.array[:nbytes]).view(dtype).view(key[2])
            self._views[key] = view
        return view


@dataclass(frozen=True)
class Loan:
    """`nbytes` of copy memory a request holds until `release`."""

    block: _Block
    nbytes: int
    release: Callable[[], None]

    @property
    def raw(self) -> memoryview:
        """The loan's bytes, for a copy by the operating system."""
        return memoryview(self.block.array)[: self.nbytes]

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The loan's bytes as a `dtype` tensor of `shape` (of as many bytes)."""
        return self.block.view(self.nbytes, dtype, shape)


class CopyMemory:
    """The blocks (the module's docstring). Blocks given back are kept up to `max_idle_bytes`
    (MOE_SERVE_MAX_SHARED_MEMORY_COPY_BYTES), past that let go. A block may come back on any
    thread (the last reference to a lent view dropped there)."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.idle_bytes = 0
        self._idle: dict[tuple[int, bool], list[_Block]] = {}
        self._lock = threading.Lock()

    def lend(self, nbytes: int, pinned: bool) -> Loan:
        """`nbytes` of memory, pinned if `pinned` (and CUDA lets it); the borrower releases the
        loan once nothing, the device included, reads or writes it any more."""
        size = max(MIN_BLOCK_BYTES, 1 << (nbytes - 1).bit_length())
        key = (size, pinned)
        with self._lock:
            idle = self._idle.get(key)
            block = idle.pop() if idle else None
            if block is not None:
                self.idle_bytes -= size
        if block is None:
            block = _Block(_pinned_block(size) if pinned else np.empty(size, dtype=np.uint8))
        return Loan(block, nbytes, lambda: self._give_back(key, block))

    def lend_view(self, nbytes: int, pinned: bool) -> memoryview:
        """`nbytes` of memory (as `lend`) as a view that gives its block back once the last
        reference to it, or to a slice of it, is gone: for memory whose last user is not known
        when it is lent (a body and its reply, which the connection may still be sending after
        the response: the transport keeps what the socket did not take yet)."""
        loan = self.lend(nbytes, pinned)
        array = loan.block.array[:nbytes]
        weakref.finalize(array, loan.release)
        return memoryview(array)

    def _give_back(self, key: tuple[int, bool], block: _Block) -> None:
        size = block.array.nbytes
        with self._lock:
            if self.idle_bytes + size <= self.max_idle_bytes:
                self._idle.setdefault(key, []).append(block)
                self.idle_bytes += size


def _pinned_block(size: int) -> np.ndarray:
    """`size` bytes registered with CUDA, unregistered before their memory is freed; plain
    memory (the copies then go through the pipeline's staging) if CUDA refuses."""
    block = np.empty(size, dtype=np.uint8)
    address = block.ctypes.data
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(address, size, _PORTABLE))
    if error:
        log.warning("copy memory: %d bytes not pinned (CUDA error %d)", size, error)
        return block
    # a weakref callback runs before the array's memory is freed
    weakref.finalize(block, cudart.cudaHostUnregister, address).atexit = False
    return block
