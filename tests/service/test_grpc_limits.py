"""Hostile gRPC clients on a real server: a call is refused before its message is held, a message
that stalls is dropped, connections and calls in flight are bounded, and SIGTERM drains gRPC
as it drains HTTP. Raw HTTP/2 where a stock client cannot misbehave enough."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import torch

from moe_serve.service.core.runtime import Runtime
from moe_serve.service.grpc.server import MESSAGE_HEADROOM
from moe_serve.service.http.app import create_app
from moe_serve.service.http.server import server_config
from moe_serve.service.serve import _DrainingServer
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import TINY, H, free_port, reference_forward, running_server, tiny_loader

grpcclient = pytest.importorskip("tritonclient.grpc")
grpc = grpcclient.grpc
pb = pytest.importorskip("tritonclient.grpc.service_pb2")

TOKEN = "grpc-test-token-0123456789"
INFER = "/inference.GRPCInferenceService/ModelInfer"
READ_TIMEOUT_S = 0.5
WAIT_S = 30.0  # far above READ_TIMEOUT_S: what the tests allow before calling it a hang


@dataclass
class Serving:
    server: _DrainingServer  # as `moe-serve serve` runs it: handle_exit is its SIGTERM
    runtime: Runtime
    url: str  # HTTP
    grpc: str  # host:port


@contextlib.contextmanager
def serving(**settings: object) -> Iterator[Serving]:
    config = Settings(device="cpu", grpc_port=free_port(), **settings)
    app = create_app(config, tiny_loader)
    server = _DrainingServer(server_config(app, config), app.state.runtime)
    with running_server(app, server) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield Serving(server, app.state.runtime, url, f"127.0.0.1:{config.grpc_port}")


def _request(rows: int = 2) -> tuple[np.ndarray, pb.ModelInferRequest]:
    x = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)
    request = pb.ModelInferRequest(model_name=TINY)
    request.inputs.add(name="hidden_states", datatype="FP32", shape=[rows, H])
    request.raw_input_contents.append(x.tobytes())
    return x, request


@contextlib.contextmanager
def stalled_call(address: str, metadata: tuple = ()) -> Iterator[grpc.Future]:
    """A ModelInfer whose client opens the call and never sends its message (as long as the
    block lasts): the call's outcome as a future."""
    sent = threading.Event()

    def nothing() -> Iterator[pb.ModelInferRequest]:
        sent.wait(WAIT_S)
        yield from ()

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_unary(
            INFER,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        try:
            yield call.future(nothing(), timeout=WAIT_S, metadata=metadata)
        finally:
            sent.set()


# Raw HTTP/2 (RFC 9113): frame types, and just enough HPACK (literals, never indexed)
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, END_HEADERS, ACK = 1, 4, 1
SETTINGS_MAX_CONCURRENT_STREAMS = 3


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)
    return head + payload


def _literal(name: str, value: str) -> bytes:
    def string(text: str) -> bytes:
        assert len(text) < 127
        return bytes([len(text)]) + text.encode()

    return b"\x10" + string(name) + string(value)


class RawH2:
    """One HTTP/2 connection, spoken by hand."""

    def __init__(self, address: str, preface: bool = True) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.settimeout(WAIT_S)
        self.received = b""
        if preface:
            self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(SETTINGS, 0, 0, b""))

    def open_call(self, stream: int, path: str, data: bytes, *metadata: tuple[str, str]) -> None:
        """HEADERS, then DATA that does not end the stream."""
        fields = [(":method", "POST"), (":scheme", "http"), (":path", path)]
        fields += [(":authority", "t"), ("content-type", "application/grpc"), ("te", "trailers")]
        block = b"".join(_literal(n, v) for n, v in [*fields, *metadata])
        self.sock.sendall(
            _frame(HEADERS, END_HEADERS, stream, block) + _frame(DATA, 0, stream, data)
        )

    def frames(self) -> Iterator[tuple[int, int, int, bytes]]:
        """The server's frames, (type, flags, stream, payload), until it closes the connection
        (raises on a hang); its SETTINGS and PINGs acknowledged."""
        while (head := self._read(9)) is not None:
            payload = self._read(int.from_bytes(head[:3], "big"))
            if payload is None:
                return
            kind, flags = head[3], head[4]
            stream = struct.unpack(">I", head[5:])[0] & 0x7FFFFFFF
            if kind == SETTINGS and not flags & ACK:
                self.sock.sendall(_frame(SETTINGS, ACK, 0, b""))
            elif kind == PING and not flags & ACK:
                self.sock.sendall(_frame(PING, ACK, 0, payload))
            yield kind, flags, stream, payload

    def _read(self, size: int) -> bytes | None:
        while len(self.received) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.received += chunk
        data, self.received = self.received[:size], self.received[size:]
        return data

    def close(self) -> None:
        self.sock.close()


