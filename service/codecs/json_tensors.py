"""JSON bodies <-> tensors: the arrays of `service/codecs/json_numbers.py` made tensors, and tensors
written as JSON.

Outputs are written by orjson straight from numpy, in the shortest decimal form of their dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import BadInput
from .json_numbers import decode_forward_arrays, out_of_range, to_array
from .json_numbers import dumps as dumps_arrays


def array_to_tensor(name: str, value: Any, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A JSON array of numbers, flat or nested, -> a tensor of `shape` and `dtype`; BadInput
    naming a number `dtype` cannot hold (a float one would become an infinity)."""
    array = to_array(name, value)
    tensor = torch.from_numpy(array).to(dtype)
    if tensor.is_floating_point():
        # a finite number that became an infinity (a NaN or an Infinity sent as such is for
        # the input checks to name)
        overflowed = ~torch.isfinite(tensor) & torch.from_numpy(np.isfinite(array))
        if overflowed.any():
            index = tuple(int(i) for i in overflowed.nonzero()[0])
            kind, largest = str(dtype).removeprefix("torch."), torch.finfo(dtype).max
            raise out_of_range(name, index, float(array[index]), kind, largest)
    if tensor.numel() != int(np.prod(shape)):
        raise BadInput(f"{name}: {tensor.numel()} values do not fill shape {shape}")
    return tensor.reshape(shape)


@dataclass(frozen=True)
class JsonForward:
    """A /v1 forward's JSON body, decoded (schema: service.http.schemas.ForwardRequest)."""

    hidden_states: torch.Tensor  # [T, H] float32
    router_logits: torch.Tensor | None  # [T, E] float32
    return_routing: bool


def decode_forward(body: bytes) -> JsonForward:
    """A /v1 forward's JSON body -> its tensors; BadInput naming the field or element."""
    arrays = decode_forward_arrays(body)
    logits = arrays.router_logits
    return JsonForward(
        torch.from_numpy(arrays.hidden_states).to(torch.float32),
        None if logits is None else torch.from_numpy(logits).to(torch.float32),
        arrays.return_routing,
    )


def dumps(value: Any) -> bytes:
    """`value` as JSON; tensors and numpy arrays inside are written from their buffers."""
    return dumps_arrays(value, _tensor_default)


def _tensor_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # numpy has no bfloat16: bf16 travels as float32, which holds it exactly
        wide = value.float() if value.dtype == torch.bfloat16 else value
        return wide.detach().cpu().numpy()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
