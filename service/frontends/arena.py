"""A shared-memory arena in which an HTTP front-end process lays request bodies and the engine
process lays the replies (`--http-workers`): the bytes cross between processes without a copy
through a socket.

The front end creates the arena (a file under /dev/shm) and allocates a region per request: the
body first, then room for the reply. The engine maps the same file, reads the body in place and
writes the reply after it; only a small record naming the region goes over the socket. A region
belongs to the front end until it hands it over, then to the engine until the engine answers:
neither writes what the other may be reading.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...kernels.arith import round_up

BLOCK_BYTES = 64 << 10  # allocation unit
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
# Room after the reply's tensors for its safetensors header (names, shapes, the layer's name).
REPLY_HEADER_BYTES = 64 << 10


def shm_dir() -> Path:
    """Where arenas live: /dev/shm (memory, not disk) where the host has it."""
    dev_shm = Path("/dev/shm")
    usable = dev_shm.is_dir() and os.access(dev_shm, os.W_OK)
    return dev_shm if usable else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class Region:
    """A request's body at `offset`, its reply at `reply_offset` (at most `reply_capacity`)."""

    offset: int
    body_bytes: int
    reply_capacity: int

    @property
    def reply_offset(self) -> int:
        return self.offset + round_up(self.body_bytes, BLOCK_BYTES)

    @property
    def blocks(self) -> int:
        return (self.reply_offset - self.offset + self.reply_capacity) // BLOCK_BYTES


class BodyArena:
    """A mapped arena file. `create` in the front end (which allocates), `attach` in the engine."""

    def __init__(self, path: Path, size: int, *, owner: bool) -> None:
        self.path = path
        self.size = size
        with open(path, "r+b") as f:
            # page tables filled now: a fault per page on first touch would slow the engine's
            # copy of a batch into pinned memory
            self._map = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | _POPULATE)
        self.view = memoryview(self._map)
        self._used = bytearray(size // BLOCK_BYTES) if owner else None  # 1: block allocated

    @classmethod
    def create(cls, directory: Path, size: int) -> BodyArena:
        size = round_up(size, BLOCK_BYTES)
        fd, name = tempfile.mkstemp(prefix="moe-serve-arena-", dir=directory)
        try:
            os.posix_fallocate(fd, 0, size)  # a full /dev/shm fails here, not with a SIGBUS later
        except OSError:
            os.unlink(name)
            raise
        finally:
            os.close(fd)
        return cls(Path(name), size, owner=True)

    @classmethod
    def attach(cls, path: Path, size: int) -> BodyArena:
        if os.path.getsize(path) != size:
            raise ValueError(f"arena {path} has {os.path.getsize(path)} bytes, not {size}")
        return cls(path, size, owner=False)

    def unlink(self) -> None:
        """Remove the file once both processes have it mapped: nothing is left behind."""
        self.path.unlink(missing_ok=True)

    def allocate(self, body_bytes: int) -> Region | None:
        """A region for a body and a reply as large as the body allows, or None when full."""
        reply = body_bytes + REPLY_HEADER_BYTES
        region = Region(0, body_bytes, round_up(reply, BLOCK_BYTES))
        blocks = region.blocks
        start = self._used.find(bytes(blocks))
        if start < 0:
            return None
        self._used[start : start + blocks] = b"\x01" * blocks
        return Region(start * BLOCK_BYTES, body_bytes, region.reply_capacity)

    def free(self, region: Region) -> None:
        start = region.offset // BLOCK_BYTES
        self._used[start : start + region.blocks] = bytes(region.blocks)

    def body(self, region: Region) -> memoryview:
        return self.view[region.offset : region.offset + region.body_bytes]

    def reply(self, region: Region, nbytes: int | None = None) -> memoryview:
        size = region.reply_capacity if nbytes is None else nbytes
        return self.view[region.reply_offset : region.reply_offset + size]

    def lend_reply(self, region: Region, nbytes: int) -> memoryview:
        """The reply's `nbytes` as a view that frees `region` once the last reference to it is
        gone: sent as it lies, with no copy. The region outlives the response, not just its
        send: the transport keeps what the socket did not take yet (uvloop holds a view of it)
        until it is written."""
        reply = np.frombuffer(self.view, np.uint8, nbytes, region.reply_offset)
        weakref.finalize(reply, self.free, region)
        return memoryview(reply)

    def close(self) -> None:
        """Unmap, unless tensors still view the arena: then the mapping goes with the last of
        them, as this object lets go of it (it may itself be held longer, in a cycle of
        references that the garbage collector, run rarely in a serving process, frees late)."""
        view, mapping = self.view, self._map
        del self.view, self._map
        try:
            view.release()
            mapping.close()
        except BufferError:
            pass
