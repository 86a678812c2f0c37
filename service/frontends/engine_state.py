"""The engine's probe state (service/core/probes.py), published to the front ends in a small
shared-memory block, so that each front end answers /health, /ready and KServe's probes itself:
in microseconds, whatever the engine is doing, and when every engine slot is busy.

The engine process writes the whole state, with the time of writing (its heartbeat), whenever
the state changes and every HEARTBEAT_S from its event loop. A front end reads it per probe: a
heartbeat older than `stale_s` means the engine's event loop has stopped running (the process
stopped, wedged or blocked), and the probes answer not live and not ready, saying so.

Layout: a generation counter, then two slots; the writer fills the slot the current generation
does not name and then advances the generation, so a reader always finds one whole slot, even
when the writer stopped halfway through the other. Each slot carries a sequence number, odd
while it is written, that the reader checks before and after its copy: a copy raced by two
writes in a row is read again.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from dataclasses import replace
from pathlib import Path

from ..core.probes import ProbeState

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.1  # how often the engine's event loop writes the state (and so its heartbeat)
# A front end's probes say not live once the heartbeat is older than this: one-process mode's
# probes go unanswered as long as its event loop is blocked, and a probe times out in a second
STALE_S = 2.0
BLOCK_BYTES = 1 << 20
_GENERATION = struct.Struct("<Q")
_SLOT_HEAD = struct.Struct("<QdI")  # sequence (odd while written), heartbeat, state bytes
_SLOT_BYTES = (BLOCK_BYTES - 64) // 2
_SLOTS = (64, 64 + _SLOT_BYTES)
_READ_TRIES = 100


class StateBlock:
    """The mapped block: `create` in the engine process (which writes), `attach` in a front end."""

    def __init__(self, path: Path, access: int) -> None:
        self.path = path
        with open(path, "r+b" if access == mmap.ACCESS_WRITE else "rb") as f:
            self._map = mmap.mmap(f.fileno(), BLOCK_BYTES, access=access)
        self._generation = 0  # a writer's: the generations and each slot's sequence written
        self._sequences = [0, 0]
        # a reader's last parse, by (slot, sequence): the state is parsed once per write
        self._seen: tuple[tuple[int, int], ProbeState] | None = None

    @classmethod
    def create(cls, path: Path) -> StateBlock:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, BLOCK_BYTES)
        finally:
            os.close(fd)
        return cls(path, mmap.ACCESS_WRITE)

    @classmethod
    def attach(cls, path: Path) -> StateBlock:
        return cls(path, mmap.ACCESS_READ)

    def write(self, state: ProbeState) -> None:
        """Publish `state`, stamped now; one writer, the engine's event loop."""
        data = state.to_json()
        if len(data) > _SLOT_BYTES - _SLOT_HEAD.size:  # tens of thousands of models
            log.error(
                "%d models are too many to publish: the front ends see none", len(state.models)
            )
            data = replace(state, models=()).to_json()
        generation = self._generation + 1
        at = _SLOTS[generation % 2]
        sequence = self._sequences[generation % 2]
        _SLOT_HEAD.pack_into(self._map, at, sequence + 1, 0.0, 0)
        self._map[at + _SLOT_HEAD.size : at + _SLOT_HEAD.size + len(data)] = data
        _SLOT_HEAD.pack_into(self._map, at, sequence + 2, time.monotonic(), len(data))
        _GENERATION.pack_into(self._map, 0, generation)
        self._generation = generation
        self._sequences[generation % 2] = sequence + 2

    def read(self, stale_s: float) -> ProbeState:
        """The engine's state as the probes answer it now: not live and not ready when its
        heartbeat is older than `stale_s` (or nothing was ever written)."""
        for _ in range(_READ_TRIES):
            (generation,) = _GENERATION.unpack_from(self._map, 0)
            if generation == 0:
                return _not_live("the engine process has published no state yet")
            at = _SLOTS[generation % 2]
            sequence, beat, size = _SLOT_HEAD.unpack_from(self._map, at)
            if sequence % 2:
                continue  # written again meanwhile: two writes since the generation was read
            data = self._map[at + _SLOT_HEAD.size : at + _SLOT_HEAD.size + size]
            if _SLOT_HEAD.unpack_from(self._map, at)[0] == sequence:
                break
        else:
            return _not_live("the engine process's state could not be read")
        age = time.monotonic() - beat
        if age > stale_s:
            return _not_live(f"the engine process has not run its event loop for {age:.1f} s")
        if self._seen is None or self._seen[0] != (at, sequence):
            self._seen = ((at, sequence), ProbeState.from_json(data))
        return self._seen[1]

    def close(self) -> None:
        self._map.close()


def _not_live(reason: str) -> ProbeState:
    return ProbeState(not_live=reason, not_ready=reason)
