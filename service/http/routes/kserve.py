"""KServe v2 / Open Inference Protocol over HTTP: stock clients (tritonclient) work unchanged.
The models and the inference itself are service/core/inference.py, shared with gRPC.

The infer routes are `InferEndpoint`, which service/http/endpoints.py hands every such request
(without FastAPI's routing and dependency solving); FastAPI documents them from the declarations
below."""

from __future__ import annotations

import asyncio
import math
import re

import torch
from fastapi import APIRouter, Request, Response
from starlette.types import Receive, Scope, Send

from ... import off_loop, tracing
from ...codecs.json_numbers import NUMBER_BYTES
from ...codecs.kserve import (
    HEADER_LENGTH,
    SHM_REGION,
    Encoded,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    decode_request,
    encode_response,
    wants_binary,
)
from ...core import inference
from ...core.runtime import Runtime
from ...errors import BadInput, PayloadTooLarge, ServiceError, error_response
from .. import probes
from ..body import read_body
from ..deps import EngineDep, RuntimeDep
from ..examples import DEMO_ROWS
from ..plain_forward import BINARY
from ..schemas import ErrorBody, inline_json_schema
from ..server import client_gone
from .shared_memory import caller

router = APIRouter(prefix="/v2", tags=["kserve-v2"])
INFER_PATH = "/models/{name}/infer"
VERSION_INFER_PATH = "/models/{name}/versions/{version}/infer"


@router.get("", summary="Server metadata")
async def server_metadata(runtime: RuntimeDep) -> ServerMetadata:
    return inference.server_metadata(runtime)


# The probes are answered from the runtime's probe state as a front end answers them
# (service/http/probes.py)
@router.get(
    probes.LIVE_V2.removeprefix(router.prefix),
    summary="200 while the process serves",
    response_model=dict[str, bool],
)
async def live(runtime: RuntimeDep) -> Response:
    return probes.live_v2(runtime.probe_state())


@router.get(
    probes.READY_V2.removeprefix(router.prefix),
    summary="200 once every layer is loaded and warm, else 503",
)
async def ready(runtime: RuntimeDep) -> Response:
    return probes.ready_v2(runtime.probe_state())


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
    "/models/{name}/config",
    summary="Model configuration in Triton's schema: tensors, batching, queue policy, instances",
    responses={404: {"model": ErrorBody}},
)
async def model_config(name: str, runtime: RuntimeDep) -> dict:
    return inference.model_config(runtime, name)


@router.get(
    "/models/{name}/versions/{version}/config",
    summary="Model configuration of a named version",
    responses={404: {"model": ErrorBody}},
)
async def version_config(name: str, version: str, runtime: RuntimeDep) -> dict:
    return inference.model_config(runtime, name, version)


@router.get(
    probes.MODEL_READY.removeprefix(router.prefix),
    summary="200 when the model can serve",
    response_model=dict[str, bool],
    responses={404: {"model": ErrorBody}},
)
async def model_ready(name: str, runtime: RuntimeDep) -> Response:
    return probes.model_ready(runtime.probe_state(), name)


@router.get(
    "/models/{name}/versions/{version}",
    summary="Model metadata of a named version",
    responses={404: {"model": ErrorBody}},
)
async def version_metadata(name: str, version: str, engine: EngineDep) -> ModelMetadata:
    return inference.model_metadata(inference.get_model(engine, name, version))


@router.get(
    probes.VERSION_READY.removeprefix(router.prefix),
    summary="200 when the version can serve",
    response_model=dict[str, bool],
    responses={404: {"model": ErrorBody}},
)
async def version_ready(name: str, version: str, runtime: RuntimeDep) -> Response:
    return probes.model_ready(runtime.probe_state(), name, version)


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


@router.post(
    INFER_PATH,
    summary="Inference with JSON tensors or the binary tensor data extension",
    response_model=InferResponse,
    responses={400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 429: {"model": ErrorBody}},
    openapi_extra=_INFER_OPENAPI,
)
async def infer(name: str) -> Response:  # noqa: ARG001 (InferEndpoint answers)
    raise AssertionError(f"InferEndpoint answers {INFER_PATH}, before FastAPI's routing")


