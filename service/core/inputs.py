"""Request tensors -> checked ForwardInputs for one layer; every refusal names the tensor."""

from __future__ import annotations

import torch

from ...kernels.input_checks import InputError, check_shapes
from ...kernels.tensors import ForwardInputs
from ..engine.interface import ServedLayer
from ..errors import BadInput


def check_inputs(
    served: ServedLayer, hidden: torch.Tensor, logits: torch.Tensor | None
) -> ForwardInputs:
    """hidden [T, H] (+ logits [T, E]) in a wire dtype -> ForwardInputs of checked dtypes and
    shapes. Their values are checked with the batch they join (kernels/input_checks.py): a NaN,
    an Inf or a value beyond the layer's dtype fails the request there, with the same 400.

    The wire dtype stays: the batch is cast once, to the layer's dtype, as it is staged for the
    device (requests of any wire dtype batch together); logits stay float32 for routing.
    """
    inputs = ForwardInputs(hidden, logits)
    try:
        check_shapes(
            served.config,
            inputs,
            has_router=served.has_router,
            layer=served.name,
            allow_empty=False,
        )
    except InputError as err:
        raise BadInput(str(err)) from None
    return ForwardInputs(hidden, None if logits is None else logits.float())
