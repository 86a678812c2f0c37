"""KServe v2 gRPC messages (tritonclient's generated protobuf) <-> the transport-free forms of
service/codecs/kserve.py: an InferRequest plus its input tensors, and output tensors back.

Input tensors come as typed `contents` or, one entry per input, `raw_input_contents`; outputs
always go back as `raw_output_contents`, as Triton sends them, in a reply serialized here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from google.protobuf import json_format
from google.protobuf.message import Message
from pydantic import BaseModel
from tritonclient.grpc import service_pb2 as pb

from ..codecs.kserve import (
    DATATYPE_NAMES,
    SHM_REGION,
    InferInput,
    InferOutput,
    InferRequest,
    tensor_from_bytes,
    tensor_type,
)
from ..codecs.safetensors_wire import tensor_bytes
from ..errors import BadInput

# The tags (field number << 3 | 2: length-delimited) of ModelInferResponse.raw_output_contents
# and of ModelStreamInferResponse.infer_response, as encode_infer writes them itself
RAW_OUTPUT_CONTENTS = bytes([pb.ModelInferResponse.RAW_OUTPUT_CONTENTS_FIELD_NUMBER << 3 | 2])
STREAM_INFER_RESPONSE = bytes([pb.ModelStreamInferResponse.INFER_RESPONSE_FIELD_NUMBER << 3 | 2])

# datatype -> the InferTensorContents field that carries it: of the datatypes a layer takes
# (service.codecs.kserve.DATATYPES), FP16 and BF16 have no typed field and travel raw only
TYPED_CONTENTS = {"FP32": "fp32_contents"}


def parameters_to_dict(parameters: Mapping[str, Message]) -> dict[str, Any]:
    """An InferParameter (or ModelRepositoryParameter) map -> plain values; BadInput for a
    parameter with no value set."""
    if not parameters:  # most maps of a request are empty
        return {}
    values = {}
    for key, p in parameters.items():
        choice = p.WhichOneof("parameter_choice")
        if choice is None:
            raise BadInput(f"parameter {key!r} has no value set")
        values[key] = getattr(p, choice)
    return values


def dict_to_parameters(values: Mapping[str, Any], into: Any) -> None:
    """Fill a protobuf parameters map from plain values."""
    for key, value in values.items():
        if isinstance(value, bool):
            into[key].bool_param = value
        elif isinstance(value, int):
            into[key].int64_param = value
        elif isinstance(value, float):
            into[key].double_param = value
        else:
            into[key].string_param = str(value)


def _typed_tensor(meta: InferInput, contents: pb.InferTensorContents) -> torch.Tensor:
    dtype, _ = tensor_type(meta)  # a datatype no layer takes is named here
    field = TYPED_CONTENTS.get(meta.datatype)
    if field is None:
        raise BadInput(f"input {meta.name}: {meta.datatype} must be sent in raw_input_contents")
    given = [f.name for f, _ in contents.ListFields()]
    if given and given != [field]:
        raise BadInput(f"input {meta.name}: {meta.datatype} values go in {field}, not {given}")
    # Serialized, the one field is its tag, its length, then the values as little-endian bytes
    # (packed, as proto3 writes repeated numbers): read those, one copy at C speed, where a
    # Python float per value would hold the GIL for seconds on a large input.
    wire = contents.SerializeToString()
    values = len(getattr(contents, field)) * dtype.itemsize
    # the same checks (size) as raw bytes: one path
    return tensor_from_bytes(meta, memoryview(wire)[len(wire) - values :])


def input_bytes(message: pb.ModelInferRequest) -> int:
    """The bytes of a request's input values, raw or typed: the work of decoding them."""
    raw = sum(len(contents) for contents in message.raw_input_contents)
    return raw + sum(4 * len(t.contents.fp32_contents) for t in message.inputs)


def decode_infer(message: pb.ModelInferRequest) -> tuple[InferRequest, dict[str, torch.Tensor]]:
    """A ModelInferRequest -> the request and its input tensors (shared-memory ones excluded)."""
    # validated as one: pydantic builds the nested models itself, faster than one call each
    request = InferRequest.model_validate(
        {
            "id": message.id or None,
            "parameters": parameters_to_dict(message.parameters),
            "inputs": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "datatype": t.datatype,
                    "parameters": parameters_to_dict(t.parameters),
                }
                for t in message.inputs
            ],
            "outputs": [
                {"name": o.name, "parameters": parameters_to_dict(o.parameters)}
                for o in message.outputs
            ]
            or None,
        }
    )
    raw = message.raw_input_contents
    in_memory = [t for t in request.inputs if SHM_REGION not in t.parameters]
    if raw and any(t.HasField("contents") and t.contents.ListFields() for t in message.inputs):
        # Triton's rule too: which of the two holds an input's values would be a guess
        raise BadInput("inputs come in raw_input_contents or in typed contents, not both")
    if raw and len(raw) != len(in_memory):
        raise BadInput(
            f"{len(raw)} raw_input_contents for {len(in_memory)} inputs not in shared memory"
        )
    tensors: dict[str, torch.Tensor] = {}
    contents = {} if raw else {t.name: t.contents for t in message.inputs}
    for i, meta in enumerate(in_memory):
        if meta.name in tensors:
            raise BadInput(f"input {meta.name} is given twice")
        if raw:
            tensors[meta.name] = tensor_from_bytes(meta, raw[i])
        else:
            tensors[meta.name] = _typed_tensor(meta, contents[meta.name])
    return request, tensors


def encode_infer(
    model_name: str,
    version: str,
    request: InferRequest,
    outputs: dict[str, torch.Tensor],
    placed: Sequence[InferOutput] = (),
    stream: bool = False,
) -> bytes:
    """Output tensors -> a ModelInferResponse, serialized (as a ModelStreamInferResponse's
    infer_response where `stream`): raw bytes per output; `placed` outputs are in shared memory
    already and go back as metadata only, after the others.

    The tensors' bytes are written on the wire as the message's raw_output_contents fields,
    after the rest of it (a parser reads fields in any order), so each is copied once, into the
    reply: set in the message and serialized with it, they were copied twice more."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=version, id=request.id)
    raw = []
    for name, tensor in outputs.items():
        response.outputs.add(
            name=name, datatype=DATATYPE_NAMES[tensor.dtype], shape=list(tensor.shape)
        )
        raw.append(tensor_bytes(tensor))
    for entry in placed:
        out = response.outputs.add(name=entry.name, datatype=entry.datatype, shape=entry.shape)
        dict_to_parameters(entry.parameters or {}, out.parameters)
    parts: list[bytes | memoryview] = [response.SerializeToString()]
    for contents in raw:
        parts += [RAW_OUTPUT_CONTENTS, _varint(len(contents)), contents]
    if stream:
        parts[:0] = [STREAM_INFER_RESPONSE, _varint(sum(map(len, parts)))]
    return b"".join(parts)


def _varint(value: int) -> bytes:
    """A length as protobuf writes it: 7 bits a byte, low first, the high bit set on all but
    the last."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def from_model(model: BaseModel, message: type[Message]) -> Message:
    """A pydantic body of the HTTP API -> the gRPC message of the same schema."""
    return json_format.ParseDict(model.model_dump(exclude_none=True), message())
