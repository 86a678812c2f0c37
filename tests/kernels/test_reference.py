"""The reference backend, through the modular kernel, against the float64 loop."""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_serve.kernels.config import Activation, ActivationSpec, GateUp, MoEConfig, RoutingConfig
from moe_serve.kernels.experts.reference import BatchedReferenceExperts, ReferenceExperts
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.batched import Batched
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights, stable_seed
from moe_serve.kernels.routing import contiguous_expert_map, route
from moe_serve.kernels.workspace import Workspace
from tests.kernels.oracle import FP8_ACT_TOL, assert_matches, moe_oracle

ACTIVATIONS = {
    "silu": ActivationSpec(Activation.SILU),
    "gelu": ActivationSpec(Activation.GELU),
    "swigluoai": ActivationSpec(Activation.SWIGLUOAI, GateUp.INTERLEAVED, limit=1.5),
}


def _config(scheme: QuantScheme, activation: str, bias: bool) -> MoEConfig:
    return MoEConfig(
        num_experts=6,
        hidden_size=64,
        intermediate_size=96,  # 96: not a multiple of 128
        routing=RoutingConfig(top_k=2),
        activation=ACTIVATIONS[activation],
        quant=QuantConfig(scheme, group_size=32),
        dtype=torch.float32,
        has_bias=bias,
    )


def _build(
    cfg: MoEConfig, batched: bool, seed: int, expert_map: torch.Tensor | None, chunk_tokens: int
):
    weights = random_expert_weights(cfg, seed)
    if expert_map is not None:  # this rank holds the experts the map sends somewhere
        weights = weights.select(torch.nonzero(expert_map >= 0).squeeze(1))
    experts_cls, pf = (BatchedReferenceExperts, Batched) if batched else (ReferenceExperts, NoEP)
    kernel = ModularKernel(
        pf(), experts_cls(cfg, weights), Workspace("cpu"), expert_map, chunk_tokens
    )
    return kernel, random_expert_weights(cfg, seed)


@pytest.mark.parametrize(
    ("scheme", "activation", "bias", "batched", "chunked", "ep"),
    list(
        itertools.product(
            QuantScheme, ACTIVATIONS, [False, True], [False, True], [False, True], [False, True]
        )
    ),
    ids=lambda v: str(v),
)
def test_reference_matches_float64_loop(
    scheme: QuantScheme, activation: str, bias: bool, batched: bool, chunked: bool, ep: bool
) -> None:
    cfg = _config(scheme, activation, bias)
    seed = stable_seed(scheme, activation, bias, batched, chunked, ep)
    expert_map = contiguous_expert_map(6, rank=1, world_size=2) if ep else None
    kernel, full_weights = _build(
        cfg, batched, seed, expert_map, chunk_tokens=16 if chunked else 1024
    )
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(37, 64, generator=gen)
    routing = route(torch.randn(37, 6, generator=gen), cfg.routing)

    out = kernel.forward(hidden, routing)
    expected = moe_oracle(cfg, full_weights, hidden, routing, expert_map, 16 if chunked else None)
    assert out.dtype == torch.float32 and out.shape == (37, 64)
    assert_matches(out, expected, tol=FP8_ACT_TOL if scheme.spec.act_quant else 1e-5)


@pytest.mark.parametrize("batched", [False, True])
def test_all_tokens_to_one_expert_and_empty_experts(batched: bool) -> None:
    cfg = _config(QuantScheme.FP8_BLOCK, "silu", bias=False)
    kernel, weights = _build(cfg, batched, seed=3, expert_map=None, chunk_tokens=1024)
    hidden = torch.randn(9, 64)
    logits = torch.full((9, 6), -10.0)
    logits[:, 4] = 5.0  # every token's first choice is expert 4; 0, 2, 3, 5 get none
    logits[:, 1] = 4.0
    routing = route(logits, cfg.routing)
    assert set(routing.topk_ids.flatten().tolist()) == {1, 4}
    out = kernel.forward(hidden, routing)
    assert_matches(out, moe_oracle(cfg, weights, hidden, routing), tol=FP8_ACT_TOL)


@pytest.mark.parametrize("batched", [False, True])
def test_single_token_and_no_tokens(batched: bool) -> None:
    cfg = _config(QuantScheme.NONE, "silu", bias=True)
    kernel, weights = _build(cfg, batched, seed=4, expert_map=None, chunk_tokens=1024)
    hidden = torch.randn(1, 64)
    routing = route(torch.randn(1, 6), cfg.routing)
    assert_matches(
        kernel.forward(hidden, routing), moe_oracle(cfg, weights, hidden, routing), tol=1e-5
    )
    empty = kernel.forward(torch.empty(0, 64), route(torch.empty(0, 6), cfg.routing))
    assert empty.shape == (0, 64)


def test_router_weight_on_input_matches_weighting_the_output_for_linear_experts() -> None:
    spec = ActivationSpec(Activation.SILU)
    on_input = MoEConfig(
        num_experts=4,
        hidden_size=64,
        intermediate_size=64,
        routing=RoutingConfig(top_k=1, renormalize=False),
        activation=spec,
        dtype=torch.float32,
        apply_router_weight_on_input=True,
    )
    weights = random_expert_weights(on_input, seed=5)
    kernel = ModularKernel(NoEP(), ReferenceExperts(on_input, weights), Workspace("cpu"))
    hidden = torch.randn(5, 64)
    routing = route(torch.randn(5, 4), on_input.routing)
    out = kernel.forward(hidden, routing)
    scaled = hidden * routing.topk_weights
    ones = type(routing)(routing.topk_ids, torch.ones_like(routing.topk_weights))
    assert_matches(out, moe_oracle(on_input, weights, scaled, ones), tol=1e-5)
