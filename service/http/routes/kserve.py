"""KServe v2 / Open Inference Protocol over HTTP: stock clients (tritonclient) work unchanged.
The models and the inference itself are service/core/inference.py, shared with gRPC."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ... import tracing
from ...codecs.kserve import (
    HEADER_LENGTH,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    decode_request,
    encode_response,
)
from ...core import inference
from ...errors import BadInput
from ..deps import BodyDep, EngineDep, Runtime, RuntimeDep
from ..examples import DEMO_ROWS
from ..plain_forward import BINARY
from ..schemas import ErrorBody, inline_json_schema
from .shared_memory import caller

router = APIRouter(prefix="/v2", tags=["kserve-v2"])


@router.get("", summary="Server metadata")
async def server_metadata(runtime: RuntimeDep) -> ServerMetadata:
    return inference.server_metadata(runtime)


@router.get("/health/live", summary="200 while the process serves")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready", summary="200 once every layer is loaded and warm, else 503")
async def ready(runtime: RuntimeDep) -> JSONResponse:
    if runtime.not_ready is not None:
        return JSONResponse({"error": f"not ready: {runtime.not_ready}"}, status_code=503)
    return JSONResponse({"ready": True})


@router.get("/models/stats", summary="Statistics of every model, in Triton's schema")
async def all_statistics(runtime: RuntimeDep) -> dict:
    return inference.statistics(runtime)


@router.get(
    "/models/{name}/stats",
    summary="Statistics of one model: requests, queue and compute time, batch sizes",
    responses={404: {"model": ErrorBody}},
)
async def model_statistics(name: str, runtime: RuntimeDep) -> dict:
    return inference.statistics(runtime, name)


@router.get(
    "/models/{name}/versions/{version}/stats",
    summary="Statistics of one model version",
    responses={404: {"model": ErrorBody}},
)
async def version_statistics(name: str, version: str, runtime: RuntimeDep) -> dict:
    return inference.statistics(runtime, name, version)


@router.get(
    "/models/{name}",
    summary="Model metadata: input and output tensors",
    responses={404: {"model": ErrorBody}},
)
async def model_metadata(name: str, engine: EngineDep) -> ModelMetadata:
    return inference.model_metadata(inference.get_model(engine, name))


@router.get(
    "/models/{name}/ready",
    summary="200 when the model can serve",
    responses={404: {"model": ErrorBody}},
)
async def model_ready(name: str, engine: EngineDep) -> dict[str, bool]:
    inference.get_model(engine, name)
    return {"ready": True}


@router.get(
    "/models/{name}/versions/{version}",
    summary="Model metadata of a named version",
    responses={404: {"model": ErrorBody}},
)
async def version_metadata(name: str, version: str, engine: EngineDep) -> ModelMetadata:
    return inference.model_metadata(inference.get_model(engine, name, version))


@router.get(
    "/models/{name}/versions/{version}/ready",
    summary="200 when the version can serve",
    responses={404: {"model": ErrorBody}},
)
async def version_ready(name: str, version: str, engine: EngineDep) -> dict[str, bool]:
    inference.get_model(engine, name, version)
    return {"ready": True}


def _header_length(request: Request) -> int | None:
    value = request.headers.get(HEADER_LENGTH)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):  # "²".isdigit(), but int("²") raises
        raise BadInput(f"{HEADER_LENGTH} must be a byte count, got {value!r}")
    return int(value)


_DEMO_INPUT = {
    "name": "hidden_states",
    "shape": [1, len(DEMO_ROWS[0])],
    "datatype": "FP32",
    "data": DEMO_ROWS[0],
}
_INFER_OPENAPI = {
    "requestBody": {
        "required": True,
        "description": f"JSON; or, with the {HEADER_LENGTH} header, JSON followed by the raw "
        "bytes of each input that has parameters.binary_data_size",
        "content": {
            "application/json": {
                "schema": inline_json_schema(InferRequest),
                "examples": {
                    "JSON tensors": {"value": {"id": "42", "inputs": [_DEMO_INPUT]}},
                    "binary output": {
                        "value": {
                            "inputs": [_DEMO_INPUT],
                            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
                        }
                    },
                },
            }
        },
    }
}


async def infer_response(
    name: str, version: str, request: Request, body: bytes, runtime: Runtime
) -> Response:
    """The reply to an infer request (both routes, and service/http/kserve_fast_path.py)."""
    infer_request, tensors = decode_request(body, _header_length(request))
    owner = caller(request, runtime)
    result = await inference.infer(
        runtime, name, version, infer_request, tensors, owner, http_request=request
    )
    with tracing.reply_span():
        encoded = encode_response(name, infer_request, result.outputs, result.placed)
    if encoded.header_length is None:
        return Response(encoded.body, media_type="application/json")
    return Response(
        encoded.body,
        media_type=BINARY,
        headers={HEADER_LENGTH: str(encoded.header_length)},
    )


@router.post(
    "/models/{name}/infer",
    summary="Inference with JSON tensors or the binary tensor data extension",
    response_model=InferResponse,
    responses={400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 429: {"model": ErrorBody}},
    openapi_extra=_INFER_OPENAPI,
)
async def infer(name: str, request: Request, body: BodyDep, runtime: RuntimeDep) -> Response:
    return await infer_response(name, "", request, body, runtime)


@router.post(
    "/models/{name}/versions/{version}/infer",
    summary="Inference on a named version (as /v2/models/{name}/infer)",
    responses={400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 429: {"model": ErrorBody}},
    openapi_extra=_INFER_OPENAPI,
)
async def version_infer(
    name: str, version: str, request: Request, body: BodyDep, runtime: RuntimeDep
) -> Response:
    return await infer_response(name, version, request, body, runtime)
