"""KServe v2 inference over HTTP without FastAPI's routing and dependency solving.

`POST /v2/models/{name}/infer` (and `/versions/{version}/infer`) is the request tritonclient
sends in a loop; FastAPI's routing, dependency solving and exception middleware took 0.15 ms
of the 0.55-0.65 ms a one-token infer request spent in the server outside `inference.infer`
(binary or system shared memory, a 2-core CI machine). As service/http/fast_path.py does for the
binary forward, this middleware runs the routes' own work (`routes.kserve.infer_response`: the
same body reading, decoding, inference and reply) for exactly those requests; every other
request goes on to the app. It sits inside RequestMiddleware and the tracing middleware, so the
token, request id, log line, request metrics and request span are the same.
"""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import ServiceError, error_response
from .deps import Runtime, get_body
from .routes import kserve

INFER_PATH = "/v2/models/{name}/infer"
VERSION_INFER_PATH = "/v2/models/{name}/versions/{version}/infer"
# the two routes' paths as Starlette matches them (a path parameter is one segment)
_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class KServeInferFastPath:
    def __init__(self, app: ASGIApp, runtime: Runtime, routes: list[BaseRoute]) -> None:
        self.app = app
        self.runtime = runtime
        by_path = {getattr(r, "path", None): r for r in routes}
        # the routes it stands in for, by path (the request metrics' label)
        self.routes = {p: by_path[p] for p in (INFER_PATH, VERSION_INFER_PATH)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        matched = None
        if scope["type"] == "http" and scope["method"] == "POST":
            matched = _PATH.fullmatch(scope["path"])
        if matched is None:
            await self.app(scope, receive, send)
            return
        name, version = matched.groups()
        scope["route"] = self.routes[INFER_PATH if version is None else VERSION_INFER_PATH]
        request = Request(scope, receive)
        try:
            body = await get_body(request, self.runtime)  # in the routes' dependency order
            response = await kserve.infer_response(name, version or "", request, body, self.runtime)
        except ServiceError as err:
            response = error_response(err.status, err.message, err.headers)
        await response(scope, receive, send)