def _grpc_message(prefix: int, body: bytes = b"") -> bytes:
    """A gRPC message's 5-byte prefix (uncompressed, `prefix` bytes long), and what follows."""
    return b"\x00" + struct.pack(">I", prefix) + body


def _trailers(connection: RawH2, stream: int) -> bytes:
    """The HEADERS that end `stream` (status and message are literals on a fresh connection)."""
    for kind, flags, on, payload in connection.frames():
        if kind == HEADERS and on == stream and flags & END_STREAM:
            return payload
    raise AssertionError("the connection closed before the call was answered")


def _kinds_until_closed(connection: RawH2) -> list[int]:
    return [kind for kind, *_ in connection.frames()]


def test_a_call_without_the_token_is_refused_before_its_message_arrives() -> None:
    with serving(api_token=TOKEN) as s:
        with stalled_call(s.grpc) as call:
            assert call.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in call.details()
        # a partial message of a length within the limit: refused at its metadata
        raw = RawH2(s.grpc)
        raw.open_call(1, INFER, _grpc_message(32 << 20, b"\x41" * 1000))
        trailers = _trailers(raw, 1)
        raw.close()
    assert b"grpc-status\x0216" in trailers  # UNAUTHENTICATED


def test_a_message_that_stalls_is_dropped_after_the_read_timeout() -> None:
    with serving(read_timeout_s=READ_TIMEOUT_S) as s:
        raw = RawH2(s.grpc)
        raw.open_call(1, INFER, _grpc_message(32 << 20, b"\x41" * 1000))
        trailers = _trailers(raw, 1)
        raw.close()
        with stalled_call(s.grpc) as call:
            assert call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert call.details() == (
                "the request message did not arrive within 0.5 s (MOE_SERVE_READ_TIMEOUT_S)"
            )
    assert b"grpc-status\x014" in trailers  # DEADLINE_EXCEEDED


