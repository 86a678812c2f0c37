"""Per-request plumbing as one pure ASGI middleware: request id, bearer auth, the 503 of a
connection beyond max_connections, the log line and the request metrics. (Starlette's
BaseHTTPMiddleware would spawn a task per request.)"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import logs
from ..auth import bearer_matches
from ..errors import ShuttingDown, error_response
from ..logs import new_request_id
from . import docs
from .route_methods import UNMATCHED
from .server import OVER_CAPACITY

if TYPE_CHECKING:
    from ..metrics import Metrics

log = logging.getLogger(__name__)

UNAUTHORIZED = "missing or wrong bearer token"

# Probes and scrapes answer without the bearer token: orchestrators and Prometheus hold none.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready"})


def authorized(path: str, headers: Headers, token: bytes | None) -> bool:
    """Whether a request may pass: no token is set, `path` is open (probes, scrapes, docs), or
    it carries the token's bearer."""
    if token is None or path in OPEN_PATHS or docs.is_docs(path):
        return True
    return bearer_matches(headers.get("authorization", ""), token)


def over_capacity(max_connections: int) -> Response:
    """The answer on a connection beyond max_connections (probes and scrapes still answer)."""
    return error_response(
        503,
        f"the server has {max_connections} connections open (MOE_SERVE_MAX_CONNECTIONS); retry",
        {"Retry-After": ShuttingDown.RETRY_AFTER_S, "Connection": "close"},
    )


class RequestMiddleware:
    def __init__(
        self, app: ASGIApp, metrics: Metrics, token: bytes | None, max_connections: int
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.token = token  # None: no auth
        self.max_connections = max_connections  # named in the 503 a connection beyond it gets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = new_request_id(headers.get("x-request-id", ""))
        reset = logs.request_id.set(rid)
        started = time.perf_counter()
        status = 0  # 0 until the response starts

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)["X-Request-ID"] = rid
            await send(message)

        try:
            if scope.get(OVER_CAPACITY) and scope["path"] not in OPEN_PATHS:
                await over_capacity(self.max_connections)(scope, receive, send_with_id)
            elif authorized(scope["path"], headers, self.token):
                await self.app(scope, receive, send_with_id)
            else:
                denied = error_response(401, UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})
                await denied(scope, receive, send_with_id)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when MOE_SERVE_DRAIN_TIMEOUT_S has
            # passed after SIGTERM (nothing else cancels a request). Answer instead of letting
            # uvicorn log a traceback and send a plain-text 500; the cancellation has done its
            # job once this request ends.
            if status:
                raise
            cut = ShuttingDown("the server shut down before this request finished; retry")
            await error_response(cut.status, cut.message, cut.headers)(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if status:  # the response has begun: nothing more can be said to the client
                raise
            failed = error_response(500, f"internal error; request id {rid}")
            await failed(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            self.metrics.observe_request(_route_label(scope), str(status), seconds)
            log.info(
                "%s %s -> %d in %.1f ms", scope["method"], scope["path"], status, seconds * 1e3
            )
            logs.request_id.reset(reset)


def _route_label(scope: Scope) -> str:
    """The template of the route that answered, the request metrics' label. FastAPI's router
    names the route in the scope for its own routes only: the Starlette ones it adds
    (/openapi.json, the docs' assets) leave just their endpoint there."""
    route = scope.get("route")
    if route is None and "endpoint" in scope:
        endpoint = scope["endpoint"]
        routes = getattr(scope.get("router"), "routes", ())
        route = next((r for r in routes if endpoint in _ends(r)), None)
    return getattr(route, "path", UNMATCHED)


def _ends(route: object) -> tuple[object, ...]:
    """What a route hands a request to: a Route's endpoint, a Mount's app."""
    return (getattr(route, "endpoint", None), getattr(route, "app", None))
