"""The request path's host work outside the batcher: safetensors bodies read as views of the
body, replies written straight from the output tensors, and where that work runs.

The safetensors format: an 8-byte little-endian header length, a JSON header (padded with spaces
to 8 bytes when the library writes it), then the tensors' bytes, each at its `data_offsets`. A
body is read without copying its data (`safetensors.torch.load` copies every tensor once, a
sixth of the event loop's time under load on the H100 host); a reply is built with one copy of
the tensors instead of the library's three.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

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
_MAX_HEADER_BYTES = 100 << 20  # the library's own bound
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
# Request tensors are views of the (immutable) body: nothing writes them (the batch is staged by
# copy), and torch's warning that they could be written says nothing to an operator.
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def decode_safetensors(body: bytes) -> dict[str, torch.Tensor]:
    """A safetensors blob -> its tensors, views of `body`; ValueError saying what is wrong.

    Checked as the library checks a blob: the header fits, is a JSON object of entries with a
    known dtype, a shape of counts and `data_offsets` whose span holds exactly the shape's
    bytes, and the spans tile the data with no gap, overlap or trailing byte."""
    if len(body) < 8:
        raise ValueError(f"{len(body)} bytes are fewer than the 8 of the header length")
    (length,) = struct.unpack_from("<Q", body)
    if length > min(len(body) - 8, _MAX_HEADER_BYTES):
        raise ValueError(f"the header length {length} runs past the {len(body)}-byte blob")
    try:
        header = json.loads(bytes(memoryview(body)[8 : 8 + length]))
    except ValueError as err:
        raise ValueError(f"the header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ must map names to strings")
    data = memoryview(body)[8 + length :]
    tensors, spans = {}, []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
            raise ValueError(f"tensor {name!r} needs exactly {sorted(_ENTRY_KEYS)}")
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {entry['dtype']!r}, which torch lacks")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(map(_is_count, shape)):
            raise ValueError(f"tensor {name!r} has shape {shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
            raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}")
        begin, end = offsets
        numel = math.prod(shape)
        if end > len(data) or end - begin != numel * dtype.itemsize:
            raise ValueError(
                f"tensor {name!r}: data_offsets {offsets} do not hold {shape} of {entry['dtype']}"
                f" in {len(data)} bytes of data"
            )
        spans.append((begin, end))
        tensors[name] = (
            torch.frombuffer(data, dtype=dtype, count=numel, offset=begin).view(shape)
            if numel
            else torch.empty(shape, dtype=dtype)
        )
    covered = 0
    for begin, end in sorted(spans):
        if begin != covered:
            raise ValueError(f"the tensors' data leave a gap or overlap at byte {covered}")
        covered = end
    if covered != len(data):
        raise ValueError(f"{len(data) - covered} bytes of data follow the last tensor")
    return tensors


# Bodies above this are decoded (and replies above it encoded) on a worker thread: below it a
# thread hop costs more than the work it would take off the event loop. A 64 x 7168 bf16 body
# (917 KB, DeepSeek-V3) decodes and checks in 0.15 ms in one thread and encodes in 0.08 ms on a
# CI core; on a worker thread its decode stage measured 0.56 ms (H200 host, one client).
OFF_LOOP_BYTES = 1 << 20


def safetensors_parts(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> list[bytes | memoryview]:
    """Tensors (CPU) -> a safetensors blob as its pieces: the header, then each tensor's bytes
    as a view of the tensor (which the view keeps alive). Sent as they are, nothing is copied."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    data = [memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) for t in tensors.values()]
    return [struct.pack("<Q", len(head)) + head, *data]


def encode_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Tensors (CPU) -> a safetensors blob that `safetensors.torch.load` reads back."""
    return b"".join(safetensors_parts(tensors, metadata))


async def run_sized(nbytes: int, fn: Callable[[], T]) -> T:
    """fn() on a worker thread when it handles more than OFF_LOOP_BYTES, else here."""
    if nbytes > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn)
    return fn()
