"""The gRPC server: grpc.aio on the event loop that runs uvicorn, with the bounds HTTP has.

grpc core's own limits, from the settings HTTP uses for the same things:

- a message of at most MOE_SERVE_MAX_BODY_BYTES plus MESSAGE_HEADROOM (a length prefix above it
  is refused at once, RESOURCE_EXHAUSTED, before the message is read);
- at most MOE_SERVE_MAX_CONNECTIONS connections (more are closed as they come), each with as
  many calls open at once as the server takes in flight (CallGate answers a call beyond them
  RESOURCE_EXHAUSTED, naming the limit). A lower stream limit is not one a stock client waits
  for: calls past it race the client's count of open streams, and those refused end UNAVAILABLE;
- a connection must finish its HTTP/2 handshake within MOE_SERVE_READ_TIMEOUT_S, and one with no
  call open for as long is closed (GOAWAY), as uvicorn closes idle keep-alive connections;
- a peer that does not answer a ping within MOE_SERVE_READ_TIMEOUT_S, sent after as long without
  a word, is dropped with its calls.

grpc core has no deadline for a message that stalls halfway; interceptors.py's CallGate gives
it one, and bounds the calls in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from tritonclient.grpc import service_pb2_grpc

from .. import tracing
from ..core.runtime import Runtime
from .interceptors import CallGate
from .servicer import SERVED, InferenceServicer

log = logging.getLogger(__name__)

# A message carries names, shapes and parameters besides its tensors' bytes: with this, tensors
# of MOE_SERVE_MAX_BODY_BYTES fit in one, as in one HTTP body with its JSON header.
MESSAGE_HEADROOM = 64 << 10


class GrpcServer:
    """GRPCInferenceService on settings.host:grpc_port, on the running event loop."""

    def __init__(self, runtime: Runtime) -> None:
        settings = runtime.settings
        self.runtime = runtime
        self.gate = CallGate(runtime, SERVED)
        idle_ms = round(settings.read_timeout_s * 1000)
        self.server = grpc.aio.server(
            # tracing outermost: a refused call is traced with its status
            interceptors=[*tracing.grpc_interceptors(), self.gate],
            options=[
                ("grpc.max_receive_message_length", settings.max_body_bytes + MESSAGE_HEADROOM),
                ("grpc.max_send_message_length", -1),
                ("grpc.max_allowed_incoming_connections", settings.max_connections),
                ("grpc.max_concurrent_streams", settings.max_connections),
                ("grpc.server_handshake_timeout_ms", idle_ms),
                ("grpc.max_connection_idle_ms", idle_ms),
                ("grpc.keepalive_time_ms", idle_ms),
                ("grpc.keepalive_timeout_ms", idle_ms),
                ("grpc.so_reuseport", 0),  # a second server on the port fails instead of sharing
            ],
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(runtime), self.server
        )

    async def start(self) -> None:
        settings = self.runtime.settings
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        address = f"{host}:{settings.grpc_port}"
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as err:  # newer grpcio raises where older ones returned 0
            raise OSError(f"gRPC cannot listen on {address} (--grpc-port): {err}") from None
        if not bound:
            raise OSError(f"gRPC cannot listen on {address} (--grpc-port)")
        await self.server.start()
        log.info("gRPC (KServe v2) on %s", address)

    async def stop(self) -> None:
        """Once the runtime drains: the calls in flight finish, up to its drain deadline, while
        the probes still answer (not ready) and new calls are refused; then gRPC stops, ending
        what still runs (UNAVAILABLE)."""
        self.runtime.drain()
        left = max(0.0, self.runtime.drain_deadline - time.monotonic())
        try:  # a wait of no time left times out even when there is nothing to wait for
            if not self.gate.idle.is_set():
                await asyncio.wait_for(self.gate.idle.wait(), left)
        except TimeoutError:
            log.warning("%d gRPC calls did not finish within the drain", self.gate.in_flight)
        await self.server.stop(0)
