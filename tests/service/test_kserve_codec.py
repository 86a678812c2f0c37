"""The KServe v2 codec: binary and JSON tensors round-trip; malformed requests are refused
naming the problem."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moe_serve.service.codecs.kserve import (
    InferRequest,
    decode_request,
    encode_response,
    wants_binary,
)
from moe_serve.service.errors import BadInput


def _binary_request(tensor: torch.Tensor, size: int | None = None) -> tuple[bytes, int]:
    raw = tensor.numpy().tobytes()
    header = {
        "inputs": [
            {
                "name": "hidden_states",
                "shape": list(tensor.shape),
                "datatype": "FP32",
                "parameters": {"binary_data_size": len(raw) if size is None else size},
            }
        ],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
    }
    text = json.dumps(header).encode()
    return text + raw, len(text)


def test_codec_round_trips_binary_tensors() -> None:
    x = torch.randn(3, 4)
    request, tensors = decode_request(*_binary_request(x))
    assert torch.equal(tensors["hidden_states"], x)
    encoded = encode_response("m", "1", request, {"output": x.half()})
    header = json.loads(encoded.body[: encoded.header_length])
    assert header["outputs"][0] == {
        "name": "output",
        "shape": [3, 4],
        "datatype": "FP16",
        "parameters": {"binary_data_size": 24},
    }
    back = torch.frombuffer(bytearray(encoded.body[encoded.header_length :]), dtype=torch.float16)
    assert torch.equal(back.reshape(3, 4), x.half())


def test_codec_json_tensors_accept_flat_and_nested_data() -> None:
    for data in ([1, 2, 3, 4], [[1, 2], [3, 4]]):
        body = {"inputs": [{"name": "a", "shape": [2, 2], "datatype": "FP32", "data": data}]}
        _, tensors = decode_request(json.dumps(body).encode(), None)
        assert tensors["a"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


_BOOL_SIZE = json.dumps(
    {
        "inputs": [
            {
                "name": "a",
                "shape": [1],
                "datatype": "FP32",
                "parameters": {"binary_data_size": True},
            }
        ]
    }
).encode()

CODEC_ERRORS = {
    "size mismatch": (
        lambda: _binary_request(torch.zeros(2, 4), size=16),
        "16 binary bytes for shape [2, 4]",
    ),
    "header longer than body": (lambda: (b"{}", 10), "Inference-Header-Content-Length is 10"),
    "trailing bytes": (
        lambda: (
            _binary_request(torch.zeros(1, 2))[0] + b"xx",
            _binary_request(torch.zeros(1, 2))[1],
        ),
        "2 binary bytes follow",
    ),
    "unknown datatype": (
        lambda: (
            json.dumps(
                {"inputs": [{"name": "a", "shape": [1], "datatype": "STRING", "data": ["x"]}]}
            ).encode(),
            None,
        ),
        "datatype 'STRING' is not supported",
    ),
    "too few values": (
        lambda: (
            json.dumps(
                {"inputs": [{"name": "a", "shape": [2, 2], "datatype": "FP32", "data": [1]}]}
            ).encode(),
            None,
        ),
        "1 values do not fill shape [2, 2]",
    ),
    "no data": (
        lambda: (
            json.dumps({"inputs": [{"name": "a", "shape": [1], "datatype": "FP32"}]}).encode(),
            None,
        ),
        "neither data nor parameters.binary_data_size",
    ),
    "not a request": (lambda: (b'{"inputs": 3}', None), "inputs"),
    "a datatype that is listed nowhere it is refused": (
        lambda: (_json_input("FP64", [0.5]), None),
        "datatype 'FP64' is not supported; expected one of FP32, FP16, BF16",
    ),
    "true for 1.0": (
        lambda: (_json_input("FP32", [0.5, True]), None),
        "input a data[1] is true; expected a number",
    ),
    "a size that is a boolean": (
        lambda: (_BOOL_SIZE + b"x", len(_BOOL_SIZE)),
        "binary_data_size True does not fit",
    ),
    "a shape of booleans": (
        lambda: (_shaped([True, 1], [0.5]), None),
        "input a: shape must be integers, got [True, 1]",
    ),
    "a shape of strings": (
        lambda: (_shaped(["1", 1], [0.5]), None),
        "input a: shape must be integers, got ['1', 1]",
    ),
    "a shape of floats": (
        lambda: (_shaped([1.0, 1], [0.5]), None),
        "input a: shape must be integers, got [1.0, 1]",
    ),
    "an empty json shape torch cannot lay out": (
        lambda: (_shaped([0, 2**63], []), None),
        "input a: shape [0, 9223372036854775808] is too large",
    ),
    "an empty binary shape torch cannot lay out": (
        lambda: _empty_binary([2**62, 4, 0]),
        "input a: shape [4611686018427387904, 4, 0] is too large",
    ),
    "data and binary data both": (
        lambda: _binary_with_data(),
        "input hidden_states: both data and parameters.binary_data_size are given",
    ),
}


def _shaped(shape: list, data: list) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "a", "shape": shape, "datatype": "FP32", "data": data}]}
    ).encode()


def _empty_binary(shape: list[int]) -> tuple[bytes, int]:
    entry = {"name": "a", "shape": shape, "datatype": "FP32", "parameters": {"binary_data_size": 0}}
    header = json.dumps({"inputs": [entry]}).encode()
    return header, len(header)


def _binary_with_data() -> tuple[bytes, int]:
    body, length = _binary_request(torch.zeros(1, 2))
    request = json.loads(body[:length])
    request["inputs"][0]["data"] = [9.0, 9.0]
    header = json.dumps(request).encode()
    return header + body[length:], len(header)


def _json_input(datatype: str, data: list) -> bytes:
    shape = [len(data)]
    return json.dumps(
        {"inputs": [{"name": "a", "shape": shape, "datatype": datatype, "data": data}]}
    ).encode()


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"binary_data_output": "no"},
            "parameters.binary_data_output must be true or false, got 'no'",
        ),
        ({}, None),
        ({"binary_data_output": True}, None),
    ],
)
def test_binary_output_flags_are_strict_booleans(parameters: dict, message) -> None:
    request = InferRequest.model_validate(
        {
            "inputs": [{"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}],
            "parameters": parameters,
        }
    )
    if message is None:
        assert wants_binary(request, "output") is parameters.get("binary_data_output", False)
        return
    with pytest.raises(BadInput, match=re.escape(message)):
        wants_binary(request, "output")


@pytest.mark.parametrize("case", CODEC_ERRORS, ids=str)
def test_codec_refuses_malformed_requests_naming_the_problem(case: str) -> None:
    make, message = CODEC_ERRORS[case]
    with pytest.raises(BadInput, match=re.escape(message)):
        decode_request(*make())
