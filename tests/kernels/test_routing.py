"""Each routing mode against a plain per-token loop, ties included."""

from __future__ import annotations

import math

import pytest
import torch

from moe_serve.kernels.config import GroupScore, RoutingConfig, Scoring
from moe_serve.kernels.random_weights import stable_seed
from moe_serve.kernels.routing import contiguous_expert_map, route, to_local_ids


def _top(values: list[float], k: int) -> list[int]:
    """Indices of the k largest values, lower index first among equals."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def _loop_route(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None):
    ids_out, w_out = [], []
    for row in logits.double().tolist():
        e = len(row)
        if cfg.softmax_after_topk:
            ids = _top(row, cfg.top_k)
            z = [math.exp(row[i]) for i in ids]
            w_out.append([v / sum(z) * cfg.routed_scaling_factor for v in z])
            ids_out.append(ids)
            continue
        if cfg.scoring == Scoring.SOFTMAX:
            z = [math.exp(v - max(row)) for v in row]
            scores = [v / sum(z) for v in z]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (0.0 if bias is None else float(bias[i])) for i, s in enumerate(scores)]
        if cfg.num_groups > 1:
            size = e // cfg.num_groups
            groups = [choice[g * size : (g + 1) * size] for g in range(cfg.num_groups)]
            if cfg.group_score == GroupScore.MAX:
                gscore = [max(g) for g in groups]
            else:
                gscore = [sum(sorted(g, reverse=True)[:2]) for g in groups]
            keep = set(_top(gscore, cfg.topk_groups))
            choice = [c if i // size in keep else -math.inf for i, c in enumerate(choice)]
        ids = _top(choice, cfg.top_k)
        w = [scores[i] for i in ids]
        if cfg.renormalize:
            w = [v / sum(w) for v in w]
        ids_out.append(ids)
        w_out.append([v * cfg.routed_scaling_factor for v in w])
    return torch.tensor(ids_out), torch.tensor(w_out, dtype=torch.float64)


CASES = {
    "mixtral": RoutingConfig(top_k=2),
    "qwen-no-renorm": RoutingConfig(top_k=4, renormalize=False),
    "gpt-oss": RoutingConfig(top_k=4, softmax_after_topk=True),
    "sigmoid": RoutingConfig(top_k=3, scoring=Scoring.SIGMOID),
    "deepseek-v3": RoutingConfig(
        top_k=4,
        scoring=Scoring.SIGMOID,
        num_groups=4,
        topk_groups=2,
        group_score=GroupScore.TOP2_SUM,
        routed_scaling_factor=2.5,
    ),
    "deepseek-v2": RoutingConfig(
        top_k=3, num_groups=4, topk_groups=2, renormalize=False, routed_scaling_factor=16.0
    ),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_route_matches_the_loop(name: str, num_tokens: int) -> None:
    cfg = CASES[name]
    gen = torch.Generator().manual_seed(stable_seed(name))
    logits = torch.randn(num_tokens, 16, generator=gen) * 2
    bias = torch.randn(16, generator=gen) * 0.1 if cfg.scoring == Scoring.SIGMOID else None
    routing = route(logits, cfg, bias)
    ids, weights = _loop_route(logits, cfg, bias)
    assert routing.topk_ids.dtype == torch.int32
    assert torch.equal(routing.topk_ids.long(), ids)
    assert torch.allclose(routing.topk_weights.double(), weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", CASES)
def test_ties_go_to_the_lower_expert(name: str) -> None:
    cfg = CASES[name]
    logits = torch.zeros(3, 16)
    logits[1, [3, 9, 12]] = 1.0  # three-way tie at the top
    logits[2] = torch.tensor([0.5, 1.0] * 8)  # ties everywhere, groups tie too
    routing = route(logits, cfg)
    ids, weights = _loop_route(logits, cfg)
    assert torch.equal(routing.topk_ids.long(), ids)
    assert torch.allclose(routing.topk_weights.double(), weights, rtol=1e-5)


def test_score_correction_bias_steers_the_choice_but_not_the_weights() -> None:
    cfg = RoutingConfig(top_k=1, scoring=Scoring.SIGMOID, renormalize=False)
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    routing = route(logits, cfg, bias)
    assert routing.topk_ids.tolist() == [[2]]
    assert routing.topk_weights.item() == pytest.approx(0.5)  # sigmoid(0), not sigmoid(0) + 5


def test_expert_map_marks_other_ranks_with_minus_one() -> None:
    emap = contiguous_expert_map(num_experts=10, rank=1, world_size=3)  # 4 per rank: 4..7
    assert emap.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3, -1, -1]
    ids = torch.tensor([[0, 4], [7, 9]], dtype=torch.int32)
    assert to_local_ids(ids, emap).tolist() == [[-1, 0], [3, -1]]
    assert to_local_ids(ids, None) is ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 0}, "top_k"),
        ({"top_k": 2, "num_groups": 4, "topk_groups": 5}, "topk_groups"),
        ({"top_k": 2, "scoring": "sigmoid", "softmax_after_topk": True}, "softmax"),
        ({"top_k": 2, "scoring": "tanh"}, "tanh"),
    ],
)
def test_bad_routing_config_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**kwargs)
