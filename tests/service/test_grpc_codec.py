"""The gRPC reply as codec.encode_infer serializes it itself: the same message protobuf reads
back as one built field by field, outputs in the message and in shared memory alike."""

from __future__ import annotations

import pytest
import torch

from moe_serve.service.codecs.kserve import InferOutput, InferRequest

pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb

from moe_serve.service.grpc.codec import RAW_OUTPUT_CONTENTS, _varint, encode_infer


def _built(
    request: InferRequest, outputs: dict, placed: list[InferOutput]
) -> pb.ModelInferResponse:
    """The reply built field by field, as protobuf serializes it."""
    response = pb.ModelInferResponse(model_name="m", model_version="1", id=request.id)
    for name, tensor in outputs.items():
        response.outputs.add(name=name, datatype="FP32", shape=list(tensor.shape))
        response.raw_output_contents.append(tensor.numpy().tobytes())
    for entry in placed:
        out = response.outputs.add(name=entry.name, datatype=entry.datatype, shape=entry.shape)
        for key, value in entry.parameters.items():
            if isinstance(value, str):
                out.parameters[key].string_param = value
            else:
                out.parameters[key].int64_param = value
    return response


# rows: 1 (a one-byte length), 10 (two bytes), 8192 x 64 floats (a three-byte length)
@pytest.mark.parametrize("rows", [1, 10, 8192])
@pytest.mark.parametrize("stream", [False, True])
def test_the_reply_reads_back_as_the_message_built_field_by_field(rows: int, stream: bool) -> None:
    request = InferRequest(id="req-1", inputs=[])
    output = torch.randn(rows, 64 if rows > 1 else 7)
    outputs = {"output": output}
    wire = encode_infer("m", "1", request, outputs, stream=stream)
    expected = _built(request, outputs, [])
    if stream:
        wire = pb.ModelStreamInferResponse.FromString(wire)
        assert not wire.error_message
        got = wire.infer_response
    else:
        got = pb.ModelInferResponse.FromString(wire)
    assert got == expected
    assert got.raw_output_contents[0] == output.numpy().tobytes()


def test_outputs_in_shared_memory_are_listed_after_those_in_the_reply() -> None:
    request = InferRequest(inputs=[])
    output = torch.ones(2, 3)
    placed = [
        InferOutput(
            name="output",
            shape=[2, 3],
            datatype="FP32",
            parameters={"shared_memory_region": "r", "shared_memory_byte_size": 24},
        )
    ]
    for outputs in ({}, {"output": output}):
        wire = encode_infer("m", "1", request, outputs, placed)
        assert pb.ModelInferResponse.FromString(wire) == _built(request, outputs, placed)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 1 << 21])
def test_lengths_are_written_as_protobuf_writes_them(size: int) -> None:
    contents = b"x" * size
    message = pb.ModelInferResponse(raw_output_contents=[contents])
    assert message.SerializeToString() == RAW_OUTPUT_CONTENTS + _varint(size) + contents


def test_a_request_decodes_to_the_models_of_its_fields() -> None:
    """Every field of the message, its parameters of each type and its empty maps alike, lands
    where the HTTP codec's models put it."""
    from moe_serve.service.codecs.kserve import InferInput, RequestedOutput
    from moe_serve.service.grpc.codec import decode_infer

    message = pb.ModelInferRequest(model_name="m", id="req-2")
    message.parameters["priority"].uint64_param = 2
    message.parameters["sequence_start"].bool_param = True
    hidden = message.inputs.add(name="hidden_states", datatype="FP32", shape=[2, 3])
    hidden.parameters["shared_memory_region"].string_param = "r"
    hidden.parameters["shared_memory_byte_size"].int64_param = 24
    logits = message.inputs.add(name="router_logits", datatype="FP32", shape=[2, 4])
    logits.contents.fp32_contents.extend([0.5] * 8)
    output = message.outputs.add(name="output")
    output.parameters["scale"].double_param = 0.25
    request, tensors = decode_infer(message)
    assert request == InferRequest(
        id="req-2",
        parameters={"priority": 2, "sequence_start": True},
        inputs=[
            InferInput(
                name="hidden_states",
                shape=[2, 3],
                datatype="FP32",
                parameters={"shared_memory_region": "r", "shared_memory_byte_size": 24},
            ),
            InferInput(name="router_logits", shape=[2, 4], datatype="FP32"),
        ],
        outputs=[RequestedOutput(name="output", parameters={"scale": 0.25})],
    )
    assert list(tensors) == ["router_logits"] and tensors["router_logits"].eq(0.5).all()
    bare, _ = decode_infer(pb.ModelInferRequest(model_name="m"))
    assert bare == InferRequest(inputs=[]) and bare.outputs is None
