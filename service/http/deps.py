"""What route handlers need, as typed dependencies: the engine, the batcher, the body."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Annotated, TypeVar

import torch
from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.types import Scope

from ...kernels.arith import round_up
from ...kernels.layer import LayerOutput
from ...kernels.tensors import ForwardInputs
from ..codecs.kserve import HEADER_LENGTH
from ..engine.batcher import DynamicBatcher, RequestOptions
from ..engine.engine import Engine
from ..errors import (
    BadInput,
    ClientDisconnected,
    NotReady,
    PayloadTooLarge,
    UnsupportedMediaType,
    body_cut,
    body_stalled,
    describe_validation_error,
)
from ..frontends.arena import BLOCK_BYTES, REPLY_HEADER_BYTES
from ..metrics import Metrics
from ..settings import Settings
from ..triton.shared_memory import SharedMemory
from .direct_body import DIRECT_BODY, BodySink, BodyTarget, DirectBody
from .middleware import bearer_matches
from .plain_forward import plain_binary_forward
from .server import client_gone

if TYPE_CHECKING:
    from ..frontends.supervisor import FrontEnds
    from ..triton.repository import Repository

RETRY_WHILE_LOADING_S = "5"
Body = TypeVar("Body", bound=BaseModel)
# Content-Encoding -> zlib window bits (None: not compressed)
_ZLIB_WBITS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


@dataclass
class Runtime:
    """The app's moving parts; engine and batcher appear once the layers are loaded and warm."""

    settings: Settings
    metrics: Metrics
    engine: Engine | None = None
    batcher: DynamicBatcher | None = None
    not_ready: str | None = "loading layers"  # None once ready
    degraded: str | None = None  # ready, but on fewer expert-parallel ranks (why)
    start_failed: bool = False  # loading or warming up the layers raised
    # What a failed start does besides answering 503: `moe-serve serve` stops the server.
    on_start_failure: Callable[[], None] = lambda: None
    shared_memory: SharedMemory = field(default_factory=lambda: SharedMemory(allowed=False))
    repository: Repository | None = None  # --model-repository
    warm_up_tokens: list[int] = field(default_factory=list)  # token counts a new layer runs
    front_ends: FrontEnds | None = None  # --http-workers


# Dependencies are `async def` although they never wait: FastAPI runs a plain `def` one on a
# worker thread, a thread hop per dependency per request.
async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def ready(runtime: Runtime) -> Runtime:
    """`runtime` once it can serve (engine and batcher set); NotReady (503) before."""
    if runtime.not_ready is not None:
        raise NotReady(f"not ready: {runtime.not_ready}", {"Retry-After": RETRY_WHILE_LOADING_S})
    return runtime


async def get_engine(runtime: RuntimeDep) -> Engine:
    return ready(runtime).engine


async def get_batcher(runtime: RuntimeDep) -> DynamicBatcher:
    return ready(runtime).batcher


async def get_metrics(runtime: RuntimeDep) -> Metrics:
    return runtime.metrics


def _body_limit(request: Request, settings: Settings) -> tuple[int, str]:
    """The byte limit of the request's body, and how to name it in a 413.

    JSON has its own, lower limit: decoding it holds the GIL (the event loop waits) and costs a
    few times its size in memory; binary bodies cost neither.
    """
    json_limit = settings.max_json_bytes
    binary_hint = (
        "send larger requests in binary: a safetensors blob (Content-Type: "
        "application/octet-stream) on /v1, binary tensors on /v2"
    )
    header = request.headers.get(HEADER_LENGTH)  # KServe: the JSON part's length
    if header is not None and header.isascii() and header.isdigit() and int(header) > json_limit:
        raise PayloadTooLarge(
            f"the JSON part of {header} bytes exceeds the {json_limit}-byte limit of JSON "
            f"(MOE_SERVE_MAX_JSON_BYTES); {binary_hint}"
        )
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "application/json" and header is None and json_limit < settings.max_body_bytes:
        return json_limit, (
            f"the {json_limit}-byte limit of a JSON body (MOE_SERVE_MAX_JSON_BYTES); {binary_hint}"
        )
    return settings.max_body_bytes, f"the {settings.max_body_bytes}-byte limit"


async def get_body(request: Request, runtime: RuntimeDep) -> bytes:
    """The request body (gzip/deflate undone), refused with 413 once it passes its limit."""
    limit, what = _body_limit(request, runtime.settings)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds {what}")
    chunks, size = [], 0
    timeout_s = runtime.settings.read_timeout_s
    try:
        async with asyncio.timeout(timeout_s):  # a client that stalls mid-body holds nothing long
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body exceeds {what}")
                chunks.append(chunk)
    except TimeoutError:
        raise body_stalled(timeout_s, size) from None
    except ClientDisconnect:
        raise body_cut(size) from None
    encoding = request.headers.get("content-encoding", "identity")
    return _decode(b"".join(chunks), encoding, limit, what)


