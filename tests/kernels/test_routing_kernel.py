"""kernels/routing_kernel.py's Triton routing kernel against the torch path (route_torch) on the
`device` fixture: Triton's interpreter on the CPU, compiled on a GPU. Every mode of
test_routing.py's CASES; E not a power of two, groups of one, top_k up to E and past the kept
groups' experts; exact ties, -inf, +inf and huge logits; bias or none; M = 0, 1 and counts that
fill no block of rows. The gpu-marked tests: real models' shapes at M in (1, 7, 4096), ids
exact where the scores are sigmoids (libdevice's expf and IEEE division, as torch's), and the
kernel inside a CUDA graph with no host sync.

On the CPU the interpreter's exp is numpy's, torch's another (an ulp apart now and then), and a
softmax's sum runs in another order than torch's on either device: random logits then may only
differ where the torch path's choice values tie within 1e-6 (`_assert_matches`).
"""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.config import GroupScore, RoutingConfig, Scoring
from moe_serve.kernels.random_weights import stable_seed
from moe_serve.kernels.routing import _limit_to_groups, mask_rows, route, route_torch
from moe_serve.kernels.routing_kernel import route_rows
from moe_serve.kernels.tensors import Routing
from tests.kernels.test_routing import CASES

RTOL = 1e-6
SIGMOID, TOP2 = Scoring.SIGMOID, GroupScore.TOP2_SUM

# name: (E, config); E not a power of two, groups of one, top_k = E, top_k past the kept experts
AWKWARD = {
    "e60-g4-top2": (
        60,
        RoutingConfig(
            top_k=6, scoring=SIGMOID, num_groups=4, topk_groups=2, group_score=TOP2,
            routed_scaling_factor=1.5,
        ),
    ),
    "e160-g8-max": (160, RoutingConfig(top_k=6, num_groups=8, topk_groups=3)),
    "e384-g8-top2": (
        384,
        RoutingConfig(
            top_k=8, scoring=SIGMOID, num_groups=8, topk_groups=4, group_score=TOP2,
            routed_scaling_factor=2.5,
        ),
    ),
    "e384-sigmoid": (384, RoutingConfig(top_k=8, scoring=SIGMOID, routed_scaling_factor=2.827)),
    "e60-no-renorm": (60, RoutingConfig(top_k=4, renormalize=False)),
    "e7-top-k-is-e": (7, RoutingConfig(top_k=7)),
    "e12-top-k-fills-kept-groups": (
        12,
        RoutingConfig(top_k=6, scoring=SIGMOID, num_groups=4, topk_groups=2, group_score=TOP2),
    ),
    "e12-top-k-past-kept-groups": (
        12, RoutingConfig(top_k=8, scoring=SIGMOID, num_groups=4, topk_groups=2)
    ),
    "e8-groups-of-one": (
        8,
        RoutingConfig(top_k=4, scoring=SIGMOID, num_groups=8, topk_groups=3, group_score=TOP2),
    ),
    "e16-top-k-is-group-size": (
        16, RoutingConfig(top_k=4, num_groups=4, topk_groups=1, group_score=TOP2)
    ),
    "e48-after-topk": (48, RoutingConfig(top_k=5, softmax_after_topk=True, num_groups=4)),
}  # fmt: skip


def _choice(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None) -> torch.Tensor:
    """The values the torch path chooses by, [M, E] (route_torch's steps)."""
    logits = logits.float()
    if cfg.softmax_after_topk:
        return logits
    scores = torch.softmax(logits, dim=-1) if cfg.scoring == Scoring.SOFTMAX else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    return _limit_to_groups(choice, cfg) if cfg.num_groups > 1 else choice


def _assert_matches(
    got: Routing, want: Routing, choice: torch.Tensor | None = None, rtol: float = RTOL
) -> None:
    """Same ids and weights within rtol. With `choice` (the torch path's choice values), a row's
    ids may differ where those values tie within rtol: the kernel's picks must then be worth
    what the torch path's are, position by position; their weights are not compared."""
    assert got.topk_ids.dtype == torch.int32 and got.topk_weights.dtype == torch.float32
    assert got.topk_ids.shape == want.topk_ids.shape
    ids, ref = got.topk_ids.cpu().long(), want.topk_ids.cpu().long()
    same = (ids == ref).all(dim=1)
    if choice is None:
        assert same.all(), f"rows {(~same).nonzero().flatten().tolist()} differ"
    else:
        choice = choice.cpu()
        for row in (~same).nonzero().flatten().tolist():
            assert ids[row].unique().numel() == ids.shape[1], f"row {row}: {ids[row].tolist()}"
            torch.testing.assert_close(
                choice[row, ids[row]], choice[row, ref[row]], rtol=rtol, atol=0.0
            )
    torch.testing.assert_close(
        got.topk_weights.cpu()[same],
        want.topk_weights.cpu()[same],
        rtol=rtol,
        atol=1e-30,
        equal_nan=True,
    )


