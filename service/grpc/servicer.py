"""KServe v2 over gRPC: the GRPCInferenceService of tritonclient's generated stubs. Each method
takes its request message and answers its reply (inference's already serialized), or raises one
of service/errors.py's errors;
interceptors.py's CallGate admits, reads and answers the calls around them, and server.py
serves them on the event loop that runs uvicorn, so both transports share one batcher.
"""

from __future__ import annotations

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from .. import logs, tracing
from ..core import inference
from ..core.runtime import Runtime, ready, repository_of
from ..errors import UnknownLayer
from ..off_loop import BINARY
from ..triton.repository import check_load_parameters
from .codec import decode_infer, encode_infer, from_model, input_bytes, parameters_to_dict
from .interceptors import caller

Context = grpc.aio.ServicerContext


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The RPCs moe-serve answers (SERVED); CallGate answers the others UNIMPLEMENTED."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def ready(self) -> bool:
        """Ready, and not draining: a load balancer sends no more calls once SIGTERM came."""
        return self.runtime.not_ready is None and self.runtime.drain_deadline is None

    async def ServerLive(
        self, _request: pb.ServerLiveRequest, _context: Context
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, _request: pb.ServerReadyRequest, _context: Context
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.ready())

    async def ModelReady(
        self, request: pb.ModelReadyRequest, _context: Context
    ) -> pb.ModelReadyResponse:
        if not self.ready():
            return pb.ModelReadyResponse(ready=False)
        try:
            inference.get_model(self.runtime.engine, request.name, request.version)
        except UnknownLayer:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(
        self, _request: pb.ServerMetadataRequest, _context: Context
    ) -> pb.ServerMetadataResponse:
        return from_model(inference.server_metadata(self.runtime), pb.ServerMetadataResponse)

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, _context: Context
    ) -> pb.ModelMetadataResponse:
        served = inference.get_model(ready(self.runtime).engine, request.name, request.version)
        return from_model(inference.model_metadata(served), pb.ModelMetadataResponse)

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, _context: Context
    ) -> pb.ModelConfigResponse:
        config = inference.model_config(self.runtime, request.name, request.version)
        return pb.ModelConfigResponse(
            config=json_format.ParseDict(config, model_config_pb2.ModelConfig())
        )

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, _context: Context
    ) -> pb.ModelStatisticsResponse:
        stats = inference.statistics(self.runtime, request.name, request.version)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def ModelInfer(self, request: pb.ModelInferRequest, _context: Context) -> bytes:
        """A ModelInferResponse, serialized (codec.encode_infer copies each output once)."""
        return await self._infer(request, stream=False)

    async def ModelStreamInfer(self, request: pb.ModelInferRequest, _context: Context) -> bytes:
        """One request of a stream: CallGate reads the stream, calls this for each request it
        carries and answers them in order (a model here is never decoupled: one response per
        request); a ModelStreamInferResponse, serialized."""
        return await self._infer(request, stream=True)

    async def _infer(self, request: pb.ModelInferRequest, stream: bool) -> bytes:
        infer_request, tensors = await BINARY.run(input_bytes(request), decode_infer, request)
        name, version = request.model_name, request.model_version
        result = await inference.infer(
            self.runtime, name, version, infer_request, tensors, caller.get()
        )
        output_bytes = sum(t.numel() * t.element_size() for t in result.outputs.values())
        with tracing.span("reply"):
            return await BINARY.run(
                output_bytes,
                encode_infer,
                name,
                inference.VERSION,
                infer_request,
                result.outputs,
                result.placed,
                stream,
            )

    # Triton's trace and log settings (service/tracing.py, service/logs.py)
    async def TraceSetting(
        self, request: pb.TraceSettingRequest, _context: Context
    ) -> pb.TraceSettingResponse:
        model = request.model_name
        if model:
            model = inference.get_model(ready(self.runtime).engine, model).name
        changes = {key: list(setting.value) for key, setting in request.settings.items()}
        settings = (
            tracing.SETTINGS.update(changes, model) if changes else tracing.SETTINGS.get(model)
        )
        Value = pb.TraceSettingResponse.SettingValue
        return pb.TraceSettingResponse(
            settings={
                key: Value(value=value if isinstance(value, list) else [value])
                for key, value in settings.items()
            }
        )

    async def LogSettings(
        self, request: pb.LogSettingsRequest, _context: Context
    ) -> pb.LogSettingsResponse:
        changes = {
            key: None if choice is None else getattr(setting, choice)
            for key, setting in request.settings.items()
            for choice in [setting.WhichOneof("parameter_choice")]
        }
        settings = logs.update_log_settings(changes) if changes else logs.log_settings()
        Value = pb.LogSettingsResponse.SettingValue
        return pb.LogSettingsResponse(
            settings={key: _log_value(Value, value) for key, value in settings.items()}
        )

    # Triton's model repository extension (service/triton/repository.py)
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, _context: Context
    ) -> pb.RepositoryIndexResponse:
        entries = repository_of(self.runtime).index(self.runtime, request.ready)
        return pb.RepositoryIndexResponse(
            models=[pb.RepositoryIndexResponse.ModelIndex(**e.to_json()) for e in entries]
        )

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, _context: Context
    ) -> pb.RepositoryModelLoadResponse:
        check_load_parameters(parameters_to_dict(request.parameters))
        await repository_of(self.runtime).load(ready(self.runtime), request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, _context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        await repository_of(self.runtime).unload(ready(self.runtime), request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # Triton's shared-memory extension (service/triton/shared_memory.py); regions are the HTTP ones
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, _context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        regions = self.runtime.shared_memory.status("system", request.name, caller.get())
        return pb.SystemSharedMemoryStatusResponse(
            regions={
                r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r) for r in regions
            }
        )

    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, _context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        self.runtime.shared_memory.register_system(
            request.name, request.key, request.offset, request.byte_size, caller.get()
        )
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, _context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        self.runtime.shared_memory.unregister("system", request.name, caller.get())
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, _context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        regions = self.runtime.shared_memory.status("cuda", request.name, caller.get())
        return pb.CudaSharedMemoryStatusResponse(
            regions={
                r["name"]: pb.CudaSharedMemoryStatusResponse.RegionStatus(**r) for r in regions
            }
        )

    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, _context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        self.runtime.shared_memory.register_cuda(
            request.name, request.raw_handle, request.device_id, request.byte_size, caller.get()
        )
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, _context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        self.runtime.shared_memory.unregister("cuda", request.name, caller.get())
        return pb.CudaSharedMemoryUnregisterResponse()


def _log_value(value_type: type, value: object) -> object:
    """A log setting's value in the field of its type."""
    if isinstance(value, bool):
        return value_type(bool_param=value)
    if isinstance(value, int):
        return value_type(uint32_param=value)
    return value_type(string_param=str(value))


# the RPCs InferenceServicer answers: those it defines, not the stubs' UNIMPLEMENTED defaults
SERVED = frozenset(
    name
    for name in vars(InferenceServicer)
    if name in vars(service_pb2_grpc.GRPCInferenceServiceServicer)
)
