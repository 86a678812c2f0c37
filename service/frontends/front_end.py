"""One HTTP front-end process of `moe-serve serve --http-workers N`
(`python -m moe_serve.service.frontends.front_end`, started by the engine process,
`service/frontends/supervisor.py`; not a command for users).

Under load one Python process cannot receive, decode and answer requests as fast as the GPU runs
them: its event loop holds the GIL nearly all the time. N front ends share the public
socket (the kernel spreads connections over them) and do the per-byte work in parallel:

- a plain binary forward (`service/http/plain_forward.py`) is checked here (connections, token),
  its body read straight into this process's arena (`service/frontends/arena.py`) and handed to the
  engine as a small record (`service/frontends/channel.py`); the engine decodes it in place, batches
  it with every other front end's requests and writes the reply blob back into the arena (on a
  GPU the body is copied to the device and the output back into the arena with no host copy);
- a plain JSON forward up to `json_here_bytes` is decoded here (`service/codecs/json_numbers.py`,
  the engine's own strict decode) into a float32 blob in the arena and sent as a binary forward
  answered in the layer's dtype, whose output is written here as the JSON the engine writes:
  the engine does no JSON work;
- a larger one (up to MOE_SERVE_MAX_JSON_BYTES), and one that asks for the routing, goes to the
  engine as its text, read straight into the arena as a binary body is: the engine parses it
  where it lies (on a GPU, on the device) and writes the JSON reply into the arena, or, longer
  than the room left for it there, sends it over the channel;
- the probes (/health, /ready, KServe's live, ready and model ready) are answered here, from
  the state the engine publishes with its heartbeat (`service/frontends/engine_state.py`):
  answered at once whatever the engine is doing, and not live once its event loop stops;
- a route asked with a method it does not take is the engine's 405, and a path no route has its
  404, answered here at once from the engine's table of routes (`service/http/route_methods.py`),
  the body not waited for;
- every other request (KServe v2, metrics, admin, a forward with a query string) is relayed
  unchanged to the engine's own HTTP server on a Unix socket, as is a body the arena cannot
  hold. Scrapes have connections of their own to the engine: relayed responses that slow
  clients read slowly hold the others.

It imports no torch: it starts in a fraction of a second and is restarted if it dies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from .. import logs, off_loop
from ..codecs.body_limit import HEADER_LENGTH, body_limit, body_too_large
from ..codecs.json_numbers import (
    NUMBER_BYTES,
    ForwardArrays,
    decode_forward_arrays,
    dumps,
)
from ..codecs.safetensors_header import read_header
from ..errors import (
    BadInput,
    PayloadTooLarge,
    ServiceError,
    ShuttingDown,
    body_cut,
    body_stalled,
    error_response,
    no_layer,
)
from ..http import probes
from ..http.direct_body import DIRECT_BODY, BodyTarget, DirectBody
from ..http.middleware import (
    OPEN_PATHS,
    UNAUTHORIZED,
    authorized,
    over_capacity,
)
from ..http.plain_forward import (
    BINARY,
    FORWARD_PATH,
    JSON,
    plain_forward,
)
from ..http.route_methods import UNMATCHED, MethodTable, RouteMethods
from ..http.server import OVER_CAPACITY, bounded_protocol, client_gone
from ..interpreter import collect_less
from ..logs import new_request_id
from .arena import BodyArena, Region
from .channel import EngineClient, Reply
from .engine_state import StateBlock

log = logging.getLogger("moe_serve.service.frontends.front_end")  # also when run as __main__

CONFIG_ENV = "MOE_SERVE_FRONT_END"  # the config, JSON, from the engine process
# Per front end; a body over a quarter of it is relayed (4 requests of 1024 DeepSeek-V3 tokens
# in bf16 fit at once). Reserved on start: a full /dev/shm fails then, not mid-request.
ARENA_BYTES = 128 << 20
# Not relayed: they describe one hop's connection, not the request (RFC 9110, 7.6.1).
_HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"}
)
# Nor, in a response, what this process's server adds to every response itself
_NOT_RELAYED_BACK = _HOP_BY_HOP | {b"date", b"server"}
# The engine's server closes a connection idle for uvicorn's keep-alive timeout (5 s): the relay
# lets one go sooner, so as not to send a request down a connection being closed.
_RELAY_KEEPALIVE_S = 2.0
_SCRAPE_CONNECTIONS = 2  # to the engine, for /metrics alone
# Probe answers kept per published state: one per probe and model name asked, these at most
_PROBE_ANSWERS = 256


@dataclass(frozen=True)
class FrontEndConfig:
    listen_fd: int  # the public socket, shared by every front end
    engine_http: str  # Unix socket of the engine's HTTP server (what is relayed)
    engine_channel: str  # Unix socket of the engine's channel (service/frontends/channel.py)
    engine_state: str  # the engine's probe state (service/frontends/engine_state.py)
    engine_stale_s: float  # a heartbeat older than this: the engine is not live
    arena_dir: str
    api_token: str | None
    max_connections: int
    read_timeout_s: float
    max_body_bytes: int  # a relayed body is read here first: it holds no engine connection
    # a larger JSON forward goes to the engine as its text, which on a GPU reads it on the device
    # (service/codecs/json_device.py; bench.json_bench)
    json_here_bytes: int
    max_json_bytes: int  # beyond, relayed: the engine's 413
    drain_timeout_s: float
    stay_awake: bool  # the engine runs on a GPU: replies are waited for awake (service/awake.py)
    log_level: str
    log_format: str
    routes: list[RouteMethods]  # the engine's, with the methods each takes

    def to_env(self) -> dict[str, str]:
        return {CONFIG_ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls) -> FrontEndConfig:
        return cls(**json.loads(os.environ.pop(CONFIG_ENV)))


class FrontEnd:
    """The front end's ASGI app."""

    def __init__(self, config: FrontEndConfig) -> None:
        self.config = config
        self.token = None if config.api_token is None else config.api_token.encode()
        try:
            self.arena = BodyArena.create(Path(config.arena_dir), ARENA_BYTES)
        except OSError as err:  # every request is relayed: slower, but served
            log.error("no %d MiB arena in %s (%s): relaying every request", ARENA_BYTES >> 20,
                      config.arena_dir, err.strerror)  # fmt: skip
            self.arena = None
        self.engine = EngineClient(
            Path(config.engine_channel), self.arena, self._engine_lost, config.stay_awake
        )
        self.on_engine_lost = lambda: None  # main() stops the server: nothing left to serve
        self.state = StateBlock.attach(Path(config.engine_state))
        self._probed: tuple[object, dict] = (None, {})  # a state, the probe answers made of it
        self.methods = MethodTable(config.routes)
        self.relay = _relay_client(config.engine_http, config.max_connections)
        # /metrics is relayed: the engine keeps every metric, the front ends' requests included
        self.scrapes = _relay_client(config.engine_http, _SCRAPE_CONNECTIONS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = False

        async def send_once_started(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._serve(scope, receive, send_once_started)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs MOE_SERVE_DRAIN_TIMEOUT_S after SIGTERM: answer,
            # as the engine process's RequestMiddleware does, unless the response has begun
            if started:
                raise
            cut = ShuttingDown("the server shut down before this request finished; retry")
            await error_response(cut.status, cut.message, cut.headers)(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        if direct := scope.get(DIRECT_BODY):
            # a plain forward with the token (`body_target`) on a connection within the limit
            await self._forward(scope, receive, send, *plain_forward(scope), direct)
            return
        path = scope["path"]
        if scope.get(OVER_CAPACITY) and path not in OPEN_PATHS:
            await over_capacity(self.config.max_connections)(scope, receive, send)
            return
        probe = probes.probe(scope["method"], path)
        if probe and (path in OPEN_PATHS or authorized(path, Headers(scope=scope), self.token)):
            with self._answer(scope, probe[0]) as answer:
                status, headers, body = self._probe_answer(probe)
                answer.status = status
                await _send(send, status, [*headers, answer.id_header], body)
            return
        headers = Headers(scope=scope)
        plain = plain_forward(scope)
        if not authorized(path, headers, self.token):
            with self._answer(scope, UNMATCHED) as answer:
                answer.status = 401  # before any byte of the body is read
                await _error_response(_UNAUTHORIZED, answer.headers)(scope, receive, send)
        elif refused := self.methods.refused(scope["method"], path):
            route, response = refused
            with self._answer(scope, route) as answer:
                answer.status = response.status_code  # at once: a body that may never come is
                if _has_body(headers):  # not waited for, nor read: the connection closes after
                    response.headers["Connection"] = "close"
                response.headers.update(answer.headers)
                await response(scope, receive, send)
        elif plain and plain[1] == JSON and (size := self._json_size(headers)):
            await self._forward_json(scope, receive, send, plain[0], size)
        else:
            await self._relay_read(scope, receive, send)

    def _answer(self, scope: Scope, route: str = FORWARD_PATH) -> _Answer:
        return _Answer(self.engine, scope, route)

    def _probe_answer(self, probe: tuple[str, str, str]) -> tuple[int, list, bytes]:
        """The probe's status, headers and body as `probes.answer` gives them, made once per
        state the engine publishes (the probes' paths and the models' names asked)."""
        state = self.state.read(self.config.engine_stale_s)
        if state is not self._probed[0]:
            self._probed = (state, {})
        answers = self._probed[1]
        found = answers.get(probe)
        if found is None:
            response = probes.answer(state, *probe)
            found = (response.status_code, response.raw_headers, response.body)
            if len(answers) < _PROBE_ANSWERS:  # the names asked come from clients
                answers[probe] = found
        return found

    def _body_size(self, headers: Headers) -> int | None:
        """The body's size when the channel can take it, or None: relayed instead (no
        Content-Length, compressed, or the channel not up)."""
        size = headers.get("content-length", "")
        plain = headers.get("content-encoding", "identity").strip().lower() == "identity"
        if not (self.arena and self.engine.connected and plain and size.isdigit()):
            return None
        return int(size)

    def body_target(self, scope: Scope, size: int) -> BodyTarget[Region] | None:
        """The connection reads a plain binary forward's body, or the text of a plain JSON
        forward too large to decode here, into a region of the arena
        (`service/http/direct_body.py`); None: read as usual (see `_json_size`) or relayed (see
        `_body_size`; without the token, too large, or the arena full)."""
        plain = plain_forward(scope)
        if plain is None:
            return None
        headers = Headers(scope=scope)
        if not authorized(FORWARD_PATH, headers, self.token):
            return None
        config = self.config
        if plain[1] == JSON and not config.json_here_bytes < size <= config.max_json_bytes:
            return None
        if self._body_size(headers) != size or size > ARENA_BYTES // 4:
            return None
        region = self.arena.allocate(size)
        if region is None:
            return None
        return BodyTarget(self.arena.body(region), region, partial(self.arena.free, region))

    def _json_size(self, headers: Headers) -> int | None:
        """A JSON body's size when it is decoded here, or None: relayed (see `_body_size` and
        FrontEndConfig.json_here_bytes)."""
        size = self._body_size(headers)
        return size if size is not None and size <= self.config.json_here_bytes else None

    async def _forward(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        name: str,
        media: str,
        direct: DirectBody[Region],
    ) -> None:
        """A forward whose body the connection read into the arena, to the engine as it is;
        withdrawn once the connection is lost."""
        region = direct.target.holder
        ours = True  # the region is not the engine's, nor lent to the reply
        with self._answer(scope) as answer:
            try:
                try:
                    await direct.read(self.config.read_timeout_s)
                    reply = None
                except ServiceError as err:  # 408, 499
                    reply = _reply_of(err)
                if reply is None:
                    ours = False
                    ask = self.engine.forward if media == BINARY else self.engine.forward_json
                    reply = await ask(name, region, direct.left)
                    ours = True
                answer.status = reply.status
                if reply.status == 200:
                    content = self._reply_bytes(region, reply)
                    ours = reply.data is not None  # else `content` frees the region
                    await _send_ok(send, content, media, answer)
                else:
                    await _error_response(reply, answer.headers)(scope, receive, send)
            finally:
                if ours:
                    direct.discard()  # the connection writes no more of the body into it
                    self.arena.free(region)

    async def _forward_json(
        self, scope: Scope, receive: Receive, send: Send, name: str, size: int
    ) -> None:
        """A JSON forward decoded here and run as a binary one (the module's docstring); one
        that asks for the routing goes to the engine as its text; relayed with its body when
        the arena has no room for it."""
        region, ours, as_text = None, True, False
        with self._answer(scope) as answer:
            try:
                body = await self._read_body(receive, size, f"its Content-Length of {size} bytes")
                reply = body if isinstance(body, Reply) else self._unknown_layer(name)
                if reply is None:
                    try:
                        arrays = await off_loop.JSON.run(size, decode_forward_arrays, body)
                    except BadInput as err:
                        reply = Reply(err.status, error=err.message)
                if reply is None:
                    as_text = arrays.return_routing  # the engine writes the routing's JSON
                    region = self.arena.allocate(len(body) if as_text else _blob_bytes(arrays))
                    if region is None:
                        answer.status = RELAYED
                        await self._relay(scope, body, receive, send)
                        return
                    if as_text:
                        self.arena.body(region)[:] = body
                        ask = partial(self.engine.forward_json, name, region)
                    else:
                        _write_blob(arrays, self.arena.body(region))
                        ask = partial(self.engine.forward, name, region, layer_dtype=True)
                    gone = asyncio.ensure_future(client_gone(receive))
                    ours = False
                    try:
                        reply = await ask(gone=gone)
                    finally:
                        gone.cancel()
                    ours = True
                answer.status = reply.status
                if reply.status != 200:
                    await _error_response(reply, answer.headers)(scope, receive, send)
                    return
                if as_text:
                    text = self._reply_bytes(region, reply)
                    ours = reply.data is not None  # else `text` frees the region
                else:  # output [T, H], as hidden_states
                    blob = self.arena.reply(region, reply.nbytes)
                    numbers = arrays.hidden_states.size * NUMBER_BYTES
                    text = await off_loop.JSON.run(numbers, _json_reply, blob)
                await _send_ok(send, text, JSON, answer)
            finally:
                if ours and region is not None:
                    self.arena.free(region)

    def _reply_bytes(self, region: Region, reply: Reply) -> bytes | memoryview:
        """The engine's reply: as the channel carried it, or sent as it lies in the region, as
        a view that frees the region once the last reference to it is gone (the connection may
        still hold part of it after the response is sent)."""
        if reply.data is not None:
            return reply.data
        return self.arena.lend_reply(region, reply.nbytes)

    def _unknown_layer(self, name: str) -> Reply | None:
        """The engine's 404 for a layer it does not serve, before the body is decoded (as the
        engine's route looks up the layer first); None when it serves it, or when the published
        state cannot tell (the engine not ready: it answers itself)."""
        state = self.state.read(self.config.engine_stale_s)
        if state.ready_reason is not None or not state.models or name in state.models:
            return None
        return _reply_of(no_layer(name, state.models))

    async def _read_body(self, receive: Receive, limit: int, what: str) -> bytes | Reply:
        """The whole body, grown as its bytes arrive (never sized by what the client declares),
        or the reply when it passes `limit` (named `what` in its 413), stalls past the read
        timeout or is cut."""
        chunks, size, timeout_s = [], 0, self.config.read_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return _reply_of(body_cut(size))
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return _reply_of(body_too_large(what))
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except TimeoutError:
            return _reply_of(body_stalled(timeout_s, size))
        return b"".join(chunks)

    async def _relay_read(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request for the engine's HTTP server: its body read here first, within the read
        timeout and the engine's limit for it (its 413 too), so that a client that stalls holds
        no engine connection and gets its 408 from this process."""
        headers = Headers(scope=scope)
        config = self.config
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        declared = headers.get("content-length", "")
        try:
            limit, what = body_limit(
                media, headers.get(HEADER_LENGTH), config.max_json_bytes, config.max_body_bytes
            )
        except PayloadTooLarge as err:
            body: bytes | Reply = _reply_of(err)
        else:
            if declared.isdigit() and int(declared) > limit:
                body = _reply_of(body_too_large(what, int(declared)))
            else:
                body = await self._read_body(receive, limit, what)
        if isinstance(body, Reply):
            with self._answer(scope, UNMATCHED) as answer:
                answer.status = body.status
                await _error_response(body, answer.headers)(scope, receive, send)
            return
        await self._relay(scope, body, receive, send)

    async def _relay(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """The request, its `body` read, to the engine's HTTP server and its response back,
        streamed; withdrawn if the client goes away first."""
        client = self.scrapes if scope["path"] in OPEN_PATHS else self.relay
        sending = asyncio.ensure_future(_send_to_engine(client, scope, body))
        gone = asyncio.ensure_future(client_gone(receive))
        try:
            await asyncio.wait((sending, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not sending.done():  # the client went away: closing the relay withdraws it
                sending.cancel()
        if not sending.done() or sending.cancelled():
            return
        try:
            response = sending.result()
        except httpx.TransportError:
            down = ShuttingDown("the engine process is not reachable; retry")
            await error_response(down.status, down.message, down.headers)(scope, receive, send)
            return
        try:
            headers = [
                (k, v) for k, v in response.headers.raw if k.lower() not in _NOT_RELAYED_BACK
            ]
            start = {"type": "http.response.start", "status": response.status_code}
            await send(start | {"headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        asyncio.get_running_loop().set_exception_handler(_quiet_cancelled_wakeups)
        if self.arena is not None:
            try:
                await self.engine.connect()
            except (OSError, ConnectionError) as err:
                await send({"type": "lifespan.startup.failed", "message": f"the engine: {err}"})
                return
            finally:
                self.arena.unlink()  # both processes have it mapped (or it failed)
        collect_less()
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await self.engine.close()
        await self.relay.aclose()
        await self.scrapes.aclose()
        self.state.close()
        await send({"type": "lifespan.shutdown.complete"})

    def _engine_lost(self) -> None:
        log.warning("the engine process closed the channel: this front end stops")
        self.on_engine_lost()


def _relay_client(engine_http: str, connections: int) -> httpx.AsyncClient:
    """A client of the engine's HTTP server, at most `connections` open to it."""
    limits = httpx.Limits(max_connections=connections, keepalive_expiry=_RELAY_KEEPALIVE_S)
    transport = httpx.AsyncHTTPTransport(uds=engine_http, limits=limits)
    return httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=None)


async def _send_to_engine(client: httpx.AsyncClient, scope: Scope, body: bytes) -> httpx.Response:
    """The engine's response (its head; the body streams) to the request of `scope` with its
    `body`. Sent again, once, if the connection failed before any byte of a response came: the
    engine may close an idle connection just as it is taken for a request, which the engine
    then never saw (every relayed body is whole in memory, so it can be sent again)."""
    try:
        return await client.send(_relayed_request(client, scope, body), stream=True)
    except httpx.TransportError as err:
        log.info("no response on a connection to the engine (%r): sending again", err)
    return await client.send(_relayed_request(client, scope, body), stream=True)


def _relayed_request(client: httpx.AsyncClient, scope: Scope, body: bytes) -> httpx.Request:
    headers = [(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP]
    target = _target(scope)
    # httpx's URL removes dot segments (`/region/../register`): the request line carries the
    # target as the client sent it, so that the engine answers what it would have answered
    return client.build_request(
        scope["method"],
        target.decode("latin-1"),
        headers=headers,
        content=body,
        extensions={"target": target},
    )


RELAYED = -1  # an _Answer's status: the engine answers, logs and counts it
_UNAUTHORIZED = Reply(401, error=UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})


class _Answer:
    """A request answered by this front end (a context manager around its answering): its
    request id, set for the log lines while it runs, and once known its status (0: none yet;
    none at the end: 500, or cancelled: the 503 __call__ sends). At the end it is counted by
    `engine` under `route` and its line logged as the engine logs one, unless relayed."""

    __slots__ = ("_engine", "_reset", "_route", "_scope", "_started", "rid", "status")

    def __init__(self, engine: EngineClient, scope: Scope, route: str) -> None:
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), b"")
        self.rid = new_request_id(given.decode("latin-1"))
        self.status = 0
        self._engine, self._scope, self._route = engine, scope, route

    def __enter__(self) -> _Answer:
        self._reset = logs.request_id.set(self.rid)
        self._started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None and issubclass(kind, asyncio.CancelledError):
            self.status = self.status or ShuttingDown.status
        if self.status != RELAYED:
            status = self.status or 500
            seconds = time.perf_counter() - self._started
            self._engine.done(self._route, status, seconds)
            method, path = self._scope["method"], self._scope["path"]
            log.info("%s %s -> %d in %.1f ms", method, path, status, seconds * 1e3)
        logs.request_id.reset(self._reset)

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-ID": self.rid}

    @property
    def id_header(self) -> tuple[bytes, bytes]:
        return (b"x-request-id", self.rid.encode())


async def _send(send: Send, status: int, headers: list, body: bytes | memoryview) -> None:
    """A response, as a starlette Response with these headers sends it, without making one."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_ok(send: Send, content: bytes | memoryview, media: str, answer: _Answer) -> None:
    """A forward's 200 with its reply."""
    headers = [
        answer.id_header,
        (b"content-length", str(len(content)).encode()),
        (b"content-type", media.encode()),
    ]
    await _send(send, 200, headers, content)


def _has_body(headers: Headers) -> bool:
    return headers.get("content-length", "0") != "0" or "transfer-encoding" in headers


def _reply_of(err: ServiceError) -> Reply:
    return Reply(err.status, error=err.message, headers=err.headers)


def _error_response(reply: Reply, headers: dict[str, str]) -> Response:
    response = error_response(reply.status, reply.error, reply.headers)
    response.headers.update(headers)
    return response


def _blob_head(arrays: ForwardArrays) -> bytes:
    """The safetensors header of the float32 blob of `arrays` (hidden_states, router_logits)."""
    header, offset = {}, 0
    for name in ("hidden_states", "router_logits"):
        array = getattr(arrays, name)
        if array is not None:
            end = offset + array.size * 4
            header[name] = {
                "dtype": "F32",
                "shape": list(array.shape),
                "data_offsets": [offset, end],
            }
            offset = end
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head


def _blob_bytes(arrays: ForwardArrays) -> int:
    logits = 0 if arrays.router_logits is None else arrays.router_logits.size
    return len(_blob_head(arrays)) + 4 * (arrays.hidden_states.size + logits)


def _write_blob(arrays: ForwardArrays, into: memoryview) -> None:
    """`arrays` as a float32 safetensors blob into `into`, rounded as the engine rounds a JSON
    body (each number lies within float32's range: `decode_forward_arrays`)."""
    head = _blob_head(arrays)
    into[: len(head)] = head
    at = len(head)
    for array in (arrays.hidden_states, arrays.router_logits):
        if array is not None:
            np.frombuffer(into, np.float32, array.size, at).reshape(array.shape)[...] = array
            at += array.size * 4


def _json_reply(blob: memoryview) -> bytes:
    """A reply blob (output [T, H] in the layer's dtype) -> the JSON the engine writes for a
    JSON forward (routes.forward._encode_json): numbers in the dtype's shortest form."""
    header = read_header(blob)
    (entry,) = header.entries
    at = header.data_start + entry.begin
    if entry.dtype == "BF16":  # numpy has no bfloat16: its float32 twin holds it exactly
        bits = np.frombuffer(blob, np.uint16, entry.numel, at).astype(np.uint32) << 16
        output = bits.view(np.float32)
    else:
        output = np.frombuffer(blob, _NUMPY_DTYPES[entry.dtype], entry.numel, at)
    meta = header.metadata
    reply = {
        "output": output.reshape(entry.shape),
        "layer": meta["layer"],
        "tokens": int(meta["tokens"]),
        "backend": meta["backend"],
    }
    return dumps(reply)


_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16}


