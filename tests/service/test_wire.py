"""Safetensors bodies read as views (service.codecs.safetensors_wire.decode_safetensors) against the
library."""

from __future__ import annotations

import ctypes
import json
import re
import struct

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from moe_serve.service.codecs.safetensors_wire import decode_safetensors, encode_safetensors


def _blob(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize(
    "tensors",
    [
        {"hidden_states": torch.randn(64, 7168).bfloat16()},
        {"hidden_states": torch.randn(3, 5), "router_logits": torch.randn(3, 8)},
        {
            "a": torch.randn(2, 3).half(),
            "b": torch.arange(6, dtype=torch.int64),
            "c": torch.ones(1),
        },
        {"empty": torch.empty(0, 4), "x": torch.randn(1, 4, dtype=torch.float64)},
    ],
)
def test_reads_what_the_library_writes_as_views_of_the_body(tensors) -> None:
    body = safetensors.torch.save(tensors, metadata={"k": "v"})
    got = decode_safetensors(body)
    assert got.keys() == tensors.keys()
    for name, expected in tensors.items():
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape
        assert torch.equal(got[name], expected)
    start = ctypes.cast(ctypes.c_char_p(body), ctypes.c_void_p).value  # the body's bytes
    for tensor in got.values():
        if tensor.numel():  # a view of the body, not a copy
            assert start <= tensor.data_ptr() < start + len(body)


def test_reads_our_own_replies() -> None:
    out = {
        "output": torch.randn(4, 16).bfloat16(),
        "topk_ids": torch.zeros(4, 2, dtype=torch.int32),
    }
    got = decode_safetensors(encode_safetensors(out, {"layer": "x"}))
    assert all(torch.equal(got[k], v) for k, v in out.items())


GOOD = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"", "fewer than the 8"),
        (struct.pack("<Q", 1000) + b"{}", "runs past"),
        (struct.pack("<Q", 2) + b"{x", "not JSON"),
        (_blob([1, 2], b""), "not a JSON object"),
        (_blob({"__metadata__": {"a": 1}}, b""), "__metadata__"),
        (_blob({"t": {"dtype": "F32", "shape": [2]}}, bytes(8)), "needs exactly"),
        (_blob({"t": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "'X9'"),
        (_blob({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)), "shape"),
        (_blob({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, bytes(8)), "offsets"),
        (_blob({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "hold"),
        (_blob({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4)), "hold"),
        (_blob(GOOD, bytes(12)), "4 bytes of data follow"),
        (
            _blob(
                {
                    "t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                bytes(12),
            ),
            "gap or overlap",
        ),
        (_blob({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "gap"),
    ],
)
def test_refuses_what_the_library_refuses_naming_it(body: bytes, says: str) -> None:
    with pytest.raises(ValueError) as err:
        decode_safetensors(body)
    assert says in str(err.value)
    with pytest.raises(SafetensorError):
        safetensors.torch.load(body)


def test_the_good_case_of_the_refusals_is_read() -> None:
    assert decode_safetensors(_blob(GOOD, bytes(8)))["t"].tolist() == [0.0, 0.0]


def _raw_blob(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


# Headers a client may send that no tensor can come of: each a ValueError naming the problem,
# never another exception (a 500)
HOSTILE_HEADERS = {
    "an empty shape torch cannot lay out": (
        _raw_blob(
            b'{"t": {"dtype": "F32", "shape": [0, 9223372036854775808], "data_offsets": [0, 0]}}'
        ),
        "shape [0, 9223372036854775808] is too large",
    ),
    "a name that is a lone surrogate": (
        _raw_blob(b'{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}')
        + bytes(4),
        "the header is not JSON",
    ),
    "nested 100,000 deep": (
        _raw_blob(b"[" * 100_000 + b"]" * 100_000),
        "the header is not JSON",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_HEADERS)
def test_hostile_headers_are_refused_naming_the_problem(case: str) -> None:
    body, says = HOSTILE_HEADERS[case]
    with pytest.raises(ValueError, match=re.escape(says)):
        decode_safetensors(body)
