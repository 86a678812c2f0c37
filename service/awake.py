"""An event loop kept awake: while something holds it, and for LINGER_S after, the loop polls for
I/O at each turn instead of sleeping in epoll, so what arrives is read as it lands. A process
asleep is woken by the kernel once its socket is readable, late (its core idle deep, its caches
cold), and a request pays that at each process it crosses: the client's request reaching a front
end, the front end's forward reaching the engine, the engine's reply reaching the front end
(`moe-serve bench service --mode path`, http-front-ends).

It costs a core while it lasts: a process stays awake while it waits for the engine's answer
and for LINGER_S after its last reply only, so a client that sends its requests one after
another finds it awake, and an idle server sleeps. It sleeps too while a request's host work runs
on a thread (service/off_loop.py): polling, the loop would hold the GIL that the thread takes
back after each call that lets it go, a switch interval each time. Torch-free: the front-end
processes use it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from . import off_loop

# How long a loop stays awake after its last reply: longer than a client's turn-around on the
# same host (the reply read, the next request written) for a 64-token DeepSeek-V3 body
# (`moe-serve bench service --mode path`)
LINGER_S = 0.002
# A loop held this long with no hold or release meanwhile sleeps all the same: an engine that
# stopped answering would otherwise keep a core of every front end busy
HELD_S = 1.0


class Awake:
    """One event loop's wakefulness. `hold` keeps it awake until the matching `release` (or
    HELD_S without either), which (as `linger`) keeps it awake LINGER_S more; `allowed`, asked
    at each turn, ends it early (a process whose threads need the GIL that a loop polling
    without pause would keep) or keeps it asleep."""

    def __init__(
        self,
        linger_s: float = LINGER_S,
        allowed: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.linger_s = linger_s
        self._allowed = allowed
        self._clock = clock
        self._holds = 0
        self._held_at = 0.0  # the last hold or release
        self._until = 0.0  # the linger's end
        self._turn: asyncio.Handle | None = None  # scheduled while awake

    @property
    def awake(self) -> bool:
        return self._turn is not None

    @property
    def held(self) -> bool:
        return self._holds > 0

    def hold(self) -> None:
        self._holds += 1
        self._held_at = self._clock()
        self._wake()

    def release(self) -> None:
        self._holds -= 1
        self._held_at = self._clock()
        self.linger()

    def linger(self) -> None:
        """Awake LINGER_S from now (at least)."""
        self._until = self._clock() + self.linger_s
        self._wake()

    def _wake(self) -> None:
        if self._turn is None and self._may_poll():
            self._turn = asyncio.get_running_loop().call_soon(self._again)

    def _may_poll(self) -> bool:
        return self._allowed() and not off_loop.working()

    def _again(self) -> None:
        """A callback always ready while awake: the loop polls for I/O without waiting."""
        now = self._clock()
        held = self._holds and now - self._held_at < HELD_S
        if (held or now < self._until) and self._may_poll():
            self._turn = asyncio.get_running_loop().call_soon(self._again)
        else:
            self._turn = None
