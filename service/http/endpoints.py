"""The hot routes, answered before FastAPI's routing.

A client library sends the /v1 forward or a KServe infer request in a loop, and FastAPI's
routing, dependency solving, request wrapping and exception middleware cost about as much host
time as a binary forward's decode, checks and encode together (`bench/request_path.py`: blob
against http). So those routes are endpoints: one ASGI callable each that does the route's whole
work (the body, the checks, the core's call, the reply, an error as the error body), which this
middleware hands every request of the route's method and path. FastAPI only documents them, from
their declarations. It sits inside RequestMiddleware and the tracing middleware, so the token,
request id, log line, request metrics and request span are those of any route.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send


class Endpoint(Protocol):
    # the route's POST paths, a group per path parameter (a parameter is one segment)
    path: re.Pattern[str]

    async def __call__(self, scope: Scope, receive: Receive, send: Send, *params: str) -> None:
        """Answer the request; `params` are the path's parameters (None: a path without it)."""


class Endpoints:
    def __init__(self, app: ASGIApp, endpoints: Sequence[Endpoint]) -> None:
        self.app = app
        self.endpoints = tuple(endpoints)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            for endpoint in self.endpoints:
                matched = endpoint.path.fullmatch(path)
                if matched is not None:
                    await endpoint(scope, receive, send, *matched.groups())
                    return
        await self.app(scope, receive, send)