@dataclass(frozen=True)
class PinnedBody:
    """A request body read into pinned host memory with room after it for the reply: a GPU
    engine copies the body to the device and the output back from where they lie."""

    body: memoryview
    reply: memoryview


# Bodies between these are read into pinned memory. A pinned block from torch's cache costs
# about 40 us (H100 host): a smaller body is staged faster by the batch's one host copy; a
# larger one is read as bytes, since the cache keeps every block it ever handed out.
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
    did not: the app reads it as bytes (`get_body`)."""
    direct: DirectBody[PinnedBody] | None = request.scope.get(DIRECT_BODY)
    if direct is None:
        return None
    return await direct.read(runtime.settings.read_timeout_s)


def _decode(body: bytes, encoding: str, limit: int, what: str) -> bytes:
    """Undo Content-Encoding (tritonclient can gzip or deflate), never inflating past `limit`."""
    encoding = encoding.strip().lower()
    if encoding not in _ZLIB_WBITS:
        accepted = ", ".join(_ZLIB_WBITS)
        raise UnsupportedMediaType(f"content encoding {encoding!r} is not accepted: {accepted}")
    if encoding == "identity":
        return body
    inflate = zlib.decompressobj(_ZLIB_WBITS[encoding])
    try:
        plain = inflate.decompress(body, limit + 1)
    except zlib.error as err:
        raise BadInput(f"body is not valid {encoding} data: {err}") from None
    if len(plain) > limit:
        raise PayloadTooLarge(f"request body inflates past {what}")
    if not inflate.eof:  # zlib returns what it could of a cut stream without complaint
        raise BadInput(f"body is truncated {encoding} data: the compressed stream ends early")
    return plain


def parse_body(model: type[Body], body: bytes) -> Body:
    """A JSON body as `model` (tritonclient sends no Content-Type), or a 400 naming the field."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as err:
        raise BadInput(f"request body: {describe_validation_error(err, 'body')}") from None


async def submit_while_connected(
    request: Request,
    batcher: DynamicBatcher,
    name: str,
    inputs: ForwardInputs,
    options: RequestOptions,
    output_into: torch.Tensor | None = None,
) -> LayerOutput:
    """batcher.submit, withdrawn (its waiting rows leave the queue) if the client goes away."""
    gone = partial(client_gone, request.receive)
    return await submit_unless(batcher, name, inputs, options, gone, output_into)


async def submit_unless(
    batcher: DynamicBatcher,
    name: str,
    inputs: ForwardInputs,
    options: RequestOptions,
    gone: Callable[[], Awaitable[None]],
    output_into: torch.Tensor | None = None,
) -> LayerOutput:
    """batcher.submit, withdrawn if `gone()` returns first (the client went away); a
    withdrawn request whose buffers the device uses (`output_into`, inputs on a GPU or in
    pinned memory) returns once the device is done with them."""
    watch = asyncio.ensure_future(gone())
    try:
        return await submit_unless_withdrawn(batcher, name, inputs, options, watch, output_into)
    finally:
        watch.cancel()


async def submit_unless_withdrawn(
    batcher: DynamicBatcher,
    name: str,
    inputs: ForwardInputs,
    options: RequestOptions,
    withdrawn: asyncio.Future,
    output_into: torch.Tensor | None = None,
) -> LayerOutput:
    """batcher.submit in the caller's own task: once `withdrawn` is done, that task is cancelled
    while it waits in batcher.submit (which then returns once the device is done with the
    request's buffers) and ClientDisconnected raised; a task cancelled from elsewhere stays
    cancelled. One task per request: a second task, a watcher and asyncio.wait per request cost
    the event loop 10 to 35 us more (bench/channel_bench.py, py-spy)."""
    task = asyncio.current_task()
    submitting, cancelled_here = True, False

    def withdraw(_: asyncio.Future) -> None:
        nonlocal cancelled_here
        if submitting and not cancelled_here:
            cancelled_here = True
            task.cancel()

    withdrawn.add_done_callback(withdraw)
    try:
        return await batcher.submit(name, inputs, options, output_into)
    except asyncio.CancelledError:
        if cancelled_here and task.uncancel() == 0:
            raise ClientDisconnected(
                f"the client went away; its request to layer {name!r} was withdrawn"
            ) from None
        raise
    finally:
        submitting = False
        withdrawn.remove_done_callback(withdraw)


EngineDep = Annotated[Engine, Depends(get_engine)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
BatcherDep = Annotated[DynamicBatcher, Depends(get_batcher)]
BodyDep = Annotated[bytes, Depends(get_body)]
