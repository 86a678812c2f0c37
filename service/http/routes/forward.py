"""POST /v1/layers/{name}/forward: JSON for humans and curl, a safetensors blob for clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Annotated

import torch
from fastapi import APIRouter, Query, Request, Response
from starlette.types import Receive, Scope, Send

from ....kernels.layer import LayerOutput
from ....kernels.tensors import ForwardInputs
from ...codecs import json_device, json_numbers, json_tensors
from ...codecs.safetensors_wire import (
    decode_safetensors,
    run_sized,
    safetensors_head,
    safetensors_parts,
    tensor_bytes,
)
from ...core.inputs import check_inputs
from ...engine.batcher import DynamicBatcher, RequestOptions
from ...engine.engine import ServedLayer
from ...errors import BadInput, ServiceError, UnsupportedMediaType
from ...metrics import Metrics
from ..deps import (
    BatcherDep,
    BodyDep,
    EngineDep,
    MetricsDep,
    PinnedBody,
    Runtime,
    submit_unless,
    submit_unless_withdrawn,
    submit_while_connected,
)
from ..examples import DEMO_LOGITS, DEMO_ROWS
from ..plain_forward import BINARY, FORWARD_PATH, JSON
from ..schemas import ErrorBody, ForwardRequest, ForwardResponse, inline_json_schema
from ..server import client_gone

router = APIRouter(tags=["forward"])

TENSOR_NAMES = ("hidden_states", "router_logits")

_ERRORS = {
    status: {"model": ErrorBody, "description": what}
    for status, what in {
        400: "bad input: wrong shape, H or E, NaN/Inf, ragged or empty arrays, dtype, blob",
        401: "missing or wrong bearer token",
        404: "no layer of that name",
        413: "body over the size limit",
        415: "content type is neither application/json nor application/octet-stream",
        422: "JSON body does not match the schema",
        429: "the layer's queue is full; retry after Retry-After seconds",
        503: "not ready (loading), shutting down, or the request's timeout passed in the queue",
    }.items()
}

_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {
            JSON: {
                "schema": inline_json_schema(ForwardRequest),
                "examples": {
                    "stored router": {"value": {"hidden_states": DEMO_ROWS}},
                    "client logits": {
                        "value": {
                            "hidden_states": DEMO_ROWS[:1],
                            "router_logits": DEMO_LOGITS,
                            "return_routing": True,
                        }
                    },
                },
            },
            BINARY: {
                "schema": {"type": "string", "format": "binary"},
                "description": "safetensors blob: hidden_states [T, H] (and optionally "
                "router_logits [T, E]) in float32, bfloat16 or float16. The reply is a "
                "safetensors blob with output [T, H] in the same dtype.",
            },
        },
    }
}


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _load_blob(body: bytes) -> dict:
    try:
        tensors = decode_safetensors(body)
    except ValueError as err:
        raise BadInput(f"body is not a valid safetensors blob: {err}") from None
    unknown = sorted(set(tensors) - set(TENSOR_NAMES))
    if unknown:
        listed = ", ".join(unknown[:3]) + (
            f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        )
        raise BadInput(f"unknown tensors in the blob: {listed}; expected {list(TENSOR_NAMES)}")
    if "hidden_states" not in tensors:
        raise BadInput("the blob has no hidden_states tensor")
    return tensors


@router.post(
    FORWARD_PATH,
    summary="Run the MoE block on hidden states (JSON or safetensors body)",
    response_model=ForwardResponse,
    responses={
        200: {"content": {BINARY: {"schema": {"type": "string", "format": "binary"}}}},
        **_ERRORS,
    },
    openapi_extra=_OPENAPI,
)
async def forward(
    name: str,
    request: Request,
    body: BodyDep,
    engine: EngineDep,
    batcher: BatcherDep,
    metrics: MetricsDep,
    return_routing: bool = False,
    priority: Annotated[
        int, Query(ge=0, description="1 goes first, then 2, ...; 0: the default, after all")
    ] = 0,
    timeout: Annotated[
        int,
        Query(ge=0, description="microseconds the request may wait in the queue; 0: no limit"),
    ] = 0,
) -> Response:
    """The routed experts, weighted and summed, plus shared experts where the layer has them.

    Without router_logits the layer's stored router (and bias) computes them. A binary reply
    also carries topk_ids and topk_weights when `?return_routing=true`. `priority` and `timeout`
    follow KServe/Triton's schedule policy: a request still queued after `timeout`
    microseconds gets 503 and none of it runs.
    """
    call = LayerCall(engine.get(name), batcher, metrics)
    media = _media_type(request)
    options = schedule_options(priority, timeout)
    if media == JSON:
        return await forward_json(request, call, body, options)
    if media == BINARY:
        return await forward_binary(request, call, body, options, return_routing)
    raise UnsupportedMediaType(
        f"content type {media or '(none)'!r} is not accepted; send {JSON} or {BINARY}"
    )


@dataclass(frozen=True)
class LayerCall:
    """What one forward of a layer goes through: the layer, the batcher that runs it, the
    metrics that count it."""

    served: ServedLayer
    batcher: DynamicBatcher
    metrics: Metrics

    @classmethod
    def of(cls, runtime: Runtime, name: str) -> LayerCall:
        """Layer `name` of a ready runtime (UnknownLayer, 404, if it has none)."""
        return cls(runtime.engine.get(name), runtime.batcher, runtime.metrics)


async def forward_json(
    request: Request, call: LayerCall, body: bytes, options: RequestOptions
) -> Response:
    """A JSON body -> the JSON reply (also run by service/http/fast_path.py). On a GPU engine a
    large body is parsed, and its 16-bit output printed, on the device
    (service/codecs/json_device.py)."""
    served, metrics = call.served, call.metrics
    device = call.batcher.engine.device
    if device.type != "cuda" or not json_device.worth_it(len(body)):
        device = None
    # A large body's numbers take tens of ms to parse and print on the host: off the event loop.
    started = time.perf_counter()
    inputs, want_routing = await json_numbers.run_sized(
        len(body), _decode_json, served, body, device
    )
    metrics.observe_stage(served.name, "decode", time.perf_counter() - started)
    hidden = inputs.hidden_states
    into = torch.empty_like(hidden, dtype=served.config.dtype) if hidden.is_cuda else None
    result = await submit_while_connected(request, call.batcher, served.name, inputs, options, into)
    started = time.perf_counter()
    numbers = result.output.numel() + (2 * result.routing.topk_ids.numel() if want_routing else 0)
    reply = await json_numbers.run_sized(
        numbers * json_numbers.NUMBER_BYTES, _encode_json, served, result, want_routing
    )
    metrics.observe_stage(served.name, "encode", time.perf_counter() - started)
    return Response(reply, media_type=JSON)


async def forward_binary(
    request: Request,
    call: LayerCall,
    body: bytes,
    options: RequestOptions,
    return_routing: bool = False,
) -> Response:
    """A safetensors body -> the reply blob (also run by service/http/fast_path.py)."""
    gone = partial(client_gone, request.receive)
    parts = await serve_blob(call, body, options, return_routing, gone)
    return BlobResponse(parts)


async def forward_pinned(request: Request, call: LayerCall, pinned: PinnedBody) -> Response:
    """A safetensors body in pinned memory -> the reply written after it (service/http/fast_path.py
    on a GPU engine): the body goes to the device and the output comes back with no host copy
    where the request's dtype is the layer's."""
    watch = asyncio.ensure_future(client_gone(request.receive))
    try:
        size = await serve_blob_into(call, pinned.body, pinned.reply, True, watch)
    finally:
        watch.cancel()
    return BlobResponse([pinned.reply[:size]])  # its memoryview holds the pinned block till sent


async def serve_blob(
    call: LayerCall,
    body: bytes | memoryview,
    options: RequestOptions,
    return_routing: bool,
    gone: Callable[[], Awaitable[None]],
) -> list[bytes | memoryview]:
    """A safetensors body -> the reply blob's pieces; withdrawn if `gone()` returns first."""
    served, metrics = call.served, call.metrics
    name = served.name
    started = time.perf_counter()
    inputs = await run_sized(len(body), lambda: _decode_blob(served, body))
    metrics.observe_stage(name, "decode", time.perf_counter() - started)
    result = await submit_unless(call.batcher, name, inputs, options, gone)
    return await _encode_timed(call, result, inputs.hidden_states.dtype, return_routing)


