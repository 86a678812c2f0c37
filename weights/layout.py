"""The tensors of `experts.safetensors`: their names, and the shape and dtype each must have.

| name                     | shape                        | dtype                    |
| ------------------------ | ---------------------------- | ------------------------ |
| w13, w2, their scales    | by quant scheme (quant_scheme.py table; w13 [E, 2I, H]) |
| w13_bias, w2_bias        | [E, 2I], [E, H]              | float32                  |
| gate, gate_bias          | [E, H], [E]                  | layer dtype, float32     |
| e_score_correction_bias  | [E]                          | float32                  |
| shared_w13, shared_w2    | [2Is, H] gate then up, [H, Is] | layer dtype            |
| shared_gate              | [1, H]                       | layer dtype              |
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels.config import MoEConfig
from ..kernels.layer import ROUTER_TENSORS, SHARED_TENSORS
from .errors import LayerFileError
from .manifest import Manifest

F32 = torch.float32


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    per_expert: bool = False  # axis 0 is the expert axis: expert parallelism slices it
    is_scale: bool = False  # must be finite (e8m0: not the NaN code 255)


def _gemm_weight(
    cfg: MoEConfig, e: int, n: int, k: int, parts: int
) -> tuple[TensorSpec, TensorSpec | None]:
    """The stored weight [E, N, K'] and its scale for one GEMM, as the scheme describes them."""
    spec = cfg.quant.spec
    values = spec.values
    weight = TensorSpec((e, n, k // values.per_byte), values.storage or cfg.dtype, True)
    if spec.scales is None:
        return weight, None
    scale = TensorSpec(spec.scales.shape(e, n, k, parts), spec.scales.dtype, True, True)
    return weight, scale


def expected_tensors(m: Manifest) -> dict[str, TensorSpec]:
    """Every tensor the layer file must hold (and nothing else), by name."""
    cfg = m.config
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    specs: dict[str, TensorSpec] = {}
    for name, (n, k, parts) in (("w13", (2 * i, h, cfg.w13_parts)), ("w2", (h, i, 1))):
        weight, scale = _gemm_weight(cfg, e, n, k, parts)
        specs[name] = weight
        if scale is not None:
            specs[f"{name}_scale"] = scale
    if cfg.has_bias:
        specs["w13_bias"] = TensorSpec((e, 2 * i), F32, True)
        specs["w2_bias"] = TensorSpec((e, h), F32, True)
    router = {
        "weight": (m.router, TensorSpec((e, h), cfg.dtype)),
        "bias": (m.router_bias, TensorSpec((e,), F32)),
        "correction_bias": (m.correction_bias, TensorSpec((e,), F32)),
    }
    si = m.shared_intermediate_size
    shared = {
        "w13": (m.shared_experts, TensorSpec((2 * si, h), cfg.dtype)),
        "w2": (m.shared_experts, TensorSpec((h, si), cfg.dtype)),
        "gate": (m.shared_gate, TensorSpec((1, h), cfg.dtype)),
    }
    for part, names in ((router, ROUTER_TENSORS), (shared, SHARED_TENSORS)):
        specs |= {names[field]: spec for field, (present, spec) in part.items() if present}
    return specs


MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def _raw_header(path: Path) -> bytes:
    """A safetensors file's first 8 bytes (little-endian JSON length) and the JSON header."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError("file is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw_len)
        room = min(os.fstat(f.fileno()).st_size - 8, MAX_HEADER_BYTES)
        if length > room:  # never read (or allocate) what a damaged length announces
            raise ValueError(f"header announces {length} bytes, more than the file's {room}")
        header = f.read(length)
        if len(header) != length:
            raise ValueError(f"header announces {length} bytes, file has {len(header)}")
    return raw_len + header


def header_sha256(path: Path) -> str:
    """sha256 of a safetensors file's header: the 8-byte length and the JSON it announces.

    The header names every tensor with its dtype, shape and byte range, so it changes with
    any change of layout; reading it costs microseconds even for an 11 GB layer.
    """
    return hashlib.sha256(_raw_header(path)).hexdigest()


def tensor_offsets(path: Path) -> dict[str, int]:
    """Each tensor's first byte in the file (data follows the header, at its `data_offsets`)."""
    raw = _raw_header(path)
    header = json.loads(raw[8:])
    header.pop("__metadata__", None)
    return {name: len(raw) + entry["data_offsets"][0] for name, entry in header.items()}


# safetensors header dtype names of the dtypes a layer file may hold
SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I8": torch.int8,
    "U8": torch.uint8,
}


def check_tensor(
    path: Path, name: str, spec: TensorSpec, shape: tuple[int, ...], dtype: torch.dtype | str
) -> None:
    """Raise LayerFileError naming `path` and `name` unless shape and dtype match `spec`."""
    if isinstance(dtype, str):
        dtype = SAFETENSORS_DTYPES.get(dtype, dtype)
    if tuple(shape) != spec.shape:
        raise LayerFileError(path, name, f"expected shape {list(spec.shape)}, got {list(shape)}")
    if dtype != spec.dtype:
        raise LayerFileError(path, name, f"expected dtype {spec.dtype}, got {dtype}")


def check_names(path: Path, expected: set[str], present: set[str]) -> None:
    """Raise LayerFileError for the first missing or unexpected tensor name."""
    for name in sorted(expected - present):
        raise LayerFileError(path, name, "missing")
    for name in sorted(present - expected):
        raise LayerFileError(path, name, "unexpected tensor (the manifest does not declare it)")
