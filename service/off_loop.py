"""Where a request's host work runs: on the event loop, or on a thread once it is large enough
that the loop would wait on it longer than a thread hop costs. One policy, by kind of work:

- BINARY: safetensors bodies decoded and replies encoded, shared-memory copies, a batch staged
  for the device. Up to 1 MiB (a 64-token DeepSeek-V3 bf16 body is 917 KB) the work takes less
  than a hop to the default thread pool and back.
- JSON: bodies parsed and replies printed. Up to 512 KiB (a 64-token demo request is 200 KB) it
  runs on the loop: the work is mostly a few C calls (orjson's parse and print) that hold the
  GIL, so a thread would free the loop only between them. Larger work goes to two threads of
  its own, which bound how many bodies are decoded at once (each costs a few times its size in
  memory) and how many threads sit in a C parser holding the GIL that the loop needs to answer
  /health.

Both limits were chosen with `bench/request_path.py` (the decode and encode stages, one client)
and `bench/json_bench.py`.

A caller that is the server's only request (nothing else admitted to the batcher) keeps larger
work on the loop, up to `alone_bytes`: the loop has no one else to serve meanwhile, and a thread
hop each way (a worker's wake-up, then the loop's, and the future chain back) costs the request
more than it frees. BINARY's 4 MiB takes a system shared-memory copy of a 64-token DeepSeek-V3
fp32 input or output (1.84 MB) on the loop; past it the hops are a small share of the copy
(`bench/transport_bench.py`, system shared memory). Torch-free: the front-end processes use it
too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class OffLoop:
    def __init__(
        self, on_loop_bytes: int, executor: Executor | None, alone_bytes: int | None = None
    ) -> None:
        self.on_loop_bytes = on_loop_bytes  # work on more bytes than this leaves the loop
        self.executor = executor  # None: asyncio's default thread pool
        # the same for the server's only request
        self.alone_bytes = on_loop_bytes if alone_bytes is None else alone_bytes
        self.running = 0  # calls on a thread now (counted on the loop)

    def stays(self, nbytes: int, alone: bool = False) -> bool:
        """Whether work on about `nbytes` runs on the loop: up to `on_loop_bytes`
        (`alone_bytes` where the caller is the server's only request)."""
        return nbytes <= (self.alone_bytes if alone else self.on_loop_bytes)

    async def run(self, nbytes: int, fn: Callable[..., T], *args: Any, alone: bool = False) -> T:
        """`fn(*args)`, work on about `nbytes`: here where it `stays`, else on a thread."""
        if self.stays(nbytes, alone):
            return fn(*args)
        return await self.off_loop(fn, *args)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a thread, in the caller's context (its log lines keep the request id).
        A caller cancelled meanwhile (a gRPC call cancelled, the drain's deadline) is cancelled
        once `fn` has ended: a thread cannot be stopped, and `fn` works on memory the caller
        gives back as it unwinds (a system region's copy into copy memory, which the next
        request is lent) and on descriptors it closes then."""
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.executor, contextvars.copy_context().run, fn, *args)
        self.running += 1
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            while not work.done():  # host work on bytes: it ends soon, cancelled again or not
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([work])
            raise
        finally:
            self.running -= 1
            # `fn`'s error keeps its frames, and so the bytes it worked on; this frame, in its
            # traceback, must not keep the future that holds it (a cycle the collector, run
            # rarely in a serving process, would be left to find)
            del work


BINARY = OffLoop(1 << 20, None, alone_bytes=4 << 20)
JSON = OffLoop(512 << 10, ThreadPoolExecutor(max_workers=2, thread_name_prefix="moe-json"))


def working() -> bool:
    """Whether a request's host work runs on a thread now: a loop kept awake (service/awake.py)
    would hold the GIL that the thread takes back after each call that lets it go (torch's, a
    CUDA wait), a switch interval each time."""
    return bool(BINARY.running or JSON.running)