def _quiet_cancelled_wakeups(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's exception handler, less one harmless error: anyio's Unix-socket streams (the
    relay's connections to the engine) wait for their socket with a reader callback that is a
    future's bare set_result; when a client leaves, its relay is cancelled, and a reader that
    fires in the same turn sets a cancelled future. Nothing is lost; logged at debug level."""
    if isinstance(context.get("exception"), asyncio.InvalidStateError) and (
        "Future.set_result" in repr(context.get("handle"))
    ):
        log.debug("a cancelled relay's socket became ready: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


def _target(scope: Scope) -> bytes:
    """The request's path and query as the client sent them (still percent-encoded)."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope["query_string"]
    return path + b"?" + query if query else path


def main() -> None:
    config = FrontEndConfig.from_env()
    logs.configure(config.log_level, config.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relay: the engine logs it
    app = FrontEnd(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,  # each request logs its line (_Answer) with its id and duration
            lifespan="on",
            timeout_graceful_shutdown=config.drain_timeout_s,
            http=bounded_protocol(
                config.max_connections,
                config.read_timeout_s,
                app.body_target,
                write_timeout_s=config.read_timeout_s,
            ),
        )
    )
    app.on_engine_lost = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[socket.socket(fileno=config.listen_fd)])


if __name__ == "__main__":
    main()
