"""The one wrapper around every gRPC call: what HTTP's middleware and body reader do, for gRPC.

grpc.aio reads a unary call's whole request message before its handler runs, and holds what has
arrived of it for as long as the client takes. So each served RPC is handed to grpc.aio as a
request-streaming one, whose handler runs as soon as the call's metadata is in: the call is
refused before a byte of its message is held when

- the RPC is one moe-serve does not serve (UNIMPLEMENTED, quietly);
- it lacks the bearer token (every RPC but ServerLive and ServerReady);
- the server is draining after SIGTERM (every RPC but the probes: UNAVAILABLE);
- MOE_SERVE_MAX_CONNECTIONS calls are in flight already (RESOURCE_EXHAUSTED; probes exempt).

Then the message must arrive within MOE_SERVE_READ_TIMEOUT_S (else DEADLINE_EXCEEDED, and what
came of it is dropped), and large messages are parsed, and large replies printed, off the event
loop (service/off_loop.py). Every call gets a request id (metadata `x-request-id`) and a log
line and counts in the request metrics; our errors answer as the gRPC status of GRPC_STATUS,
with the same message as over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextvars import ContextVar

import grpc
from google.protobuf.message import DecodeError, Message

from .. import logs
from ..auth import bearer_matches
from ..core.runtime import Runtime
from ..errors import (
    BadInput,
    Overloaded,
    RequestTimeout,
    ServiceError,
    ShuttingDown,
    Unauthorized,
    capped,
    grpc_status,
)
from ..off_loop import BINARY
from ..triton.shared_memory import owner_of

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
OPEN = frozenset({"ServerLive", "ServerReady"})  # answered without the bearer token
# answered while draining and beyond the cap on calls in flight, and not counted in it
PROBES = OPEN | {"ModelReady"}

# whose shared-memory regions the call may use (shared_memory.owner_of; None without a token)
caller: ContextVar[str | None] = ContextVar("caller", default=None)


class _Refused(Exception):
    """A call ended here with a status that is none of our errors'."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class CallGate(grpc.aio.ServerInterceptor):
    """Admits, reads, times and answers every call to the servicer's RPCs (`served`)."""

    def __init__(self, runtime: Runtime, served: Collection[str]) -> None:
        settings = runtime.settings
        self.runtime = runtime
        self.served = frozenset(served)
        self.token = settings.api_token_bytes()
        self.read_timeout_s = settings.read_timeout_s
        self.max_calls = settings.max_connections
        self.in_flight = 0  # calls admitted and not yet answered, probes left out
        self.idle = asyncio.Event()  # set while in_flight is 0
        self.idle.set()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        service, _, rpc = details.method.lstrip("/").partition("/")
        if service != SERVICE:
            return await continuation(details)  # none: grpc answers UNIMPLEMENTED
        handler = await continuation(details) if rpc in self.served else None

        async def call(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            return await self._call(rpc, handler, requests, context)

        return grpc.stream_unary_rpc_method_handler(call)

    async def _call(
        self,
        rpc: str,
        handler: grpc.RpcMethodHandler | None,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> bytes:
        route = f"grpc {rpc}"
        request_id, authorization = _metadata(context)
        reset = logs.request_id.set(logs.new_request_id(request_id))
        caller.set(None if self.token is None else owner_of(authorization))
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        counted = False
        try:
            if handler is None:  # the stubs' own answer logs a traceback
                raise _Refused(grpc.StatusCode.UNIMPLEMENTED, f"moe-serve does not serve {rpc}")
            self._admit(rpc, authorization)
            if rpc not in PROBES:
                counted = True
                self.in_flight += 1
                self.idle.clear()
            raw = await self._message(requests)
            request = await BINARY.run(len(raw), _parse, handler.request_deserializer, raw)
            reply = await handler.unary_unary(request, context)
            return await BINARY.run(reply.ByteSize(), handler.response_serializer, reply)
        except ServiceError as err:
            code = grpc_status(err)
            await context.abort(code, capped(err.message))
        except _Refused as err:
            code = err.code
            await context.abort(code, str(err))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the client went away, or the drain cut it off
            raise
        except Exception:
            log.exception("unhandled error in %s", route)
            code = grpc.StatusCode.INTERNAL
            await context.abort(code, f"internal error; request id {logs.request_id.get()}")
        finally:
            if counted:
                self.in_flight -= 1
                if not self.in_flight:
                    self.idle.set()
            seconds = time.perf_counter() - started
            self.runtime.metrics.observe_request(route, code.name, seconds)
            log.info("%s -> %s in %.1f ms", route, code.name, seconds * 1e3)
            logs.request_id.reset(reset)

    def _admit(self, rpc: str, authorization: str) -> None:
        """Refuse, before its message is read, a call the server will not take now."""
        token = self.token
        if rpc not in OPEN and token is not None and not bearer_matches(authorization, token):
            raise Unauthorized("missing or wrong bearer token (metadata 'authorization')")
        if rpc in PROBES:
            return
        if self.runtime.drain_deadline is not None:
            raise ShuttingDown()
        if self.in_flight >= self.max_calls:
            raise Overloaded(
                f"{self.in_flight} calls are in flight, the most this server takes at once "
                "(MOE_SERVE_MAX_CONNECTIONS); retry"
            )

    async def _message(self, requests: AsyncIterator[bytes]) -> bytes:
        """The call's one request message, within the read timeout. A read cut short would free
        what grpc core may still write into, so a late one is left to end with the call."""
        reading = asyncio.ensure_future(anext(requests, None))
        try:
            await asyncio.wait([reading], timeout=self.read_timeout_s)
        finally:
            if not reading.done():
                reading.add_done_callback(_retrieve)
        if not reading.done():
            raise RequestTimeout(
                f"the request message did not arrive within {self.read_timeout_s:g} s "
                "(MOE_SERVE_READ_TIMEOUT_S)"
            )
        raw = reading.result()
        if raw is None:
            raise BadInput("the call carried no request message")
        return raw


def _metadata(context: grpc.aio.ServicerContext) -> tuple[str, str]:
    """The call's (x-request-id, authorization) metadata, "" where absent: one pass."""
    request_id = authorization = ""
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and not request_id:
            request_id = value
        elif key == "authorization" and not authorization:
            authorization = value
    return request_id, authorization


def _parse(deserialize: Callable[[bytes], Message], raw: bytes) -> Message:
    try:
        return deserialize(raw)
    except DecodeError as err:  # not the RPC's message, or a string field that is not UTF-8
        raise BadInput(f"the request message cannot be parsed: {err}") from None


def _retrieve(reading: asyncio.Future) -> None:
    """Take the outcome of a read that ended after its call did (else asyncio logs it)."""
    if not reading.cancelled():
        reading.exception()