@router.post(
    VERSION_INFER_PATH,
    summary="Inference on a named version (as /v2/models/{name}/infer)",
    responses={400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 429: {"model": ErrorBody}},
    openapi_extra=_INFER_OPENAPI,
)
async def version_infer(
    name: str,  # noqa: ARG001 (InferEndpoint answers)
    version: str,  # noqa: ARG001
) -> Response:
    raise AssertionError(f"InferEndpoint answers {VERSION_INFER_PATH}, before FastAPI's routing")


class InferEndpoint:
    """The two infer routes' whole work: the body (413), the KServe decode (400), a JSON reply
    that would be too large (413, before the forward), inference (service/core/inference.py:
    readiness, the model, shared memory, the batcher, withdrawn if the client goes away), the
    reply. A large body is decoded, and a large reply encoded, off the event loop
    (service/off_loop.py)."""

    path = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        by_path = {getattr(r, "path", None): r for r in router.routes}
        # the declarations, by whether a version is named: the request metrics' labels
        self.routes = (
            by_path[router.prefix + INFER_PATH],
            by_path[router.prefix + VERSION_INFER_PATH],
        )

    async def __call__(
        self, scope: Scope, receive: Receive, send: Send, name: str, version: str | None
    ) -> None:
        scope["route"] = self.routes[version is not None]
        request = Request(scope, receive)
        runtime = self.runtime
        withdrawn = None
        try:
            body = await read_body(request, runtime)
            infer_request, tensors = await _decode(body, _header_length(request))
            _check_json_reply(infer_request, runtime.settings.max_json_bytes)
            owner = caller(request, runtime)
            withdrawn = asyncio.ensure_future(client_gone(receive))
            result = await inference.infer(
                runtime, name, version or "", infer_request, tensors, owner, withdrawn
            )
            with tracing.span("reply"):
                encoded = await _encode(name, infer_request, result)
            if encoded.header_length is None:
                response = Response(encoded.body, media_type="application/json")
            else:
                length = {HEADER_LENGTH: str(encoded.header_length)}
                response = Response(encoded.body, media_type=BINARY, headers=length)
        except ServiceError as err:
            response = error_response(err.status, err.message, err.headers)
        finally:
            if withdrawn is not None:
                withdrawn.cancel()
        await response(scope, receive, send)


async def _decode(
    body: bytes, header_length: int | None
) -> tuple[InferRequest, dict[str, torch.Tensor]]:
    """decode_request, off the loop when large: a large JSON part on the JSON threads, else a
    large body (its binary tensors copied) on a thread."""
    json_bytes = len(body) if header_length is None else header_length
    if json_bytes > off_loop.JSON.on_loop_bytes:
        return await off_loop.JSON.off_loop(decode_request, body, header_length)
    return await off_loop.BINARY.run(len(body), decode_request, body, header_length)


async def _encode(name: str, request: InferRequest, result: inference.InferenceResult) -> Encoded:
    """encode_response, off the loop when large (a JSON output by its numbers)."""
    outputs = result.outputs
    numbers = sum(t.numel() for n, t in outputs.items() if not wants_binary(request, n))
    args = (encode_response, name, inference.VERSION, request, outputs, result.placed)
    if numbers:
        return await off_loop.JSON.run(numbers * NUMBER_BYTES, *args)
    return await off_loop.BINARY.run(sum(t.nbytes for t in outputs.values()), *args)


def _check_json_reply(request: InferRequest, limit: int) -> None:
    """Refuse, before the forward, an output the reply would carry as JSON beyond `limit` bytes
    (MOE_SERVE_MAX_JSON_BYTES, as for JSON bodies): printing it holds the GIL, and its text is
    several times its binary size. The output is as large as hidden_states; its size is
    reckoned at NUMBER_BYTES a number."""
    hidden = next((t for t in request.inputs if t.name == "hidden_states"), None)
    if hidden is None or wants_binary(request, inference.OUTPUT):
        return
    requested = [o for o in request.outputs or () if o.name == inference.OUTPUT]
    if any(SHM_REGION in o.parameters for o in requested):  # written into a region
        return
    size = math.prod(hidden.shape) * NUMBER_BYTES
    if size > limit:
        raise PayloadTooLarge(
            f"output {inference.OUTPUT} of shape {hidden.shape} would be about {size} bytes of "
            f"JSON, over the {limit}-byte limit of JSON (MOE_SERVE_MAX_JSON_BYTES); ask for it "
            'in binary: "parameters": {"binary_data_output": true} on the request, or '
            '"binary_data": true in the output\'s parameters'
        )