def _random(m: int, e: int, cfg: RoutingConfig, seed: str, with_bias: bool, device):
    gen = torch.Generator().manual_seed(stable_seed(seed))
    logits = torch.randn(m, e, generator=gen) * 2
    bias_scale = 0.1 if cfg.scoring == Scoring.SIGMOID else 0.01
    bias = torch.randn(e, generator=gen) * bias_scale if with_bias else None
    return logits.to(device), None if bias is None else bias.to(device)


def _check(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None) -> None:
    """The kernel against route_torch on the same device; near-ties excused (module doc)."""
    _assert_matches(
        route_rows(logits, cfg, bias), route_torch(logits, cfg, bias), _choice(logits, cfg, bias)
    )


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_every_mode_matches_the_torch_path(name: str, num_tokens: int, device) -> None:
    cfg = CASES[name]
    logits, bias = _random(num_tokens, 16, cfg, name, cfg.scoring == SIGMOID, device)
    _check(logits, cfg, bias)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("name", AWKWARD)
def test_awkward_shapes_match_the_torch_path(name: str, with_bias: bool, device) -> None:
    """E not a power of two, groups of one, top_k = E or past the kept groups' experts (the
    torch path then takes the masked ones, -inf, lowest index first), 67 rows."""
    e, cfg = AWKWARD[name]
    logits, bias = _random(67, e, cfg, name, with_bias, device)
    _check(logits, cfg, bias)


@pytest.mark.parametrize("name", [*CASES, *AWKWARD])
def test_exact_ties_go_to_the_lower_expert_and_group(name: str, device) -> None:
    """All equal, the same values in every group, few distinct values (ties everywhere), a
    tied bias, -0.0 beside 0.0: ids exactly the torch path's."""
    e, cfg = AWKWARD.get(name, (16, CASES.get(name)))
    gen = torch.Generator().manual_seed(stable_seed(name))
    logits = torch.zeros(6, e)
    logits[1] = torch.tensor([0.5, 1.0]).repeat(e)[:e]
    logits[2] = torch.randint(0, 4, (e,), generator=gen) / 2
    logits[3] = logits[2].flip(0)
    logits[4, ::2] = -0.0
    logits[5] = torch.randint(0, 3, (e,), generator=gen) / 2
    bias = (torch.randint(0, 2, (e,), generator=gen) / 4).to(device)
    logits = logits.to(device)
    for b in (None, bias):
        _assert_matches(route_rows(logits, cfg, b), route_torch(logits, cfg, b))
    want = torch.arange(cfg.top_k, dtype=torch.int32).expand(1, -1)
    assert torch.equal(route_rows(logits[:1], cfg).topk_ids.cpu(), want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, on inf - inf in the interpreter
@pytest.mark.parametrize("name", [*CASES, *AWKWARD])
def test_nonfinite_and_huge_logits(name: str, device) -> None:
    """-inf (whole rows of them too), +inf, NaN and logits of +-1e30, +-100: the choice and the
    weights as the torch path's (its stable sort ranks NaN first), NaN where it makes NaN."""
    e, cfg = AWKWARD.get(name, (16, CASES.get(name)))
    gen = torch.Generator().manual_seed(stable_seed(name))
    logits = torch.randn(8, e, generator=gen)
    logits[0, ::3] = float("-inf")
    logits[1] = float("-inf")
    logits[2, 1::2] = float("-inf")
    logits[2, 0] = 1e30
    logits[3, ::2] = -100.0
    logits[3, 1::4] = 100.0
    logits[4, 3] = float("inf")
    logits[5, :] = -1e30
    logits[6, e // 2] = 1e30
    logits[7, 1] = float("nan")
    if device.type == "cpu":  # torch's CUDA stable sort ranks this NaN last, not first (doc)
        logits[7, e - 1] = -float("nan")  # the sign bit set
    logits = logits.to(device)
    bias = (torch.randn(e, generator=gen) * 0.01).to(device)
    for b in (None, bias):
        _check(logits, cfg, b)


@pytest.mark.parametrize("name", ["mixtral", "deepseek-v3", "gpt-oss"])
def test_no_tokens_no_launch(name: str, device) -> None:
    cfg = CASES[name]
    routing = route_rows(torch.empty(0, 16, device=device), cfg)
    assert routing.topk_ids.shape == routing.topk_weights.shape == (0, cfg.top_k)
    assert routing.topk_ids.dtype == torch.int32 and routing.topk_ids.device.type == device.type


@pytest.mark.parametrize("valid", [0, 1, 36, 37])
def test_rows_past_valid_rows_are_routed_nowhere(valid: int, device) -> None:
    """A CUDA graph's padding: ids -1 from valid_rows on, as `mask_rows` sets them on the torch
    path; the valid rows' ids and every weight as routed without it."""
    cfg = CASES["deepseek-v3"]
    logits, bias = _random(37, 16, cfg, "valid", True, device)
    valid_rows = torch.tensor(valid, device=device)
    got = route_rows(logits, cfg, bias, valid_rows)
    full = route_rows(logits, cfg, bias)
    assert torch.equal(got.topk_ids, mask_rows(full.topk_ids, valid_rows))
    assert (got.topk_ids[valid:] == -1).all() and (got.topk_ids[:valid] >= 0).all()
    assert torch.equal(got.topk_weights, full.topk_weights)
    assert torch.equal(route(logits, cfg, bias, valid_rows).topk_ids, got.topk_ids)


def test_half_precision_strided_logits_and_bias(device) -> None:
    """bfloat16 logits read in place from a wider tensor, a bfloat16 bias: as the torch path,
    which converts both to float32 first."""
    cfg = CASES["deepseek-v3"]
    gen = torch.Generator().manual_seed(7)
    wide = (torch.randn(37, 24, generator=gen) * 2).to(torch.bfloat16).to(device)
    bias = (torch.randn(16, generator=gen) * 0.1).to(torch.bfloat16).to(device)
    logits = wide[:, 3:19]
    _assert_matches(
        route_rows(logits, cfg, bias), route_torch(logits, cfg, bias), _choice(logits, cfg, bias)
    )


def test_shapes_the_torch_path_cannot_route_are_refused(device) -> None:
    logits = torch.zeros(2, 12, device=device)
    with pytest.raises(ValueError, match="top_k"):
        route_rows(logits, RoutingConfig(top_k=13))
    with pytest.raises(ValueError, match="num_groups"):
        route_rows(logits, RoutingConfig(top_k=2, num_groups=5, topk_groups=2))


def test_route_keeps_the_torch_path_on_the_cpu() -> None:
    cfg = CASES["deepseek-v3"]
    logits = torch.randn(5, 16)
    want, got = route_torch(logits, cfg), route(logits, cfg)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.topk_weights, want.topk_weights)


# --- on a GPU: real models' shapes, exact ids, CUDA graphs -------------------------------------

DEEPSEEK_V3 = RoutingConfig(
    top_k=8, scoring=SIGMOID, num_groups=8, topk_groups=4, group_score=TOP2,
    routed_scaling_factor=2.5,
)  # fmt: skip
MODELS = {  # name: (E, config, correction bias)
    "deepseek-v3": (256, DEEPSEEK_V3, True),
    "kimi-k2": (384, RoutingConfig(top_k=8, scoring=SIGMOID, routed_scaling_factor=2.827), True),
    "mixtral": (8, RoutingConfig(top_k=2), False),
    "qwen3": (128, RoutingConfig(top_k=8), False),
    "qwen2-moe": (60, RoutingConfig(top_k=4, renormalize=False), False),
    "gpt-oss": (128, RoutingConfig(top_k=4, softmax_after_topk=True), False),
    "deepseek-v2": (
        160, RoutingConfig(top_k=6, num_groups=8, topk_groups=3, routed_scaling_factor=16.0), False
    ),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 4096])