async def serve_blob_into(
    call: LayerCall,
    body: memoryview,
    reply: memoryview,
    pinned: bool,
    withdrawn: asyncio.Future,
    layer_dtype: bool = False,
) -> int:
    """A safetensors body -> its reply blob written into `reply`; the reply's size. `pinned`:
    both lie in memory registered with CUDA; `withdrawn` done: the client went away (see
    submit_unless_withdrawn); `layer_dtype`: the output in the layer's dtype, not the request's
    (a front end writes it as JSON in that dtype's shortest form).

    Where the engine runs batches on a GPU and the request's dtype is the layer's, the body is
    copied to the device from where it lies and the output from the device straight into
    `reply` (only the small header is written here); elsewhere the reply is encoded and copied
    in."""
    served, batcher, metrics = call.served, call.batcher, call.metrics
    name = served.name
    started = time.perf_counter()
    inputs = await run_sized(len(body), lambda: _decode_blob(served, body))
    metrics.observe_stage(name, "decode", time.perf_counter() - started)
    hidden = inputs.hidden_states
    options = RequestOptions()
    if not (pinned and batcher.engine.enqueues and hidden.dtype == served.config.dtype):
        result = await submit_unless_withdrawn(batcher, name, inputs, options, withdrawn)
        wire = served.config.dtype if layer_dtype else hidden.dtype
        parts = await _encode_timed(call, result, wire, False)
        size = sum(map(len, parts))
        _check_fits(size, len(reply))
        await run_sized(size, lambda: _copy_parts(parts, reply))
        return size
    tokens, width = hidden.shape
    head = _reply_head(served.name, served.backend, hidden.dtype, tokens, width)
    size = len(head) + hidden.numel() * hidden.element_size()
    _check_fits(size, len(reply))
    reply[: len(head)] = head
    output = torch.frombuffer(reply, dtype=hidden.dtype, count=hidden.numel(), offset=len(head))
    output = output.view(tokens, width)  # [T, H], after the header
    await submit_unless_withdrawn(batcher, name, inputs, options, withdrawn, output)
    return size


