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
    finite = torch.isfinite(t)
    if not finite.all():
        row, col = (~finite).nonzero()[0].tolist()
        raise BadInput(f"{name} holds NaN or Inf (first at row {row}, column {col})")


def check_inputs(
    served: ServedLayer, hidden: torch.Tensor, logits: torch.Tensor | None
) -> ForwardInputs:
    """hidden [T, H] (+ logits [T, E]) in a wire dtype -> float32 CPU ForwardInputs.

    float32 holds bf16 and fp16 exactly, so requests of any wire dtype batch together.
    """
    cfg = served.config
    _check("hidden_states", hidden, ("hidden_size", cfg.hidden_size), None)
    if logits is None and not served.has_router:
        raise BadInput(f"layer {served.name!r} has no stored router: send router_logits")
    if logits is not None:
        _check("router_logits", logits, ("num_experts", cfg.num_experts), hidden.shape[0])
        logits = logits.float()
    return ForwardInputs(hidden.float(), logits)
