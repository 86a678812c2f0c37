"""The errors a request can end in, each with its HTTP status, and the one error body.

Every error answers `{"error": "<message>"}` (the KServe v2 shape). Bad input is a 4xx that
names the tensor or field; a 500 means a bug or a failed forward, never bad input.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..weights.errors import describe_validation_error

log = logging.getLogger(__name__)


class ServiceError(Exception):
    status: int = 500

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadInput(ServiceError):
    status = 400


class Unauthorized(ServiceError):
    status = 401


class Forbidden(ServiceError):
    status = 403


class UnknownLayer(ServiceError):
    status = 404


def no_layer(name: str, served: Iterable[str]) -> UnknownLayer:
    """The 404 of a layer (a model) `name` that is not among those `served`."""
    known = ", ".join(sorted(served)) or "none"
    return UnknownLayer(f"no layer named {name!r}; served layers: {known}")


class RequestTimeout(ServiceError):
    """The body did not arrive in time; the connection is closed (the rest is not read)."""

    status = 408

    def __init__(self, message: str) -> None:
        super().__init__(message, {"Connection": "close"})


class ClientDisconnected(ServiceError):
    """The client closed the connection before its body arrived, or while its request waited
    (then withdrawn from the queue): no one reads the answer, but the log line and the metrics
    say what happened (499, as nginx counts it), not a 500."""

    status = 499


def body_stalled(timeout_s: float, arrived: int) -> RequestTimeout:
    return RequestTimeout(
        f"the request body did not arrive within {timeout_s:g} s ({arrived} bytes came)"
    )


def body_cut(arrived: int) -> ClientDisconnected:
    return ClientDisconnected(f"the client closed the connection after {arrived} bytes of the body")


class UnknownRegion(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


class PayloadTooLarge(ServiceError):
    status = 413


class UnsupportedMediaType(ServiceError):
    status = 415


class Overloaded(ServiceError):
    status = 429


class NotReady(ServiceError):
    status = 503


class ShuttingDown(NotReady):
    """SIGTERM: refused while draining, or cut off when the drain timeout passed."""

    RETRY_AFTER_S = "1"  # another replica, or this one restarted, can serve it

    def __init__(self, message: str = "the server is shutting down") -> None:
        super().__init__(message, {"Retry-After": self.RETRY_AFTER_S})


class DeadlineExceeded(ServiceError):
    """The request's `timeout` passed while it waited in the queue; none of it ran. 503, as
    Triton answers a request its schedule policy timed out (UNAVAILABLE)."""

    status = 503


class Unprocessable(ServiceError):
    """Request parameters that fail their validation, named as FastAPI names them."""

    status = 422


class NonFiniteOutput(ServiceError):
    """The layer's output for this request holds NaN or Inf. Weights are checked finite at load
    and inputs before batching, so the inputs overflowed the layer's arithmetic (or a kernel is
    wrong); either way it is never sent as a result. Other requests of its batch are served."""

    status = 422


class ForwardFailed(ServiceError):
    """The kernel raised on a batch: every request in that batch gets this, the server stays up."""

    status = 500


MAX_MESSAGE_CHARS = 2000  # a hostile request must not buy a megabyte-long error (or log line)


def capped(message: str) -> str:
    """`message`, cut to MAX_MESSAGE_CHARS with a note of how much was left out, and sendable:
    a character UTF-8 cannot encode (a lone surrogate from a client's JSON escape) is written as
    its escape, never a failure to answer."""
    if len(message) > MAX_MESSAGE_CHARS:
        more = len(message) - MAX_MESSAGE_CHARS
        message = f"{message[:MAX_MESSAGE_CHARS]}… ({more} more characters)"
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error": capped(message)}, status_code=status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, err: ServiceError) -> JSONResponse:
        return error_response(err.status, err.message, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(422, describe_validation_error(err, "body"))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException) -> JSONResponse:
        return error_response(err.status_code, str(err.detail), err.headers)


# The gRPC status of each error (KServe v2 over gRPC); a subclass takes its base's.
GRPC_STATUS: dict[type[ServiceError], grpc.StatusCode] = {
    BadInput: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    UnknownLayer: grpc.StatusCode.NOT_FOUND,
    RequestTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    ClientDisconnected: grpc.StatusCode.CANCELLED,
    UnknownRegion: grpc.StatusCode.NOT_FOUND,
    Conflict: grpc.StatusCode.ALREADY_EXISTS,
    PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnsupportedMediaType: grpc.StatusCode.INVALID_ARGUMENT,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    Unprocessable: grpc.StatusCode.INVALID_ARGUMENT,
    NonFiniteOutput: grpc.StatusCode.INVALID_ARGUMENT,  # the inputs overflowed the layer: 422
    ServiceError: grpc.StatusCode.INTERNAL,  # ForwardFailed, and any 500
}


def grpc_status(err: ServiceError) -> grpc.StatusCode:
    return next(GRPC_STATUS[cls] for cls in type(err).__mro__ if cls in GRPC_STATUS)
