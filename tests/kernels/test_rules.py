"""How a rule is made from measured times (kernels/rules.py): the ranking, DeepGEMM's
crossover and the rule's body, for the tuned tables and the self-calibration alike."""

from __future__ import annotations

import pytest

from moe_serve.kernels.rules import crossover_tokens, make_rule, rank_backends

TIMES = {
    "1": {"triton": 40.0, "deep-gemm": 90.0},
    "64": {"triton": 80.0, "deep-gemm": 85.0},
    "4096": {"triton": 900.0, "deep-gemm": 500.0},
}


def test_ranking_is_by_geometric_mean_over_token_counts() -> None:
    # triton: 40 * 80 * 900 = 2.88e6; deep-gemm: 90 * 85 * 500 = 3.8e6
    assert rank_backends(TIMES) == ("triton", "deep-gemm")
    partial = TIMES | {"1": {"triton": 40.0}}  # deep-gemm missing at one count: not ranked
    assert rank_backends(partial) == ("triton",)
    tie = {
        "1": {"triton-or-deep-gemm": 40.0, "triton": 40.0},
        "4": {"triton-or-deep-gemm": 80.0, "triton": 80.0},
    }
    assert rank_backends(tie) == ("triton", "triton-or-deep-gemm")  # by name, run after run


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        (TIMES, 4096),
        (TIMES | {"64": {"triton": 90.0, "deep-gemm": 85.0}}, 64),
        (TIMES | {"4096": {"triton": 400.0, "deep-gemm": 500.0}}, None),
        # a win at 64 that is lost again at 4096 does not count
        (
            TIMES
            | {"64": {"triton": 90.0, "deep-gemm": 85.0}, "4096": {"triton": 1, "deep-gemm": 2}},
            None,
        ),
    ],
)
def test_crossover_is_where_deep_gemm_wins_for_good(times: dict, expected: int | None) -> None:
    assert crossover_tokens(times, "deep-gemm", "triton") == expected


def test_a_rule_from_served_times_alone_is_ranked_and_planned_by_them() -> None:
    served = {m: dict(row) for m, row in TIMES.items()}
    body = make_rule(served, frozenset({"triton", "deep-gemm"}))
    assert body["plan"] == [[1, "triton"], [4096, "deep-gemm"]]
    assert body["fastest"] == {"1": "triton", "64": "triton", "4096": "deep-gemm"}
    assert body["order"] == ["triton", "deep-gemm"]
    assert body["deep_gemm_min_tokens"] == 4096
    assert "times_us" not in body
    assert served == TIMES  # no derived row among the served times


def test_the_modular_times_rank_the_backends_and_get_the_composed_row() -> None:
    served = {m: {"triton": 1.0, "deep-gemm": 2.0} for m in TIMES}
    times = {m: dict(row) for m, row in TIMES.items()}
    body = make_rule(served, frozenset(), times)
    assert body["plan"] == [[1, "triton"]]
    assert body["deep_gemm_min_tokens"] == 4096
    assert body["times_us"]["4096"]["triton-or-deep-gemm"] == 500.0
    assert body["times_us"]["1"]["triton-or-deep-gemm"] == 40.0
    assert body["order"] == ["triton-or-deep-gemm", "triton", "deep-gemm"]


def test_a_composed_backend_is_never_planned() -> None:
    served = {m: row | {"triton-or-deep-gemm": 1.0} for m, row in TIMES.items()}
    assert "triton-or-deep-gemm" not in {n for _, n in make_rule(served, frozenset())["plan"]}
