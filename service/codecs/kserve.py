"""Open Inference Protocol (KServe v2) bodies and the binary tensor data extension.

A binary request is a JSON header followed by raw little-endian row-major tensor bytes, in
input order; the `Inference-Header-Content-Length` header gives the JSON's length, and each
binary input carries `parameters.binary_data_size`. Outputs go binary when the request asks,
per output (`binary_data`) or for all (`binary_data_output`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

from ...weights.errors import describe_validation_error
from ..errors import BadInput
from .body_limit import HEADER_LENGTH
from .json_tensors import array_to_tensor
from .shapes import too_large, too_large_message

# The shared-memory extension's tensor parameters (inputs and requested outputs)
SHM_REGION = "shared_memory_region"
SHM_OFFSET = "shared_memory_offset"
SHM_BYTE_SIZE = "shared_memory_byte_size"

# The datatypes a layer takes (hidden states and router logits are floating point, in the
# layer's wire dtypes); an error listing accepted datatypes lists exactly these.
DATATYPES: dict[str, torch.dtype] = {
    "FP32": torch.float32,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
}
DATATYPE_NAMES = {dtype: name for name, dtype in DATATYPES.items()}


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: list[Any] | None = None

    @field_validator("shape", mode="before")
    @classmethod
    def _integers(cls, shape: object, info: ValidationInfo) -> object:
        """Integers only: pydantic would read true, "1" and 1.0 as 1."""
        if isinstance(shape, list) and not all(type(size) is int for size in shape):
            raise ValueError(f"input {info.data.get('name')}: shape must be integers, got {shape}")
        return shape


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[InferInput]
    outputs: list[RequestedOutput] | None = None


class InferOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[InferOutput]


@dataclass(frozen=True)
class Encoded:
    body: bytes
    header_length: int | None  # set when binary tensors follow the JSON


def _dtype(t: InferInput) -> torch.dtype:
    try:
        return DATATYPES[t.datatype]
    except KeyError:
        names = ", ".join(DATATYPES)
        raise BadInput(
            f"input {t.name}: datatype {t.datatype!r} is not supported; expected one of {names}"
        ) from None


def _shape(t: InferInput) -> list[int]:
    if any(d < 0 for d in t.shape):
        raise BadInput(f"input {t.name}: shape {t.shape} has a negative dimension")
    if too_large(t.shape):
        raise BadInput(f"input {t.name}: {too_large_message(t.shape)}")
    return t.shape


def byte_size(t: InferInput) -> int:
    """The bytes of input `t` by its shape and datatype."""
    return math.prod(_shape(t)) * _dtype(t).itemsize


def tensor_type(t: InferInput) -> tuple[torch.dtype, list[int]]:
    """Input `t`'s dtype and shape (checked)."""
    return _dtype(t), _shape(t)


def tensor_from_bytes(t: InferInput, raw: bytes | memoryview) -> torch.Tensor:
    """Raw little-endian row-major bytes -> t's tensor (a copy: `raw` may be shared memory)."""
    dtype, shape = tensor_type(t)
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise BadInput(
            f"input {t.name}: {len(raw)} binary bytes for shape {shape} {t.datatype} "
            f"({expected} expected)"
        )
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _from_json(t: InferInput) -> torch.Tensor:
    dtype, shape = _dtype(t), _shape(t)
    if t.data is None:
        raise BadInput(f"input {t.name}: neither data nor parameters.binary_data_size is given")
    return array_to_tensor(f"input {t.name} data", t.data, shape, dtype)


def check_input_names(request: InferRequest) -> None:
    seen = set()
    for t in request.inputs:
        if t.name in seen:
            raise BadInput(f"input {t.name} is given twice")
        seen.add(t.name)


def decode_request(
    body: bytes, header_length: int | None
) -> tuple[InferRequest, dict[str, torch.Tensor]]:
    """A request body (JSON, or JSON + binary tensors) -> the request and its input tensors."""
    if header_length is not None and not 0 < header_length <= len(body):
        raise BadInput(f"{HEADER_LENGTH} is {header_length} but the body has {len(body)} bytes")
    split = len(body) if header_length is None else header_length
    try:
        request = InferRequest.model_validate_json(body[:split])
    except ValidationError as err:
        raise BadInput(f"inference request: {describe_validation_error(err, 'body')}") from None
    binary, offset, tensors = memoryview(body)[split:], 0, {}  # slices without copies
    check_input_names(request)
    for t in request.inputs:
        if SHM_REGION in t.parameters:  # read from the region later (service/core/inference.py)
            if t.data is not None or "binary_data_size" in t.parameters:
                raise BadInput(f"input {t.name}: data given both inline and in shared memory")
            continue
        size = t.parameters.get("binary_data_size")
        if size is None:
            tensors[t.name] = _from_json(t)
            continue
        if t.data is not None:
            raise BadInput(f"input {t.name}: both data and parameters.binary_data_size are given")
        if type(size) is not int or size < 0 or offset + size > len(binary):  # True is no size
            raise BadInput(
                f"input {t.name}: binary_data_size {size!r} does not fit the "
                f"{len(binary) - offset} binary bytes left"
            )
        tensors[t.name] = tensor_from_bytes(t, binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise BadInput(f"{len(binary) - offset} binary bytes follow the last declared input")
    return request, tensors


def _flag(parameters: dict[str, Any], name: str, where: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):  # "no" would be truthy
        raise BadInput(f"{where}parameters.{name} must be true or false, got {value!r}")
    return value


def wants_binary(request: InferRequest, output: str) -> bool:
    for requested in request.outputs or ():
        if requested.name == output:
            return _flag(requested.parameters, "binary_data", f"output {output}: ")
    return _flag(request.parameters, "binary_data_output", "")


def encode_response(
    model_name: str,
    version: str,
    request: InferRequest,
    outputs: dict[str, torch.Tensor],
    placed: Sequence[InferOutput] = (),
) -> Encoded:
    """Output tensors -> a response body; binary outputs follow the JSON in output order.
    `placed` are outputs already written into shared memory: listed, with no data."""
    entries, blobs = [], []
    for name, tensor in outputs.items():
        entry = InferOutput(
            name=name, shape=list(tensor.shape), datatype=DATATYPE_NAMES[tensor.dtype]
        )
        if wants_binary(request, name):
            raw = tensor_bytes(tensor)
            entry.parameters = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry.data = tensor.flatten().tolist()
        entries.append(entry)
    header = InferResponse(
        model_name=model_name, model_version=version, id=request.id, outputs=[*entries, *placed]
    )
    json_bytes = header.model_dump_json(exclude_none=True).encode()
    if not blobs:
        return Encoded(json_bytes, None)
    return Encoded(b"".join([json_bytes, *blobs]), len(json_bytes))  # one copy of the blobs


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU tensor's raw little-endian row-major bytes."""
    return tensor.contiguous().flatten().view(torch.uint8).numpy().tobytes()
