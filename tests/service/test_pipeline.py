"""The device pipeline's host side on the CPU: a batch's routing ids are checked before any of
its rows are served (service/engine/pipeline.py)."""

from __future__ import annotations

import pytest
import torch

from moe_serve.service.engine.pipeline import BadRouting, _HostRows

E, K, CAPACITY = 8, 2, 6


def _rows(ids: list[list[int]]) -> _HostRows:
    """A slot's pinned result buffers, as plain CPU tensors, holding `ids` in their first rows
    and padding (-1) after them."""
    topk_ids = torch.full((CAPACITY, K), -1, dtype=torch.int32)
    topk_ids[: len(ids)] = torch.tensor(ids, dtype=torch.int32).reshape(len(ids), K)
    output = torch.zeros(CAPACITY, 4, dtype=torch.bfloat16)
    return _HostRows(
        output, topk_ids, torch.zeros(CAPACITY, K), torch.zeros(E + 2, dtype=torch.int64)
    )


def test_routing_ids_of_experts_pass_and_the_padded_rows_are_not_looked_at() -> None:
    _rows([[0, 7], [3, 4], [7, 1]]).check_routing(3, E)  # rows 3.. hold -1: padding
    _rows([]).check_routing(0, E)


@pytest.mark.parametrize("bad", [8, -1, 1000416403])  # the last: bf16 bits seen on 2 x H200
def test_a_routing_id_that_names_no_expert_refuses_the_batch_naming_it(bad: int) -> None:
    with pytest.raises(BadRouting, match=rf"1 of 6, e\.g\. {bad}\).*overwritten"):
        _rows([[0, 1], [2, bad], [4, 5]]).check_routing(3, E)
