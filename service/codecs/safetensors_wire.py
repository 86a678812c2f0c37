"""Safetensors on the wire: bodies read as views of the body, replies written straight from the
output tensors.

A body is read without copying its data (`safetensors.torch.load` copies every tensor once, a
large share of the event loop's time under load); a reply is built with one copy of the tensors
instead of the library's three.
"""

from __future__ import annotations

import json
import math
import struct
import warnings

import torch

from .safetensors_header import read_header

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int32: "I32",
    torch.int64: "I64",
}
# Every dtype safetensors names that torch has: a request in another dtype than the layer takes
# reaches the input check, which refuses it by name.
_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# Request tensors are views of the (immutable) body: nothing writes them (the batch is staged by
# copy), and torch's warning that they could be written says nothing to an operator.
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)


def byte_view(body: bytes | bytearray | memoryview) -> torch.Tensor:
    """uint8 [len(body)] viewing `body`'s bytes (no copy)."""
    if not len(body):  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(body, dtype=torch.uint8)


def decode_safetensors(body: bytes | memoryview) -> dict[str, torch.Tensor]:
    """A safetensors blob -> its tensors, views of `body`; ValueError saying what is wrong
    (service.codecs.safetensors_header checks the blob as the library does)."""
    header = read_header(body)
    data = memoryview(body)[header.data_start :]
    return {
        e.name: (
            torch.frombuffer(
                data, dtype=_TORCH_DTYPES[e.dtype], count=e.numel, offset=e.begin
            ).view(e.shape)
            if e.numel
            else torch.empty(e.shape, dtype=_TORCH_DTYPES[e.dtype])
        )
        for e in header.entries
    }


def safetensors_head(
    tensors: dict[str, tuple[torch.dtype, list[int]]], metadata: dict[str, str]
) -> bytes:
    """The header of a safetensors blob of tensors (name -> dtype and shape, in data order):
    its length, then the JSON padded to 8 bytes; the tensors' bytes follow it."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def safetensors_parts(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> list[bytes | memoryview]:
    """Tensors (CPU) -> a safetensors blob as its pieces: the header, then each tensor's bytes
    as a view of the tensor (which the view keeps alive). Sent as they are, nothing is copied."""
    head = safetensors_head({n: (t.dtype, list(t.shape)) for n, t in tensors.items()}, metadata)
    return [head, *map(tensor_bytes, tensors.values())]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, as a view that keeps it alive (a copy only if not contiguous)."""
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def encode_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Tensors (CPU) -> a safetensors blob that `safetensors.torch.load` reads back."""
    return b"".join(safetensors_parts(tensors, metadata))
