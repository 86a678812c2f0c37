"""Request tensors -> checked ForwardInputs for one layer; every refusal names the tensor."""

from __future__ import annotations

import torch

from kernels.tensors import ForwardInputs
from service.engine import ServedLayer
from service.errors import BadInput

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rows_to_tensor(name: str, rows: list[list[float]]) -> torch.Tensor:
    """A JSON array of rows -> float32 [T, C]; refuses empty and ragged arrays."""
    if not rows or not rows[0]:
        raise BadInput(f"{name} is empty; expected a [tokens, columns] array of numbers")
    width = len(rows[0])
    for i, row in enumerate(rows):
        if len(row) != width:
            raise BadInput(f"{name} is ragged: row 0 has {width} values, row {i} has {len(row)}")
    return torch.tensor(rows, dtype=torch.float32)


def _check(name: str, t: torch.Tensor, columns: tuple[str, int], tokens: int | None) -> None:
    what, width = columns
    if t.dtype not in WIRE_DTYPES:
        raise BadInput(f"{name} has dtype {t.dtype}; expected float32, bfloat16 or float16")
    if t.dim() != 2:
        raise BadInput(f"{name} must be 2-D [tokens, {what}], got shape {list(t.shape)}")
    if t.shape[0] == 0:
        raise BadInput(f"{name} is empty: it has 0 tokens")
    if tokens is not None and t.shape[0] != tokens:
        raise BadInput(f"{name} has {t.shape[0]} tokens but hidden_states has {tokens}")
    if t.shape[1] != width:
        raise BadInput(f"{name} has {t.shape[1]} columns; this layer's {what} is {width}")
    if not all_finite(t):
        row, col = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise BadInput(f"{name} holds NaN or Inf (first at row {row}, column {col})")


# A float is NaN or Inf exactly when its exponent bits are all ones.
_EXPONENT_BITS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
}


def all_finite(t: torch.Tensor) -> bool:
    """Whether a CPU tensor of a wire dtype holds no NaN or Inf. Through numpy on the bits:
    torch.isfinite takes milliseconds on a 64 x 7168 bfloat16 request, this a tenth of that."""
    bits, exponent = _EXPONENT_BITS[t.dtype]
    return bool((t.contiguous().view(bits).numpy() & exponent).max() != exponent)


def check_inputs(
    served: ServedLayer, hidden: torch.Tensor, logits: torch.Tensor | None
) -> ForwardInputs:
    """hidden [T, H] (+ logits [T, E]) in a wire dtype -> checked CPU ForwardInputs.

    The wire dtype stays: the batch is cast once, to the layer's dtype, as it is staged for the
    device (requests of any wire dtype batch together); logits stay float32 for routing.
    """
    cfg = served.config
    _check("hidden_states", hidden, ("hidden_size", cfg.hidden_size), None)
    if logits is None and not served.has_router:
        raise BadInput(f"layer {served.name!r} has no stored router: send router_logits")
    if logits is not None:
        _check("router_logits", logits, ("num_experts", cfg.num_experts), hidden.shape[0])
        logits = logits.float()
    return ForwardInputs(hidden, logits)
