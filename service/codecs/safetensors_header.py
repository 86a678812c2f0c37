"""The header of a safetensors blob, read and checked without torch (the HTTP front-end
processes read it too, to check a body's values before the engine sees it).

The format: an 8-byte little-endian header length, a JSON header (padded with spaces to 8 bytes
when the library writes it), then the tensors' bytes, each at its `data_offsets`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

import orjson

from .shapes import too_large, too_large_message

# Every dtype safetensors names, by its bytes per value (a dtype torch lacks is refused later,
# by name, where the tensors are made).
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_MAX_HEADER_BYTES = 100 << 20  # the library's own bound
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
# Headers up to this size are remembered: a service sees the same few (one per request shape)
# over and over, and parsing one per request would be a large share of a binary forward's time
# on the engine's loop.
_CACHED_HEADER_BYTES = 4096


@dataclass(frozen=True)
class Entry:
    """One tensor of a blob: its bytes are `data[begin:end]`, `data` starting at `data_start`."""

    name: str
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    entries: tuple[Entry, ...]
    metadata: Mapping[str, str]
    data_start: int  # offset of the data in the blob


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(body: bytes | memoryview) -> Header:
    """A safetensors blob's header; ValueError saying what is wrong.

    Checked as the library checks a blob: the header fits, is a JSON object of entries with a
    known dtype, a shape of counts and `data_offsets` whose span holds exactly the shape's
    bytes, and the spans tile the data with no gap, overlap or trailing byte."""
    if len(body) < 8:
        raise ValueError(f"{len(body)} bytes are fewer than the 8 of the header length")
    (length,) = struct.unpack_from("<Q", body)
    if length > min(len(body) - 8, _MAX_HEADER_BYTES):
        raise ValueError(f"the header length {length} runs past the {len(body)}-byte blob")
    text = bytes(memoryview(body)[8 : 8 + length])
    data_bytes = len(body) - 8 - length
    if length <= _CACHED_HEADER_BYTES:
        return _parse_cached(text, data_bytes)
    return _parse(text, data_bytes)


@lru_cache(maxsize=1024)
def _parse_cached(text: bytes, data_bytes: int) -> Header:
    return _parse(text, data_bytes)  # a ValueError is not cached: a bad header says so each time


def _parse(text: bytes, data_bytes: int) -> Header:
    """The JSON header `text` of a blob with `data_bytes` of data after it, checked. orjson
    parses it: no recursion of ours over nesting (it refuses past 1024 levels), and no string
    that is not UTF-8 (a lone surrogate escape is refused, never a tensor name)."""
    try:
        header = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise ValueError(f"the header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("__metadata__ must map names to strings")
    entries = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
            raise ValueError(f"tensor {name!r} needs exactly {sorted(_ENTRY_KEYS)}")
        dtype = entry["dtype"]
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r} has dtype {dtype!r}, which torch lacks")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(map(_is_count, shape)):
            raise ValueError(f"tensor {name!r} has shape {shape!r}")
        if too_large(shape):
            raise ValueError(f"tensor {name!r}: {too_large_message(shape)}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
            raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}")
        begin, end = offsets
        if end > data_bytes or end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise ValueError(
                f"tensor {name!r}: data_offsets {offsets} do not hold {shape} of {dtype}"
                f" in {data_bytes} bytes of data"
            )
        entries.append(Entry(name, dtype, tuple(shape), begin, end))
    covered = 0
    for begin, end in sorted((e.begin, e.end) for e in entries):
        if begin != covered:
            raise ValueError(f"the tensors' data leave a gap or overlap at byte {covered}")
        covered = end
    if covered != data_bytes:
        raise ValueError(f"{data_bytes - covered} bytes of data follow the last tensor")
    return Header(tuple(entries), MappingProxyType(metadata), 8 + len(text))
