"""The request path's host work outside the batcher: safetensors replies written straight from
the output tensors, and where a body's decode or a reply's encode runs.

A reply is the safetensors format as the library writes it (8-byte little-endian header length,
a JSON header padded with spaces to 8 bytes, then each tensor's bytes in header order), built
with one copy of the tensors instead of the library's three.
"""

from __future__ import annotations

import asyncio
import json
import struct
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
# Bodies above this are decoded (and replies above it encoded) on a worker thread: below it a
# thread hop costs more than the work it would take off the event loop. A 64 x 7168 bf16 body
# (917 KB, DeepSeek-V3) decodes and checks in 0.15 ms in one thread and encodes in 0.08 ms on a
# CI core; on a worker thread its decode stage measured 0.56 ms (H200 host, one client).
OFF_LOOP_BYTES = 1 << 20


def encode_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Tensors (CPU) -> a safetensors blob that `safetensors.torch.load` reads back."""
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
    return b"".join([struct.pack("<Q", len(head)), head, *data])


async def run_sized(nbytes: int, fn: Callable[[], T]) -> T:
    """fn() on a worker thread when it handles more than OFF_LOOP_BYTES, else here."""
    if nbytes > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn)
    return fn()
