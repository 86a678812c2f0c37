"""The plain forward (binary or JSON) without FastAPI's routing and dependency solving.

A plain forward (`service/http/plain_forward.py`) is the request a client library sends in a loop;
FastAPI's routing, dependency solving and request wrapping cost about as much host time as a
binary forward's decode, checks and encode together (0.4 ms of 0.8 ms on a 2-core CI machine,
py-spy). This middleware runs the route's own work (`routes.forward.forward_binary` and
`forward_json`, the same body reading, checks, batcher entry and reply) for exactly those
requests; everything else, that route with a query string included, goes on to the app. It sits
inside RequestMiddleware, so the token, request id, log line and request metrics are the same.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine.batcher import RequestOptions
from ..errors import ServiceError, error_response
from .deps import Runtime, get_body, get_pinned_body, ready
from .plain_forward import BINARY, FORWARD_PATH, plain_forward
from .routes.forward import LayerCall, forward_binary, forward_json, forward_pinned


class ForwardFastPath:
    def __init__(self, app: ASGIApp, runtime: Runtime, route: BaseRoute) -> None:
        self.app = app
        self.runtime = runtime
        self.route = route  # the forward route it stands in for (the request metrics' label)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        plain = plain_forward(scope)
        if plain is None:
            await self.app(scope, receive, send)
            return
        name, media = plain
        scope["route"] = self.route
        request = Request(scope, receive)
        try:
            pinned = await get_pinned_body(request, self.runtime)
            if pinned is None:
                body = await get_body(request, self.runtime)  # in the route's dependency order
            call = LayerCall.of(ready(self.runtime), name)
            if pinned is not None:
                response = await forward_pinned(request, call, pinned)
            else:
                run = forward_binary if media == BINARY else forward_json
                response = await run(request, call, body, RequestOptions())
        except ServiceError as err:
            response = error_response(err.status, err.message, err.headers)
        await response(scope, receive, send)


def forward_route(routes: list[BaseRoute]) -> BaseRoute:
    return next(r for r in routes if getattr(r, "path", None) == FORWARD_PATH)
