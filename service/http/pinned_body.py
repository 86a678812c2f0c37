"""A plain binary forward's body read by the connection into pinned host memory, in one process
on a GPU: the engine copies it to the device, and the output back, from where they lie."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Scope

from ...kernels.arith import round_up
from ..auth import bearer_matches
from ..core.runtime import Runtime
from ..frontends.arena import BLOCK_BYTES, REPLY_HEADER_BYTES
from .direct_body import DIRECT_BODY, BodySink, BodyTarget, DirectBody
from .plain_forward import plain_binary_forward


@dataclass(frozen=True)
class PinnedBody:
    """A request body read into pinned host memory with room after it for the reply: a GPU
    engine copies the body to the device and the output back from where they lie."""

    body: memoryview
    reply: memoryview


# Bodies between these are read into pinned memory. A smaller body is staged faster by the
# batch's one host copy than a pinned block comes from torch's cache (`bench/request_path.py`,
# engine against engine-pinned); a larger one is read as bytes, since the cache keeps every block
# it ever handed out.
PINNED_BODY_MIN, PINNED_BODY_MAX = 256 << 10, 64 << 20


def pinned_body_sink(runtime: Runtime) -> BodySink:
    """Where the connection reads a plain binary forward's body in one process on a GPU: pinned
    host memory (torch's caching host allocator: a block is reused once the device is done with
    it) with room after it for the reply; None (the app reads it as bytes) for every other
    request, a body the app will refuse (over its limit, compressed, without the token), or a
    size outside PINNED_BODY_MIN/MAX."""
    settings = runtime.settings
    token = settings.api_token_bytes()

    def target(scope: Scope, size: int) -> BodyTarget[PinnedBody] | None:
        engine = runtime.engine
        if engine is None or not engine.enqueues or not PINNED_BODY_MIN <= size <= PINNED_BODY_MAX:
            return None
        if size > settings.max_body_bytes or plain_binary_forward(scope) is None:
            return None
        headers = Headers(scope=scope)
        if headers.get("content-encoding", "identity").strip().lower() != "identity":
            return None
        if token is not None and not bearer_matches(headers.get("authorization", ""), token):
            return None
        room = round_up(size, BLOCK_BYTES)
        memory = torch.empty(room + size + REPLY_HEADER_BYTES, dtype=torch.uint8, pin_memory=True)
        view = memoryview(memory.numpy())
        pinned = PinnedBody(view[:size], view[room:])
        return BodyTarget(pinned.body, pinned)

    return target


async def get_pinned_body(request: Request, runtime: Runtime) -> PinnedBody | None:
    """The body the connection read into pinned memory (`pinned_body_sink`), or None where it
    did not: the app reads it as bytes (service/http/body.py)."""
    direct: DirectBody[PinnedBody] | None = request.scope.get(DIRECT_BODY)
    if direct is None:
        return None
    return await direct.read(runtime.settings.read_timeout_s)
