"""KServe v2 over gRPC: the GRPCInferenceService of tritonclient's generated stubs, served by
grpc.aio on the event loop that runs uvicorn, so both transports share one batcher.

Every RPC but ServerLive and ServerReady needs the bearer token (metadata `authorization`) when
one is set; errors are service/errors.py's, sent as the gRPC status of GRPC_STATUS with the
same message as over HTTP.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TypeVar

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from .. import logs, tracing
from ..auth import bearer_matches
from ..core import inference
from ..core.runtime import Runtime, ready, repository_of
from ..errors import ServiceError, Unauthorized, UnknownLayer, capped, grpc_status
from ..triton.repository import check_load_parameters
from ..triton.shared_memory import owner_of
from .codec import decode_infer, encode_infer, from_model, parameters_to_dict

log = logging.getLogger(__name__)

Request = TypeVar("Request")
Reply = TypeVar("Reply")
Method = Callable[["InferenceServicer", Request], Awaitable[Reply]]
# whose shared-memory regions the RPC may use (shared_memory.owner_of; None without auth)
caller: ContextVar[str | None] = ContextVar("caller", default=None)
Handler = Callable[["InferenceServicer", Request, grpc.aio.ServicerContext], Awaitable[Reply]]


def _metadata(context: grpc.aio.ServicerContext) -> tuple[str, str]:
    """The call's (x-request-id, authorization) metadata, "" where absent: one pass."""
    request_id = authorization = ""
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and not request_id:
            request_id = value
        elif key == "authorization" and not authorization:
            authorization = value
    return request_id, authorization


def rpc(*, open_to_all: bool = False) -> Callable[[Method], Handler]:
    """An RPC from `method(self, request)`: request id, bearer token, our errors as gRPC
    statuses, the request metrics."""

    def wrap(method: Method) -> Handler:
        route = f"grpc {method.__name__}"

        @functools.wraps(method)
        async def handler(
            self: InferenceServicer, request: Request, context: grpc.aio.ServicerContext
        ) -> Reply:
            request_id, authorization = _metadata(context)
            reset = logs.request_id.set(logs.new_request_id(request_id))
            caller.set(None if self.token is None else owner_of(authorization))
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                if not open_to_all:
                    self.authorize(authorization)
                return await method(self, request)
            except ServiceError as err:
                code = grpc_status(err)
                await context.abort(code, capped(err.message))
            except Exception:
                log.exception("unhandled error in %s", route)
                code = grpc.StatusCode.INTERNAL
                await context.abort(code, f"internal error; request id {logs.request_id.get()}")
            finally:
                seconds = time.perf_counter() - started
                self.runtime.metrics.observe_request(route, code.name, seconds)
                log.info("%s -> %s in %.1f ms", route, code.name, seconds * 1e3)
                logs.request_id.reset(reset)

        return handler

    return wrap


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The RPCs moe-serve answers; the others answer UNIMPLEMENTED (the stubs' default)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.token = runtime.settings.api_token_bytes()

    def authorize(self, authorization: str) -> None:
        if self.token is not None and not bearer_matches(authorization, self.token):
            raise Unauthorized("missing or wrong bearer token (metadata 'authorization')")

    @rpc(open_to_all=True)
    async def ServerLive(self, _request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @rpc(open_to_all=True)
    async def ServerReady(self, _request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.runtime.not_ready is None)

    @rpc()
    async def ModelReady(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        if self.runtime.not_ready is not None:
            return pb.ModelReadyResponse(ready=False)
        try:
            inference.get_model(self.runtime.engine, request.name, request.version)
        except UnknownLayer:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    @rpc()
    async def ServerMetadata(self, _request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return from_model(inference.server_metadata(self.runtime), pb.ServerMetadataResponse)

    @rpc()
    async def ModelMetadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        served = inference.get_model(ready(self.runtime).engine, request.name, request.version)
        return from_model(inference.model_metadata(served), pb.ModelMetadataResponse)

    @rpc()
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest
    ) -> pb.ModelStatisticsResponse:
        stats = inference.statistics(self.runtime, request.name, request.version)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    @rpc()
    async def ModelInfer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        infer_request, tensors = decode_infer(request)
        name, version = request.model_name, request.model_version
        result = await inference.infer(
            self.runtime, name, version, infer_request, tensors, caller.get()
        )
        with tracing.reply_span():
            return encode_infer(
                name, inference.VERSION, infer_request, result.outputs, result.placed
            )

    # Triton's model repository extension (service/triton/repository.py)
    @rpc()
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest
    ) -> pb.RepositoryIndexResponse:
        entries = repository_of(self.runtime).index(self.runtime, request.ready)
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**e.to_json()) for e in entries]
        )

    @rpc()
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest
    ) -> pb.RepositoryModelLoadResponse:
        check_load_parameters(parameters_to_dict(request.parameters))
        await repository_of(self.runtime).load(ready(self.runtime), request.model_name)
        return pb.RepositoryModelLoadResponse()

    @rpc()
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest
    ) -> pb.RepositoryModelUnloadResponse:
        await repository_of(self.runtime).unload(ready(self.runtime), request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # Triton's shared-memory extension (service/triton/shared_memory.py); regions are the HTTP ones
    @rpc()
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest
    ) -> pb.SystemSharedMemoryStatusResponse:
        regions = self.runtime.shared_memory.status("system", request.name, caller.get())
        return pb.SystemSharedMemoryStatusResponse(
            regions={
                r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r) for r in regions
            }
        )

    @rpc()
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self.runtime.shared_memory.register_system(
            request.name, request.key, request.offset, request.byte_size, caller.get()
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc()
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self.runtime.shared_memory.unregister("system", request.name, caller.get())
        return pb.SystemSharedMemoryUnregisterResponse()

    @rpc()
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest
    ) -> pb.CudaSharedMemoryStatusResponse:
        regions = self.runtime.shared_memory.status("cuda", request.name, caller.get())
        return pb.CudaSharedMemoryStatusResponse(
            regions={
                r["name"]: pb.CudaSharedMemoryStatusResponse.RegionStatus(**r) for r in regions
            }
        )

    @rpc()
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest
    ) -> pb.CudaSharedMemoryRegisterResponse:
        self.runtime.shared_memory.register_cuda(
            request.name, request.raw_handle, request.device_id, request.byte_size, caller.get()
        )
        return pb.CudaSharedMemoryRegisterResponse()

    @rpc()
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        self.runtime.shared_memory.unregister("cuda", request.name, caller.get())
        return pb.CudaSharedMemoryUnregisterResponse()


async def start_grpc_server(runtime: Runtime) -> grpc.aio.Server:
    """Serve GRPCInferenceService on settings.host:grpc_port, on the running event loop."""
    settings = runtime.settings
    server = grpc.aio.server(
        interceptors=tracing.grpc_interceptors(),
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),  # a second server on the port fails instead of sharing it
        ],
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(runtime), server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.grpc_port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as err:  # newer grpcio raises where older ones returned 0
        raise OSError(f"gRPC cannot listen on {address} (--grpc-port): {err}") from None
    if not bound:
        raise OSError(f"gRPC cannot listen on {address} (--grpc-port)")
    await server.start()
    log.info("gRPC (KServe v2) on %s", address)
    return server