def test_a_message_above_the_limit_is_refused_by_its_length_prefix() -> None:
    """The tensors of one body limit fit, with their names; a longer prefix is refused before
    one byte of the message is sent."""
    with serving(max_body_bytes=1024) as s:
        x, request = _request(rows=1024 // (4 * H))  # 1024 bytes of tensor
        with grpcclient.InferenceServerClient(s.grpc) as client:
            reply = client._client_stub.ModelInfer(request)
        out = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(x.shape)
        torch.testing.assert_close(torch.tensor(out), reference_forward(TINY, torch.tensor(x)))
        raw = RawH2(s.grpc)
        raw.open_call(1, INFER, _grpc_message(1024 + MESSAGE_HEADROOM + 1))
        trailers = _trailers(raw, 1)
        raw.close()
    assert b"grpc-status\x018" in trailers  # RESOURCE_EXHAUSTED


def test_calls_in_flight_beyond_max_connections_are_refused_and_the_probes_answer() -> None:
    with serving(max_connections=2) as s, contextlib.ExitStack() as held:
        stalled = [held.enter_context(stalled_call(s.grpc)) for _ in range(2)]
        with grpcclient.InferenceServerClient(s.grpc) as client:
            _, request = _request()
            for _ in range(int(WAIT_S / 0.05)):  # until both stalled calls are in
                try:
                    client._client_stub.ModelInfer(request, timeout=WAIT_S)
                except grpc.RpcError as err:
                    refused = err
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("no call was refused")
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "(MOE_SERVE_MAX_CONNECTIONS); retry" in refused.details()
            assert client.is_server_ready() and client.is_model_ready(TINY)
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert not any(call.done() for call in stalled)


def test_connections_beyond_max_connections_are_closed_and_http_answers() -> None:
    with serving(max_connections=2) as s:
        held = [RawH2(s.grpc) for _ in range(2)]
        for connection in held:  # each is taken in: the server's SETTINGS come
            kind, _, _, settings = next(connection.frames())
            assert kind == SETTINGS
            values = dict(struct.iter_unpack(">HI", settings))
            assert values[SETTINGS_MAX_CONCURRENT_STREAMS] == 2  # the calls it takes in flight
        extra = RawH2(s.grpc)
        assert HEADERS not in _kinds_until_closed(extra)
        assert httpx.get(f"{s.url}/health").status_code == 200
        for connection in [*held, extra]:
            connection.close()


def test_two_hundred_calls_at_once_on_one_channel_are_all_answered() -> None:
    """A stock client's asynchronous calls on one channel: each is served, none is refused as a
    stream beyond the connection's limit (UNAVAILABLE, "RST_STREAM with error code 7")."""
    calls = 200
    with serving(max_queue=calls) as s:
        client = grpcclient.InferenceServerClient(s.grpc)
        x = np.random.default_rng(0).standard_normal((2, H)).astype(np.float32)
        tensor = grpcclient.InferInput("hidden_states", [2, H], "FP32")
        tensor.set_data_from_numpy(x)
        client.infer(TINY, [tensor])  # the connection is up, its settings known
        answered: list[tuple[object, object]] = []
        all_in = threading.Event()

        def done(result, error) -> None:
            answered.append((result, error))
            if len(answered) == calls:
                all_in.set()

        for _ in range(calls):
            client.async_infer(TINY, [tensor], done, client_timeout=WAIT_S)
        assert all_in.wait(WAIT_S)
        client.close()
    assert [error for _, error in answered if error is not None] == []
    expected = reference_forward(TINY, torch.from_numpy(x))
    for result, _ in answered:
        torch.testing.assert_close(torch.tensor(result.as_numpy("output")), expected)


def test_idle_connections_are_closed_after_the_read_timeout() -> None:
    with serving(read_timeout_s=READ_TIMEOUT_S) as s:
        idle = RawH2(s.grpc)
        assert GOAWAY in _kinds_until_closed(idle)
        silent = RawH2(s.grpc, preface=False)  # never starts HTTP/2
        _kinds_until_closed(silent)
        for connection in (idle, silent):
            connection.close()


def test_sigterm_makes_grpc_not_ready_and_refuse_new_calls_while_calls_in_flight_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered, release = threading.Event(), threading.Event()
    with serving() as s, grpcclient.InferenceServerClient(s.grpc) as client:
        batcher = s.runtime.batcher
        submit = batcher.submit

        async def held(*args: object, **kwargs: object) -> object:
            entered.set()
            await asyncio.to_thread(release.wait, WAIT_S)
            return await submit(*args, **kwargs)

        monkeypatch.setattr(batcher, "submit", held)
        x, request = _request()
        replies: list[pb.ModelInferResponse] = []
        in_flight = threading.Thread(
            target=lambda: replies.append(client._client_stub.ModelInfer(request, timeout=WAIT_S))
        )
        in_flight.start()
        assert entered.wait(WAIT_S)
        s.server.handle_exit(signal.SIGTERM, None)
        try:
            assert client.is_server_live()
            assert not client.is_server_ready()
            assert not client.is_model_ready(TINY)
            with pytest.raises(grpc.RpcError) as err:
                client._client_stub.ModelInfer(request, timeout=WAIT_S)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == "the server is shutting down"
        finally:
            release.set()
            in_flight.join(WAIT_S)
    out = np.frombuffer(replies[0].raw_output_contents[0], np.float32).reshape(x.shape)
    torch.testing.assert_close(torch.tensor(out), reference_forward(TINY, torch.tensor(x)))


def test_a_drain_whose_time_is_spent_warns_of_no_call_when_none_is_in_flight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The front ends' drain can take the whole of it: gRPC then stops at once, and warns only
    of calls that were still in flight."""
    from moe_serve.service.grpc.server import GrpcServer
    from moe_serve.service.metrics import Metrics

    runtime = Runtime(Settings(device="cpu", grpc_port=free_port()), Metrics())

    async def main() -> None:
        server = GrpcServer(runtime)
        await server.start()
        runtime.drain_deadline = time.monotonic() - 1.0  # spent
        await server.stop()

    with caplog.at_level("WARNING", logger="moe_serve.service.grpc.server"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == []
