"""A plain forward's body read by the connection straight into the memory it is served from, in
one process (`service/http/direct_body.py`): it skips uvicorn's chunks, each copied several times
on the event loop on its way to the app.

The memory is copy memory (service/engine/copy_memory.py), a block per request kept for the next
ones, with room after the body for the reply; it goes back once the reply is sent.

- On a GPU it is pinned: the engine copies a binary body to the device and the output back from
  where they lie, and reads a JSON body there (service/codecs/json_device.py), printing its
  reply into the room after it.
- Elsewhere, only a JSON body large enough that its JSON work leaves the event loop is read
  into it (a mapping of its own per request would cost a page fault per page of body each time);
  its reply is printed on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Scope

from ...kernels.arith import round_up
from ..auth import bearer_matches
from ..core.runtime import Runtime
from ..frontends.arena import BLOCK_BYTES, REPLY_HEADER_BYTES
from ..off_loop import JSON
from .direct_body import DIRECT_BODY, BodySink, BodyTarget, DirectBody
from .plain_forward import BINARY, plain_forward


@dataclass(frozen=True)
class ForwardBody:
    """A request body read into copy memory and, on a GPU, the room after it for the reply
    (None elsewhere: the reply is printed on the host)."""

    body: memoryview
    reply: memoryview | None


# Binary bodies between these are read into pinned memory. A smaller body is staged faster by the
# batch's one host copy than it is copied to the device alone (`bench/request_path.py`, engine
# against engine-pinned); a larger one is read as bytes, as a larger JSON body is: a block of
# copy memory is a power of two of about twice the body. JSON bodies are read into pinned memory
# up to PINNED_BODY_MAX too.
PINNED_BODY_MIN, PINNED_BODY_MAX = 256 << 10, 64 << 20


def forward_body_sink(runtime: Runtime) -> BodySink:
    """Where the connection reads a plain forward's body in one process (the module's
    docstring); None (the app reads it as bytes) for every other request, a body the app will
    refuse (over its limit, compressed, without the token), a binary body off a GPU or outside
    PINNED_BODY_MIN/MAX, or a JSON body whose work stays on the event loop."""
    settings = runtime.settings
    token = settings.api_token_bytes()
    binary_limit = min(PINNED_BODY_MAX, settings.max_body_bytes)
    json_limit = min(settings.max_json_bytes, settings.max_body_bytes)
    pinned_json_limit = min(json_limit, PINNED_BODY_MAX)
    memory = runtime.shared_memory.copy_memory

    def target(scope: Scope, size: int) -> BodyTarget[ForwardBody] | None:
        engine = runtime.engine
        plain = plain_forward(scope)
        if engine is None or plain is None:
            return None
        pinned = engine.enqueues  # the engine runs batches on a GPU
        if plain[1] == BINARY:
            fits = pinned and PINNED_BODY_MIN <= size <= binary_limit
        else:
            fits = JSON.on_loop_bytes < size <= (pinned_json_limit if pinned else json_limit)
        if not fits:
            return None
        headers = Headers(scope=scope)
        if headers.get("content-encoding", "identity").strip().lower() != "identity":
            return None
        if token is not None and not bearer_matches(headers.get("authorization", ""), token):
            return None
        if pinned:  # the reply as large as the body allows, as in a front end's arena
            room = round_up(size, BLOCK_BYTES)
            view = memory.lend_view(room + size + REPLY_HEADER_BYTES, pinned=True)
            held = ForwardBody(view[:size], view[room:])
        else:
            held = ForwardBody(memory.lend_view(size, pinned=False), None)
        return BodyTarget(held.body, held)

    return target


async def get_forward_body(request: Request, runtime: Runtime) -> ForwardBody | None:
    """The body the connection read into memory of its own (`forward_body_sink`), or None where
    it did not: the app reads it as bytes (service/http/body.py)."""
    direct: DirectBody[ForwardBody] | None = request.scope.get(DIRECT_BODY)
    if direct is None:
        return None
    return await direct.read(runtime.settings.read_timeout_s)
