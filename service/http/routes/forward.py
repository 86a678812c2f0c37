"""POST /v1/layers/{name}/forward: JSON for humans and curl, a safetensors blob for clients.

The route is `ForwardEndpoint`, which service/http/endpoints.py hands every such request: the
body read, the checks, the forward (service/core/forward.py) and the reply, without FastAPI's
routing and dependency solving. FastAPI documents it from the declaration below.
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated
from urllib.parse import parse_qsl

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field, ValidationError
from starlette.types import Receive, Scope, Send

from ...core.forward import (
    MAX_SCHEDULE_VALUE,
    LayerCall,
    schedule_options,
    serve_blob,
    serve_blob_into,
    serve_json,
)
from ...core.runtime import Runtime, ready
from ...engine.batcher import RequestOptions
from ...errors import (
    ServiceError,
    Unprocessable,
    UnsupportedMediaType,
    describe_validation_error,
    error_response,
)
from ..body import read_body
from ..direct_body import DIRECT_BODY
from ..examples import DEMO_LOGITS, DEMO_ROWS
from ..forward_body import get_forward_body
from ..plain_forward import BINARY, FORWARD_PATH, JSON
from ..schemas import ErrorBody, ForwardRequest, ForwardResponse, inline_json_schema
from ..server import client_gone

router = APIRouter(tags=["forward"])

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


class ForwardQuery(BaseModel):
    """The route's query parameters (FastAPI documents them; ForwardEndpoint validates them)."""

    return_routing: bool = False
    priority: int = Field(
        0,
        ge=0,
        le=MAX_SCHEDULE_VALUE,
        description="1 goes first, then 2, ...; 0: the default, after all",
    )
    timeout: int = Field(
        0,
        ge=0,
        le=MAX_SCHEDULE_VALUE,
        description="microseconds the request may wait in the queue; 0: no limit",
    )


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
    name: str,  # noqa: ARG001 (a declaration: ForwardEndpoint answers)
    query: Annotated[ForwardQuery, Query()],  # noqa: ARG001
) -> Response:
    """The routed experts, weighted and summed, plus shared experts where the layer has them.

    Without router_logits the layer's stored router (and bias) computes them. A binary reply
    also carries topk_ids and topk_weights when `?return_routing=true`. `priority` and `timeout`
    follow KServe/Triton's schedule policy: a request still queued after `timeout`
    microseconds gets 503 and none of it runs.
    """
    raise AssertionError(f"ForwardEndpoint answers {FORWARD_PATH}, before FastAPI's routing")


class _Request(BaseModel):
    query: ForwardQuery  # errors name `query.<parameter>`, as FastAPI's do


_NO_QUERY = (False, RequestOptions())


def _query(raw: bytes) -> tuple[bool, RequestOptions]:
    """return_routing and the schedule options of a query string; 422 naming a bad one."""
    if not raw:
        return _NO_QUERY
    try:
        query = _Request(query=dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True)))
    except ValidationError as err:
        raise Unprocessable(describe_validation_error(err, "query")) from None
    return query.query.return_routing, schedule_options(query.query.priority, query.query.timeout)


class ForwardEndpoint:
    """The route's whole work, in the order FastAPI would run the declaration: the body (413,
    or pinned memory where the connection read it there), readiness (503), the query (422), the
    layer (404), the media type (415), then the forward, withdrawn if the client goes away."""

    path = re.compile(r"/v1/layers/([^/]+)/forward")

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        # the declaration: the request metrics' label
        self.route = next(r for r in router.routes if getattr(r, "path", None) == FORWARD_PATH)

    async def __call__(self, scope: Scope, receive: Receive, send: Send, name: str) -> None:
        scope["route"] = self.route
        request = Request(scope, receive)
        withdrawn = None
        try:
            held = await get_forward_body(request, self.runtime)
            body = await read_body(request, self.runtime) if held is None else held.body
            runtime = ready(self.runtime)
            return_routing, options = _query(scope["query_string"])
            call = LayerCall.of(runtime, name)
            media = _media_type(request)
            if media != BINARY and media != JSON:
                raise UnsupportedMediaType(
                    f"content type {media or '(none)'!r} is not accepted; send {JSON} or {BINARY}"
                )
            withdrawn = asyncio.ensure_future(client_gone(receive))
            if media == JSON:  # printed into the room after the body where it has one
                room = None if held is None else held.reply
                parts = await serve_json(call, body, options, withdrawn, room)
            elif held is not None:  # pinned, with room for the reply
                size = await serve_blob_into(call, held.body, held.reply, True, withdrawn)
                parts = [held.reply[:size]]  # its view holds the block until it is sent
            else:
                parts = await serve_blob(call, body, options, return_routing, withdrawn)
            response = PiecesResponse(parts, media)
        except ServiceError as err:
            response = error_response(err.status, err.message, err.headers)
        finally:
            if withdrawn is not None:
                withdrawn.cancel()
        try:
            await response(scope, receive, send)
        finally:
            # the connection keeps the scope until its next request: the body's block of copy
            # memory goes back once the reply is sent, not then
            scope.pop(DIRECT_BODY, None)


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


# A reply up to this size is joined and sent as one message: copying it costs the event loop less
# than a send of each piece (and the client a wake-up per piece).
JOIN_BYTES = 64 << 10


class PiecesResponse(Response):
    """A reply (a safetensors blob, or JSON) sent as its pieces, one ASGI message each: a large
    reply's bytes are never joined into one copy (the join would cost the event loop a copy of
    it); a small one is sent whole."""

    def __init__(self, parts: list[bytes | memoryview], media_type: str) -> None:
        size = sum(map(len, parts))
        super().__init__(None, headers={"content-length": str(size)}, media_type=media_type)
        self.parts = [b"".join(parts)] if size <= JOIN_BYTES and len(parts) > 1 else parts

    async def __call__(self, _scope: Scope, _receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send(start | {"headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})