async def _encode_timed(
    call: LayerCall, result: LayerOutput, wire: torch.dtype, return_routing: bool
) -> list[bytes | memoryview]:
    started = time.perf_counter()
    parts = await run_sized(
        result.output.numel() * wire.itemsize,
        lambda: _encode_blob(call.served, result, wire, return_routing),
    )
    call.metrics.observe_stage(call.served.name, "encode", time.perf_counter() - started)
    return parts


def _check_fits(size: int, room: int) -> None:
    if size > room:
        raise ServiceError(f"the reply of {size} bytes does not fit its {room}-byte room")


def _copy_parts(parts: list[bytes | memoryview], out: memoryview) -> None:
    at = 0
    for part in parts:
        out[at : at + len(part)] = part
        at += len(part)


class BlobResponse(Response):
    """A safetensors reply sent as its pieces, one ASGI message each: the tensors' bytes are
    never joined into one copy (a 917 KB reply's join was a tenth of the event loop's time)."""

    media_type = BINARY

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        super().__init__(None, headers={"content-length": str(sum(map(len, parts)))})
        self.parts = parts

    async def __call__(self, _scope: Scope, _receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send(start | {"headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})


def schedule_options(priority: int, timeout_us: int) -> RequestOptions:
    """KServe/Triton schedule-policy values -> the batcher's options (0: the default)."""
    return RequestOptions(priority, timeout_us / 1e6 if timeout_us else None)


def _decode_blob(served: ServedLayer, body: bytes | memoryview) -> ForwardInputs:
    tensors = _load_blob(body)
    return check_inputs(served, tensors["hidden_states"], tensors.get("router_logits"))


def _encode_blob(
    served: ServedLayer, result: LayerOutput, wire: torch.dtype, routing: bool
) -> list[bytes | memoryview]:
    output = result.output.to(wire)  # the request's dtype (no copy when it is the layer's)
    if not routing:  # the usual reply: its header made once per shape
        head = _reply_head(served.name, served.backend, wire, *output.shape)
        return [head, tensor_bytes(output)]
    out = {"output": output}
    out |= {"topk_ids": result.routing.topk_ids, "topk_weights": result.routing.topk_weights}
    return safetensors_parts(out, _reply_metadata(served.name, served.backend, len(output)))


def _reply_metadata(layer: str, backend: str, tokens: int) -> dict[str, str]:
    return {"layer": layer, "backend": backend, "tokens": str(tokens)}


@lru_cache(maxsize=1024)
def _reply_head(layer: str, backend: str, dtype: torch.dtype, tokens: int, width: int) -> bytes:
    """The header of a reply written in place: the same for every request of a shape (its JSON
    was a tenth of the engine's time per forward from a front end)."""
    return safetensors_head(
        {"output": (dtype, [tokens, width])}, _reply_metadata(layer, backend, tokens)
    )


def _decode_json(
    served: ServedLayer, body: bytes, device: torch.device | None
) -> tuple[ForwardInputs, bool]:
    """`device`: parse there where json_device can (the host path decodes the rest, and names
    what is wrong)."""
    parsed = None if device is None else json_device.decode_forward(body, device)
    if parsed is not None:
        return check_inputs(served, parsed.hidden_states, None), parsed.return_routing
    decoded = json_tensors.decode_forward(body)
    inputs = check_inputs(served, decoded.hidden_states, decoded.router_logits)
    return inputs, decoded.return_routing


def _encode_json(served: ServedLayer, result: LayerOutput, routing: bool) -> bytes:
    """The reply as ForwardResponse describes it, written from the tensors' buffers (a 16-bit
    output still on the device printed there)."""
    output = result.output
    rest = {"layer": served.name, "tokens": output.shape[0], "backend": served.backend}
    if routing:
        rest |= {"topk_ids": result.routing.topk_ids, "topk_weights": result.routing.topk_weights}
    size = output.numel() * json_numbers.NUMBER_BYTES
    if output.is_cuda and output.element_size() == 2 and json_device.worth_it(size):
        return json_device.print_reply(output, rest)
    return json_tensors.dumps({"output": output} | rest)
