"""A plain forward's body read by the connection into pinned host memory, in one process on a GPU:
the engine copies a binary body to the device, and the output back, from where they lie, and
reads a large JSON body on the device (service/codecs/json_device.py) copied from where it
lies. The body skips uvicorn's chunks, each copied several times on the event loop on its way to
the app."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Scope

from ...kernels.arith import round_up
from ..auth import bearer_matches
from ..codecs import json_device
from ..core.runtime import Runtime
from ..frontends.arena import BLOCK_BYTES, REPLY_HEADER_BYTES
from .direct_body import DIRECT_BODY, BodySink, BodyTarget, DirectBody
from .plain_forward import BINARY, plain_forward


@dataclass(frozen=True)
class PinnedBody:
    """A request body read into pinned host memory; after a binary body, room for the reply
    (a GPU engine copies the body to the device and the output back from where they lie),
    None after a JSON body (its reply is printed into memory of its own)."""

    body: memoryview
    reply: memoryview | None


# Bodies between these are read into pinned memory. A smaller body is staged faster by the
# batch's one host copy than a pinned block comes from torch's cache (`bench/request_path.py`,
# engine against engine-pinned); a larger one is read as bytes, since the cache keeps every block
# it ever handed out.
PINNED_BODY_MIN, PINNED_BODY_MAX = 256 << 10, 64 << 20


def pinned_body_sink(runtime: Runtime) -> BodySink:
    """Where the connection reads a plain forward's body in one process on a GPU: pinned host
    memory (torch's caching host allocator: a block is reused once the device is done with it),
    with room after a binary body for the reply; None (the app reads it as bytes) for every
    other request, a body the app will refuse (over its limit, compressed, without the token),
    a binary body outside PINNED_BODY_MIN/MAX, or a JSON body the host reads (not
    json_device.worth_it) or over PINNED_BODY_MAX."""
    settings = runtime.settings
    token = settings.api_token_bytes()
    json_limit = min(settings.max_json_bytes, settings.max_body_bytes, PINNED_BODY_MAX)

    def target(scope: Scope, size: int) -> BodyTarget[PinnedBody] | None:
        engine = runtime.engine
        plain = plain_forward(scope)
        if engine is None or not engine.enqueues or plain is None:
            return None
        if plain[1] == BINARY:
            fits = PINNED_BODY_MIN <= size <= min(PINNED_BODY_MAX, settings.max_body_bytes)
        else:
            fits = json_device.worth_it(size) and size <= json_limit
        if not fits:
            return None
        headers = Headers(scope=scope)
        if headers.get("content-encoding", "identity").strip().lower() != "identity":
            return None
        if token is not None and not bearer_matches(headers.get("authorization", ""), token):
            return None
        if plain[1] == BINARY:
            room = round_up(size, BLOCK_BYTES)
            total = room + size + REPLY_HEADER_BYTES
            view = memoryview(torch.empty(total, dtype=torch.uint8, pin_memory=True).numpy())
            pinned = PinnedBody(view[:size], view[room:])
        else:
            view = memoryview(torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy())
            pinned = PinnedBody(view, None)
        return BodyTarget(pinned.body, pinned)

    return target


async def get_pinned_body(request: Request, runtime: Runtime) -> PinnedBody | None:
    """The body the connection read into pinned memory (`pinned_body_sink`), or None where it
    did not: the app reads it as bytes (service/http/body.py)."""
    direct: DirectBody[PinnedBody] | None = request.scope.get(DIRECT_BODY)
    if direct is None:
        return None
    return await direct.read(runtime.settings.read_timeout_s)
