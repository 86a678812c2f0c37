"""Request tensors -> checked ForwardInputs for one layer; every refusal names the tensor."""

from __future__ import annotations

import torch

from kernels.input_checks import InputError, check_shapes, check_values
from kernels.tensors import ForwardInputs
from service.engine import ServedLayer
from service.errors import BadInput


def check_inputs(
    served: ServedLayer,
    hidden: torch.Tensor,
    logits: torch.Tensor | None,
    values_checked: bool = False,
) -> ForwardInputs:
    """hidden [T, H] (+ logits [T, E]) in a wire dtype -> checked CPU ForwardInputs.
    `values_checked`: an HTTP front end found every value finite (service/body_values.py);
    only the range check of the layer's dtype is left.

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
        check_values(inputs, served.config.dtype, finite_known=values_checked)
    except InputError as err:
        raise BadInput(str(err)) from None
    return ForwardInputs(hidden, None if logits is None else logits.float())
