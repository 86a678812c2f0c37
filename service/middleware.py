"""Per-request plumbing as one pure ASGI middleware: request id, bearer auth, the log line and
the request metrics. (Starlette's BaseHTTPMiddleware would spawn a task per request.)"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import logs
from service.errors import error_response
from service.metrics import Metrics

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's id is echoed and logged

# Probes and scrapes answer without the bearer token: orchestrators and Prometheus hold none.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready"})


class RequestMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics, token: bytes | None) -> None:
        self.app = app
        self.metrics = metrics
        self.token = token  # None: no auth

    def _authorized(self, scope: Scope, headers: Headers) -> bool:
        if self.token is None or scope["path"] in OPEN_PATHS:
            return True
        scheme, _, given = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), self.token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given = headers.get("x-request-id", "")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex  # no log injection
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
            if self._authorized(scope, headers):
                await self.app(scope, receive, send_with_id)
            else:
                denied = error_response(
                    401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
                )
                await denied(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            if status:  # the response has begun: nothing more can be said to the client
                raise
            failed = error_response(500, f"internal error; request id {rid}")
            await failed(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            label = getattr(scope.get("route"), "path", "unmatched")  # the route's template
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.request_seconds.labels(label).observe(seconds)
            log.info(
                "%s %s -> %d in %.1f ms", scope["method"], scope["path"], status, seconds * 1e3
            )
            logs.request_id.reset(reset)