@pytest.mark.parametrize("name", MODELS)
def test_models_match_the_torch_path_on_gpu(name: str, m: int) -> None:
    """On the same GPU: sigmoid scores (and gpt-oss's choice on the logits) pick exactly the
    torch path's ids; softmax scores may differ only at its near-ties. Weights within 1e-6."""
    e, cfg, with_bias = MODELS[name]
    logits, bias = _random(m, e, cfg, name, with_bias, torch.device("cuda"))
    got, want = route_rows(logits, cfg, bias), route_torch(logits, cfg, bias)
    exact = cfg.scoring == SIGMOID or cfg.softmax_after_topk
    _assert_matches(got, want, None if exact else _choice(logits, cfg, bias))
    routed = route(logits, cfg, bias)  # route takes the kernel on a GPU
    assert torch.equal(routed.topk_ids, got.topk_ids)
    assert torch.equal(routed.topk_weights, got.topk_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3", "gpt-oss"])
def test_the_kernel_syncs_nothing_and_replays_in_a_cuda_graph(name: str) -> None:
    e, cfg, with_bias = MODELS[name]
    cuda = torch.device("cuda")
    logits, bias = _random(64, e, cfg, name, with_bias, cuda)
    route_rows(logits, cfg, bias)  # compiled before the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        route_rows(logits, cfg, bias)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route_rows(logits, cfg, bias)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_rows(logits, cfg, bias)
    fresh, _ = _random(64, e, cfg, name + "-replay", False, cuda)
    logits.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    want = route_rows(fresh, cfg, bias)
    assert torch.equal(captured.topk_ids, want.topk_ids)
    assert torch.equal(captured.topk_weights, want.topk_weights)
