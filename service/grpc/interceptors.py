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

A stream (ModelStreamInfer) is admitted as a call is, but not counted; then each request it
carries is admitted, timed, logged and counted as a call of its own (the drain and the cap on
calls in flight refuse that request alone), runs beside the stream's others (up to
STREAM_IN_FLIGHT) and is answered in order, an error as that response's `error_message`. A
stream that stays silent for MOE_SERVE_READ_TIMEOUT_S with none of its requests in flight ends
(DEADLINE_EXCEEDED), as an idle keep-alive connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextvars import ContextVar

import grpc
from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2 as pb

from .. import logs, tracing
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

# a stream's requests in flight at once (HTTP/2's advised least of a connection's streams, RFC
# 9113, 6.5.2); beyond, the stream is read no further until its oldest is answered
STREAM_IN_FLIGHT = 100

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
        # each RPC's handler as wrapped here, made by its first call: a method's handler never
        # changes, and making it (the servicer's looked up, a closure, grpc's handler tuple)
        # cost every call as much as the rest of its admission
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        wrapped = self._handlers.get(details.method)
        if wrapped is not None:
            return wrapped
        service, _, rpc = details.method.lstrip("/").partition("/")
        if service != SERVICE:
            return await continuation(details)  # none: grpc answers UNIMPLEMENTED
        handler = await continuation(details) if rpc in self.served else None
        wrapped = self._wrap(rpc, handler)
        if handler is not None:  # not every unknown name a client sends: those stay unkept
            self._handlers[details.method] = wrapped
        return wrapped

    def _wrap(self, rpc: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
        """The handler grpc.aio runs for RPC `rpc` of the service (the servicer's `handler`, or
        None where it does not serve it)."""
        if handler is not None and handler.response_streaming:

            async def stream(
                requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
            ) -> AsyncIterator[bytes]:
                async for reply in self._stream(rpc, handler, requests, context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(stream)

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
            counted = self._count(rpc)
            request = await self._request(handler, requests)
            return await _serialized(handler, await handler.unary_unary(request, context))
        except ServiceError as err:
            code, details = grpc_status(err), capped(err.message)
        except _Refused as err:
            code, details = err.code, str(err)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the client went away, or the drain cut it off
            raise
        except Exception:
            log.exception("unhandled error in %s", route)
            code = grpc.StatusCode.INTERNAL
            details = f"internal error; request id {logs.request_id.get()}"
        finally:
            self._done(route, code, started, counted)
            logs.request_id.reset(reset)
        # Aborted here, with the error let go and the message dropped: grpc keeps the abort's
        # exception, and its traceback this frame, with the call, in a cycle the collector
        # (run rarely in a serving process) is left to find; raised in an except block, it
        # would hold the error, and through its frames the message, as long
        request = None
        await context.abort(code, details)

    async def _stream(
        self,
        rpc: str,
        handler: grpc.RpcMethodHandler,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[bytes]:
        """A stream's responses, in the order of its requests."""
        request_id, authorization = _metadata(context)
        logs.request_id.set(logs.new_request_id(request_id))  # the stream's task's own context
        caller.set(None if self.token is None else owner_of(authorization))
        try:
            self._admit(rpc, authorization)
        except ServiceError as err:
            self._record(f"grpc {rpc}", grpc_status(err).name, 0.0)  # counted and logged
            await context.abort(grpc_status(err), err.message)
        answers: asyncio.Queue[asyncio.Task[bytes] | None] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)  # requests read and not yet answered
        reader = asyncio.create_task(
            self._read_stream(rpc, handler, requests, context, answers, slots)
        )
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
                slots.release()
            await reader  # a stream that went silent: its error
        except RequestTimeout as err:
            await context.abort(grpc_status(err), err.message)
        finally:
            reader.cancel()
            while not answers.empty():
                answer = answers.get_nowait()
                if answer is not None:
                    answer.cancel()

    async def _read_stream(
        self,
        rpc: str,
        handler: grpc.RpcMethodHandler,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
        answers: asyncio.Queue[asyncio.Task[bytes] | None],
        slots: asyncio.Semaphore,
    ) -> None:
        """Each request of the stream, as it comes, started and queued for its answer; then
        None, once the client ends the stream (or it went silent: RequestTimeout)."""
        running: set[asyncio.Task[bytes]] = set()
        try:
            while True:
                await slots.acquire()
                raw = await self._next_of_stream(requests, running)
                if raw is None:
                    return
                answer = asyncio.create_task(self._stream_request(rpc, handler, raw, context))
                running.add(answer)
                answer.add_done_callback(running.discard)
                answers.put_nowait(answer)
        finally:
            answers.put_nowait(None)

    async def _next_of_stream(
        self, requests: AsyncIterator[bytes], running: set[asyncio.Task[bytes]]
    ) -> bytes | None:
        """The stream's next request message (None at its end); RequestTimeout once it has been
        silent for the read timeout with nothing of it `running`."""
        reading = asyncio.ensure_future(anext(requests, None))
        try:
            while not reading.done():
                await _for(reading, self.read_timeout_s)
                if not reading.done() and not running:
                    raise RequestTimeout(
                        f"the stream carried no request for {self.read_timeout_s:g} s with "
                        "none in flight (MOE_SERVE_READ_TIMEOUT_S)"
                    )
        finally:
            if not reading.done():
                reading.add_done_callback(_retrieve)
        return reading.result()

    async def _stream_request(
        self,
        rpc: str,
        handler: grpc.RpcMethodHandler,
        raw: bytes,
        context: grpc.aio.ServicerContext,
    ) -> bytes:
        """One request of a stream, answered as a call would be but for its errors, which are
        its response's error_message."""
        route = f"grpc {rpc}"
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        counted = False
        request = None
        try:
            with tracing.span(f"{rpc} message"):
                self._admit(rpc, None)  # the stream's token was checked as it opened
                counted = self._count(rpc)
                request = await BINARY.run(len(raw), _parse, handler.request_deserializer, raw)
                reply = await handler.stream_stream(request, context)
        except ServiceError as err:
            code = grpc_status(err)
            reply = _stream_error(request, capped(err.message))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            log.exception("unhandled error in %s", route)
            code = grpc.StatusCode.INTERNAL
            reply = _stream_error(request, f"internal error; request id {logs.request_id.get()}")
        finally:
            self._done(route, code, started, counted)
        return await _serialized(handler, reply)

    def _count(self, rpc: str) -> bool:
        """Count an admitted call in flight (not a probe); whether it was."""
        if rpc in PROBES:
            return False
        self.in_flight += 1
        self.idle.clear()
        return True

    def _done(self, route: str, code: grpc.StatusCode, started: float, counted: bool) -> None:
        """A call (or a stream's request) is answered: uncounted and measured now; its metric
        and log line are written once its reply is on its way (grpc.aio sends it as the
        handler returns, before the loop's next callback), not ahead of it."""
        if counted:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()
        seconds = time.perf_counter() - started
        asyncio.get_running_loop().call_soon(self._record, route, code.name, seconds)

    def _record(self, route: str, code: str, seconds: float) -> None:
        self.runtime.metrics.observe_request(route, code, seconds)
        log.info("%s -> %s in %.1f ms", route, code, seconds * 1e3)

    def _admit(self, rpc: str, authorization: str | None) -> None:
        """Refuse, before its message is read, a call the server will not take now;
        `authorization` None: checked already (a stream's request)."""
        token = self.token
        if (
            authorization is not None
            and rpc not in OPEN
            and token is not None
            and not bearer_matches(authorization, token)
        ):
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

    async def _request(
        self, handler: grpc.RpcMethodHandler, requests: AsyncIterator[bytes]
    ) -> Message:
        """The call's one request message, parsed (off the event loop when large)."""
        raw = await self._message(requests)
        return await BINARY.run(len(raw), _parse, handler.request_deserializer, raw)

    async def _message(self, requests: AsyncIterator[bytes]) -> bytes:
        """The call's one request message, within the read timeout. A read cut short would free
        what grpc core may still write into, so a late one is left to end with the call."""
        reading = asyncio.ensure_future(anext(requests, None))
        try:
            await _for(reading, self.read_timeout_s)
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
        # grpc's reader holds the last message it gave until it is closed, in a cycle with the
        # call that only the collector would break
        await aiter(requests).aclose()
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


def _stream_error(
    request: pb.ModelInferRequest | None, message: str
) -> pb.ModelStreamInferResponse:
    """A stream's response to a request that failed (None: its message did not parse)."""
    answered = pb.ModelInferResponse()
    if request is not None:
        answered.model_name, answered.model_version = request.model_name, request.model_version
        answered.id = request.id
    return pb.ModelStreamInferResponse(error_message=message, infer_response=answered)


async def _serialized(handler: grpc.RpcMethodHandler, reply: Message | bytes) -> bytes:
    """A reply as it goes on the wire: as it is where the servicer serialized it (inference,
    which copies its tensors once so), else serialized here, off the event loop when large."""
    if isinstance(reply, bytes):
        return reply
    return await BINARY.run(reply.ByteSize(), handler.response_serializer, reply)


def _parse(deserialize: Callable[[bytes], Message], raw: bytes) -> Message:
    try:
        return deserialize(raw)
    except DecodeError as err:  # not the RPC's message, or a string field that is not UTF-8
        raise BadInput(f"the request message cannot be parsed: {err}") from None


async def _for(reading: asyncio.Future, timeout_s: float) -> None:
    """Wait until `reading` is done or `timeout_s` has passed, leaving it running: what
    asyncio.wait does for one future, without the sets and checks of its arguments it makes on
    every call (the read of every call's message waits here)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    reading.add_done_callback(wake)
    timer = loop.call_later(timeout_s, wake)
    try:
        await waiter
    finally:
        timer.cancel()
        reading.remove_done_callback(wake)


def _retrieve(reading: asyncio.Future) -> None:
    """Take the outcome of a read that ended after its call did (else asyncio logs it)."""
    if not reading.cancelled():
        reading.exception()
