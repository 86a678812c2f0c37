"""The layer refuses inputs with the same messages the service answers with (one place)."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.config import MoEConfig
from moe_serve.kernels.input_checks import (
    NONFINITE_BITS,
    InputError,
    all_finite_on_device,
    check_values,
    finite_flag,
)
from moe_serve.kernels.layer import LayerWeights, MoELayer, RouterWeights, build_layer
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.tensors import ForwardInputs

CPU = torch.device("cpu")


def _layer(cfg: MoEConfig, router: bool = True) -> MoELayer:
    gate = torch.randn(cfg.num_experts, cfg.hidden_size) if router else None
    weights = LayerWeights(random_expert_weights(cfg), RouterWeights(gate))
    return build_layer(cfg, weights, CPU, "reference")[0]


@pytest.mark.parametrize(
    ("hidden", "logits", "message"),
    [
        ((2, 65), None, "hidden_states has 65 columns; this layer's hidden_size is 64"),
        ((2, 64), (2, 5), "router_logits has 5 columns; this layer's num_experts is 4"),
        ((2, 64), (3, 4), "router_logits has 3 tokens but hidden_states has 2"),
        ((64,), None, "hidden_states must be 2-D [tokens, hidden_size], got shape [64]"),
    ],
    ids=["hidden size", "expert count", "token count", "1-D"],
)
def test_layer_refuses_inputs_of_another_shape_naming_the_tensor(
    tiny_config: MoEConfig, hidden: tuple, logits: tuple | None, message: str
) -> None:
    inputs = ForwardInputs(torch.randn(hidden), None if logits is None else torch.randn(logits))
    with pytest.raises(InputError) as err:
        _layer(tiny_config).forward(inputs)
    assert str(err.value) == message


def test_layer_without_router_asks_for_logits(tiny_config: MoEConfig) -> None:
    with pytest.raises(InputError, match="this layer has no stored router: send router_logits"):
        _layer(tiny_config, router=False).forward(ForwardInputs(torch.randn(2, 64)))


def test_layer_takes_a_forward_without_tokens(tiny_config: MoEConfig) -> None:
    """An expert-parallel rank with no tokens of its own still joins every forward."""
    out = _layer(tiny_config).forward(ForwardInputs(torch.empty(0, 64), torch.empty(0, 4)))
    assert out.output.shape == (0, 64)


def test_value_check_names_the_first_non_finite_element() -> None:
    logits = torch.zeros(3, 4)
    logits[2, 1] = float("-inf")
    with pytest.raises(InputError, match=r"router_logits holds NaN or Inf \(first at row 2, col"):
        check_values(ForwardInputs(torch.zeros(3, 64), logits), torch.float32)


@pytest.mark.parametrize(
    ("layer_dtype", "value", "refused"),
    [
        (torch.float16, 65504.0, False),  # float16's largest
        (torch.float16, 1e5, True),
        (torch.bfloat16, 1e30, False),  # bfloat16 has float32's range
        (torch.bfloat16, 3.4e38, True),  # but not all of it
        (torch.float32, 3.4e38, False),
    ],
)
def test_value_check_refuses_hidden_states_the_layer_dtype_cannot_hold(
    layer_dtype: torch.dtype, value: float, refused: bool
) -> None:
    hidden = torch.zeros(3, 64)
    hidden[1, 7] = value
    if not refused:
        check_values(ForwardInputs(hidden), layer_dtype)
        return
    dtype = str(layer_dtype).removeprefix("torch.")
    with pytest.raises(InputError, match=rf"at row 1, column 7: beyond the largest {dtype} value"):
        check_values(ForwardInputs(hidden), layer_dtype)


@pytest.mark.parametrize(
    ("layer_dtype", "hidden_value", "logit_value", "fits"),
    [
        (torch.bfloat16, 1.0, 0.0, True),
        (torch.bfloat16, float("nan"), 0.0, False),
        (torch.bfloat16, float("-inf"), 0.0, False),
        (torch.bfloat16, 3.4e38, 0.0, False),  # beyond bfloat16, finite in float32
        (torch.float16, 65504.0, 0.0, True),
        (torch.float16, 1e5, 0.0, False),
        (torch.float32, 3.4e38, float("inf"), False),
        (torch.float32, 3.4e38, None, True),
    ],
)
def test_the_flag_of_a_staged_batch_agrees_with_the_named_checks(
    layer_dtype: torch.dtype, hidden_value: float, logit_value: float | None, fits: bool
) -> None:
    """finite_flag runs on the batch as staged (hidden states cast to the layer's dtype; on any
    device, here the CPU): it is down exactly when check_values, which the service then runs on
    the wire inputs, names a value."""
    hidden = torch.zeros(3, 64)
    hidden[2, 5] = hidden_value
    logits = None if logit_value is None else torch.full((3, 4), logit_value)
    inputs = ForwardInputs(hidden, logits)
    staged = ForwardInputs(hidden.to(layer_dtype), logits)
    assert bool(finite_flag(staged)) is fits
    if fits:
        check_values(inputs, layer_dtype)
    else:
        with pytest.raises(InputError):
            check_values(inputs, layer_dtype)


_SHAPES = [(1, 7168), (5, 3), (3, 1500), (0, 64), (7,)]  # one row; narrow; ragged blocks; empty
_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, at: tuple[int, ...], bad: float):
    t = torch.randn(shape)
    if t.numel():
        t[at] = bad
    return t.to(dtype)


def _expected(t: torch.Tensor, valid_rows: int) -> bool:
    return bool(torch.isfinite(t.float()[:valid_rows]).all())


@pytest.mark.parametrize("dtype", list(NONFINITE_BITS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("valid", [None, 0, 1])  # rows checked: all, none, the first
@pytest.mark.parametrize("device", _DEVICES)
def test_the_flag_of_rows_on_the_device_is_down_exactly_for_a_nonfinite_value_among_them(
    device: str, dtype: torch.dtype, bad: float, shape: tuple[int, ...], valid: int | None
) -> None:
    """The served batch's check (its output up to the graph's valid rows): on a GPU the Triton
    pass over the bits, on the CPU torch's isfinite; both against isfinite on the rows."""
    rows = shape[0]
    for at in {(0,) * len(shape), tuple(n - 1 for n in shape)}:  # first and last value
        t = _poisoned(shape, dtype, at, bad).to(device)
        valid_rows = None if valid is None else torch.tensor(valid, device=device)
        got = all_finite_on_device(t, valid_rows)
        assert got.device == t.device and got.dim() == 0
        assert bool(got) is _expected(t.cpu(), rows if valid is None else valid), (at, valid)
