"""The front ends' check of a body's values (service/body_values.py) against torch.isfinite."""

from __future__ import annotations

import pytest
import torch

from service.body_values import FiniteCheck
from service.wire import encode_safetensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_nonfinite_value_anywhere_is_found(dtype: torch.dtype, bad: float) -> None:
    check = FiniteCheck()
    x = torch.randn(300, 1000).to(dtype)  # over one scratch chunk in float32
    assert check(encode_safetensors({"hidden_states": x}, {}))
    for row, col in [(0, 0), (299, 999), (150, 3)]:
        y = x.clone()
        y[row, col] = bad
        logits = torch.zeros(300, 4)
        assert not check(encode_safetensors({"hidden_states": y, "router_logits": logits}, {}))
        assert not check(encode_safetensors({"hidden_states": x, "router_logits": y.float()}, {}))


def test_the_largest_finite_values_pass_and_integers_are_not_read() -> None:
    check = FiniteCheck()
    for dtype in DTYPES:
        edge = torch.tensor([[torch.finfo(dtype).max, torch.finfo(dtype).min]], dtype=dtype)
        assert check(encode_safetensors({"hidden_states": edge}, {}))
    ids = torch.full((2, 2), -1, dtype=torch.int32)  # all bits set: not a float
    assert check(encode_safetensors({"hidden_states": torch.ones(2, 2), "ids": ids}, {}))


def test_a_blob_that_cannot_be_read_is_left_to_the_engine() -> None:
    assert not FiniteCheck()(b"not a safetensors blob")
