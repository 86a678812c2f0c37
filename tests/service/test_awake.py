"""An event loop kept awake polls for I/O at each turn (its selector's timeout is 0) while held
and for its linger after; then it sleeps again. Time is a clock the test moves."""

from __future__ import annotations

import asyncio
import selectors
import time

from moe_serve.service import off_loop
from moe_serve.service.awake import HELD_S, Awake


class LoopTimeouts(selectors.DefaultSelector):
    """The loop's selector, recording how long each of its turns may wait for I/O."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None):
        self.timeouts.append(timeout)
        return super().select(timeout)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(main) -> None:
    selector = LoopTimeouts()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        loop.run_until_complete(asyncio.wait_for(main(selector), 10))
    finally:
        loop.close()


async def _turns(selector: LoopTimeouts, n: int = 3) -> list[float | None]:
    """The selector's timeouts while the loop waits `n` times for a thread (no timer of its own:
    a loop asleep waits without a timeout, one awake polls)."""
    selector.timeouts.clear()
    for _ in range(n):
        await asyncio.to_thread(time.sleep, 0.002)
    return list(selector.timeouts)


def _polled(timeouts: list[float | None]) -> bool:
    return bool(timeouts) and all(timeout == 0 for timeout in timeouts)


def test_a_held_loop_polls_until_its_linger_after_the_release_has_passed() -> None:
    clock = _Clock()

    async def main(selector: LoopTimeouts) -> None:
        awake = Awake(linger_s=0.002, clock=clock)
        assert not _polled(await _turns(selector))
        awake.hold()
        clock.now += HELD_S / 2
        assert _polled(await _turns(selector))
        awake.release()
        clock.now += 0.001  # within the linger
        assert _polled(await _turns(selector))
        clock.now += 0.002
        await _turns(selector, 1)  # the turn that sees the linger over stops polling
        assert awake.awake is False
        assert not _polled(await _turns(selector))

    _run(main)


def test_two_holds_keep_it_awake_until_both_are_released() -> None:
    clock = _Clock()

    async def main(selector: LoopTimeouts) -> None:
        awake = Awake(linger_s=0.002, clock=clock)
        awake.hold()
        awake.hold()
        awake.release()
        clock.now += HELD_S / 2
        assert _polled(await _turns(selector))
        awake.release()
        clock.now += HELD_S / 2
        await _turns(selector, 1)
        assert awake.awake is False

    _run(main)


def test_a_loop_not_allowed_to_stay_awake_sleeps_even_when_held() -> None:
    clock = _Clock()
    allowed = [True]

    async def main(selector: LoopTimeouts) -> None:
        awake = Awake(linger_s=0.002, allowed=lambda: allowed[0], clock=clock)
        awake.hold()
        assert _polled(await _turns(selector))
        allowed[0] = False  # asked at each turn
        await _turns(selector, 1)
        assert awake.awake is False
        assert not _polled(await _turns(selector))
        awake.linger()  # not allowed: not woken
        assert awake.awake is False

    _run(main)


def test_a_loop_sleeps_while_host_work_runs_on_a_thread(monkeypatch) -> None:
    """Polling, it would hold the GIL that the thread takes back after each call that lets it
    go; it sleeps until the work is done and a hold or a linger wakes it."""
    clock = _Clock()

    async def main(selector: LoopTimeouts) -> None:
        awake = Awake(linger_s=0.002, clock=clock)
        awake.hold()
        assert _polled(await _turns(selector))
        monkeypatch.setattr(off_loop.JSON, "running", 1)
        await _turns(selector, 1)
        assert awake.awake is False and awake.held
        assert not _polled(await _turns(selector))
        awake.linger()  # host work still runs: not woken
        assert awake.awake is False
        monkeypatch.setattr(off_loop.JSON, "running", 0)
        awake.linger()
        assert _polled(await _turns(selector))

    _run(main)


def test_a_loop_held_with_no_hold_or_release_for_a_while_sleeps_all_the_same() -> None:
    """An engine that stopped answering: the front end waiting for it sleeps after HELD_S, and
    wakes again with its next forward."""
    clock = _Clock()

    async def main(selector: LoopTimeouts) -> None:
        awake = Awake(linger_s=0.002, clock=clock)
        awake.hold()
        clock.now += HELD_S / 2
        assert _polled(await _turns(selector))
        clock.now += HELD_S
        await _turns(selector, 1)
        assert awake.awake is False and awake.held
        assert not _polled(await _turns(selector))
        awake.hold()  # another forward
        assert _polled(await _turns(selector))

    _run(main)
