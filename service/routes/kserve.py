"""KServe v2 / Open Inference Protocol: stock clients (tritonclient) work unchanged.

Each served layer is a model with inputs hidden_states [-1, H] (and optional router_logits
[-1, E]) and output `output` [-1, H] in the input's datatype.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from service import __version__
from service.batcher import RequestOptions
from service.deps import BatcherDep, BodyDep, EngineDep, RuntimeDep, submit_while_connected
from service.docs import DEMO_ROWS
from service.engine import Engine, ServedLayer
from service.errors import BadInput, UnknownLayer
from service.inputs import check_inputs
from service.kserve_codec import (
    HEADER_LENGTH,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    TensorMetadata,
    decode_request,
    encode_response,
)
from service.routes.forward import BINARY, TENSOR_NAMES, schedule_options
from service.schemas import ErrorBody, inline_json_schema

router = APIRouter(prefix="/v2", tags=["kserve-v2"])

OUTPUT = "output"
VERSION = "1"  # a layer is a model with one version; clients may name it or not


@router.get("", summary="Server metadata")
async def server_metadata() -> ServerMetadata:
    return ServerMetadata(
        name="moe-serve",
        version=__version__,
        extensions=["binary_tensor_data", "schedule_policy"],
    )


@router.get("/health/live", summary="200 while the process serves")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready", summary="200 once every layer is loaded and warm, else 503")
async def ready(runtime: RuntimeDep) -> JSONResponse:
    if runtime.not_ready is not None:
        return JSONResponse({"error": f"not ready: {runtime.not_ready}"}, status_code=503)
    return JSONResponse({"ready": True})


def _metadata(served: ServedLayer) -> ModelMetadata:
    cfg = served.config
    return ModelMetadata(
        name=served.name,
        versions=[VERSION],
        platform="moe-serve",
        inputs=[
            TensorMetadata(name="hidden_states", datatype="FP32", shape=[-1, cfg.hidden_size]),
            TensorMetadata(name="router_logits", datatype="FP32", shape=[-1, cfg.num_experts]),
        ],
        outputs=[TensorMetadata(name=OUTPUT, datatype="FP32", shape=[-1, cfg.hidden_size])],
    )


@router.get(
    "/models/{name}",
    summary="Model metadata: input and output tensors",
    responses={404: {"model": ErrorBody}},
)
async def model_metadata(name: str, engine: EngineDep) -> ModelMetadata:
    return _metadata(engine.get(name))


@router.get(
    "/models/{name}/ready",
    summary="200 when the model can serve",
    responses={404: {"model": ErrorBody}},
)
async def model_ready(name: str, engine: EngineDep) -> dict[str, bool]:
    engine.get(name)
    return {"ready": True}


def _check_version(engine: Engine, name: str, version: str) -> None:
    engine.get(name)  # an unknown model first
    if version != VERSION:
        raise UnknownLayer(f"model {name!r} has version {VERSION} only, not {version!r}")


@router.get(
    "/models/{name}/versions/{version}",
    summary="Model metadata of a named version",
    responses={404: {"model": ErrorBody}},
)
async def version_metadata(name: str, version: str, engine: EngineDep) -> ModelMetadata:
    _check_version(engine, name, version)
    return _metadata(engine.get(name))


@router.get(
    "/models/{name}/versions/{version}/ready",
    summary="200 when the version can serve",
    responses={404: {"model": ErrorBody}},
)
async def version_ready(name: str, version: str, engine: EngineDep) -> dict[str, bool]:
    _check_version(engine, name, version)
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


def _schedule_policy(parameters: dict[str, object]) -> RequestOptions:
    """The request parameters `priority` and `timeout` (microseconds) of Triton's schedule
    policy extension; absent or 0: the default."""
    values = {}
    for key in ("priority", "timeout"):
        value = parameters.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadInput(f"parameters.{key} must be an integer >= 0, got {value!r}")
        values[key] = value
    return schedule_options(values["priority"], values["timeout"])


@router.post(
    "/models/{name}/infer",
    summary="Inference with JSON tensors or the binary tensor data extension",
    response_model=InferResponse,
    responses={400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 429: {"model": ErrorBody}},
    openapi_extra=_INFER_OPENAPI,
)
async def infer(
    name: str, request: Request, body: BodyDep, engine: EngineDep, batcher: BatcherDep
) -> Response:
    served = engine.get(name)
    infer_request, tensors = decode_request(body, _header_length(request))
    unknown = sorted(set(tensors) - set(TENSOR_NAMES))
    if unknown:
        raise BadInput(f"unknown inputs {unknown}; model {name!r} takes {list(TENSOR_NAMES)}")
    if "hidden_states" not in tensors:
        raise BadInput("input hidden_states is missing")
    for requested in infer_request.outputs or ():
        if requested.name != OUTPUT:
            raise BadInput(f"unknown output {requested.name!r}; model {name!r} has {OUTPUT!r}")
    hidden = tensors["hidden_states"]
    inputs = check_inputs(served, hidden, tensors.get("router_logits"))
    options = _schedule_policy(infer_request.parameters)
    result = await submit_while_connected(request, batcher, name, inputs, options)
    encoded = encode_response(name, infer_request, {OUTPUT: result.output.to(hidden.dtype)})
    if encoded.header_length is None:
        return Response(encoded.body, media_type="application/json")
    return Response(
        encoded.body,
        media_type=BINARY,
        headers={HEADER_LENGTH: str(encoded.header_length)},
    )


@router.post(
    "/models/{name}/versions/{version}/infer",
    summary="Inference on a named version (as /v2/models/{name}/infer)",
    responses={400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 429: {"model": ErrorBody}},
    openapi_extra=_INFER_OPENAPI,
)
async def version_infer(
    name: str,
    version: str,
    request: Request,
    body: BodyDep,
    engine: EngineDep,
    batcher: BatcherDep,
) -> Response:
    _check_version(engine, name, version)
    return await infer(name, request, body, engine, batcher)
