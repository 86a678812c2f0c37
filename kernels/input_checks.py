"""Every check of a forward's inputs against its layer, each message written once.

`MoELayer.forward` runs the shape check on every forward, and the service on each request
before it is batched (a request of the wrong shape gets a 400 naming the tensor and never
reaches a batch). The value check reads every element, so the service does not run it on every
request: each batch computes one flag on its staged inputs (`finite_flag` on the device; inside
the layer's graph `row_kernels.batch_stats_into`; service/pipeline.py), and only when the flag is
down does the service run
`check_values` on that batch's requests, to fail those at fault with a 400 naming the value.
Inputs are checked in their own dtype (only the range check converts the hidden states, to the
layer's dtype, to see what it makes of them).
"""

from __future__ import annotations

import math

import torch

from .config import DTYPES, MoEConfig
from .nonfinite import NONFINITE_MASKS
from .stages import HAS_TRITON
from .tensors import ForwardInputs

if HAS_TRITON:
    from .row_kernels import nonfinite_into

_DTYPE_NAMES = f"{', '.join(list(DTYPES)[:-1])} or {list(DTYPES)[-1]}"


class InputError(ValueError):
    """Inputs this layer cannot take; the message names the tensor, what was expected and got."""


def _check_matrix(
    name: str, t: torch.Tensor, columns: tuple[str, int], tokens: int | None, allow_empty: bool
) -> None:
    what, width = columns
    if t.dtype not in DTYPES.values():
        raise InputError(f"{name} has dtype {t.dtype}; expected {_DTYPE_NAMES}")
    if t.dim() != 2:
        raise InputError(f"{name} must be 2-D [tokens, {what}], got shape {list(t.shape)}")
    if t.shape[0] == 0 and not allow_empty:
        raise InputError(f"{name} is empty: it has 0 tokens")
    if tokens is not None and t.shape[0] != tokens:
        raise InputError(f"{name} has {t.shape[0]} tokens but hidden_states has {tokens}")
    if t.shape[1] != width:
        raise InputError(f"{name} has {t.shape[1]} columns; this layer's {what} is {width}")


def check_shapes(
    cfg: MoEConfig,
    inputs: ForwardInputs,
    *,
    has_router: bool,
    layer: str | None = None,
    allow_empty: bool = True,
) -> None:
    """Dtypes and shapes of hidden [M, H] and router logits [M, E] against `cfg`; logits may be
    left out only when the layer has a stored router. Reads no tensor data.

    `layer` names the layer in messages. `allow_empty`: False where no tokens is a mistake (a
    request); a forward may have none (an expert-parallel rank without tokens of its own).
    """
    hidden, logits = inputs.hidden_states, inputs.router_logits
    _check_matrix("hidden_states", hidden, ("hidden_size", cfg.hidden_size), None, allow_empty)
    if logits is None:
        if not has_router:
            who = "this layer" if layer is None else f"layer {layer!r}"
            raise InputError(f"{who} has no stored router: send router_logits")
        return
    columns = ("num_experts", cfg.num_experts)
    _check_matrix("router_logits", logits, columns, hidden.shape[0], allow_empty)


# dtype -> (same-width integer dtype, mask): a value is NaN or Inf exactly when all the mask's
# bits are set (kernels/nonfinite.py)
NONFINITE_BITS = {
    torch.float64: (torch.int64, NONFINITE_MASKS["F64"]),
    torch.float32: (torch.int32, NONFINITE_MASKS["F32"]),
    torch.bfloat16: (torch.int16, NONFINITE_MASKS["BF16"]),
    torch.float16: (torch.int16, NONFINITE_MASKS["F16"]),
    torch.float8_e4m3fn: (torch.uint8, NONFINITE_MASKS["F8_E4M3"]),
}


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor of a layer dtype holds no NaN or Inf. On the CPU through numpy on the
    bits, several times faster than torch.isfinite on a bfloat16 request; on a GPU one reduction
    there, and a sync to read its flag."""
    if t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    bits, exponent = NONFINITE_BITS[t.dtype]
    return bool((t.contiguous().view(bits).numpy() & exponent).max() != exponent)


def bit_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t (rows on its first axis) as [R, C] integer bits with unit column stride, and the mask
    whose bits are all set exactly in its NaN and Inf values."""
    bits_dtype, mask = NONFINITE_BITS[t.dtype]
    rows = t.reshape(t.shape[0] if t.dim() else 1, math.prod(t.shape[1:]))
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows.view(bits_dtype), mask


def all_finite_on_device(t: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[] bool on t's device, no host sync: whether rows [0, valid_rows) of t (rows on its
    first axis; all of them when valid_rows, a 0-d int64 tensor on the device, is None) hold no
    NaN or Inf. On a GPU one Triton pass over the bits (kernels/row_kernels.py)."""
    bits, mask = bit_rows(t)
    if not (t.is_cuda and HAS_TRITON):
        bad = ((bits & mask) == mask).any(dim=1)
        if valid_rows is not None:
            bad &= torch.arange(bad.shape[0], device=t.device) < valid_rows
        return ~bad.any()
    flag = torch.zeros(1, dtype=torch.int32, device=t.device)
    nonfinite_into(bits, mask, flag, valid_rows)
    return flag[0] == 0


def finite_flag(inputs: ForwardInputs) -> torch.Tensor:
    """[] bool on the inputs' device: whether every value of the inputs is finite. No host sync
    (the service reads it with the batch's results)."""
    flag = all_finite_on_device(inputs.hidden_states)
    if inputs.router_logits is not None:
        flag = flag & all_finite_on_device(inputs.router_logits)
    return flag


def check_values(inputs: ForwardInputs, layer_dtype: torch.dtype, first_row: int = 0) -> None:
    """Every value of the inputs (tensors that passed `check_shapes`, on the CPU or a GPU) is
    finite, and the hidden states fit `layer_dtype`, which the layer casts them to (1e5 is a
    float32 but no float16); the error names the first value that is not, counting rows from
    `first_row` (the inputs are rows of a larger request from there)."""
    tensors = {"hidden_states": inputs.hidden_states, "router_logits": inputs.router_logits}
    for name, t in tensors.items():
        if t is not None and not all_finite(t):
            row, col = (~torch.isfinite(t)).nonzero()[0].tolist()
            raise InputError(
                f"{name} holds NaN or Inf (first at row {first_row + row}, column {col})"
            )
    hidden = inputs.hidden_states
    if torch.finfo(layer_dtype).max >= torch.finfo(hidden.dtype).max:
        return
    cast = hidden.to(layer_dtype)
    if not all_finite(cast):
        row, col = (~torch.isfinite(cast)).nonzero()[0].tolist()
        dtype = str(layer_dtype).removeprefix("torch.")
        raise InputError(
            f"hidden_states holds {hidden[row, col].item():g} at row {first_row + row}, column "
            f"{col}: beyond the largest {dtype} value of this layer "
            f"({torch.finfo(layer_dtype).max:g})"
        )
