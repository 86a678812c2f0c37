"""Batch invariance on the GPU (bf16): the triton experts (decode graphs at M <= 64, eager
above), the reference, our fixed-tile GEMM for the router and shared expert, and the whole
layer, uncaptured and replayed from whole-layer CUDA graphs (padded buckets): each row's output
bit for bit the same alone, among random others and in any chunking."""

from __future__ import annotations

import pytest
import torch

from moe_serve.bench.random_layer import random_layer
from moe_serve.kernels.batch_invariant import triton_matmul
from moe_serve.kernels.config import GroupScore, MoEConfig, RoutingConfig, Scoring
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.experts.triton import TritonExperts
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.layer_graphs import LayerGraphs
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.tensors import ForwardInputs, Routing
from moe_serve.kernels.workspace import Workspace
from tests.kernels.test_batch_invariant import assert_batch_invariant
from tests.kernels.triton_cases import Case, random_routing

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
M = 300  # past the decode graphs (64) and several heuristic buckets
SCHEMES = (
    QuantScheme.NONE, QuantScheme.FP8_TOKEN, QuantScheme.FP8_BLOCK, QuantScheme.INT8_W8A16,
    QuantScheme.INT4_W4A16, QuantScheme.MXFP4,
)  # fmt: skip


def _hidden(m: int, h: int, seed: int) -> torch.Tensor:
    return torch.randn(m, h, generator=torch.Generator().manual_seed(seed)).to(BF16).to(CUDA)


def _on_cuda(routing: Routing) -> Routing:
    return Routing(routing.topk_ids.to(CUDA), routing.topk_weights.to(CUDA))


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_triton_bf16_rows_are_bit_identical_whatever_their_batch(scheme: QuantScheme) -> None:
    cfg = Case(scheme, BF16, num_experts=8, hidden=256, intermediate=320).config()
    weights = random_expert_weights(cfg, seed=1).to(CUDA)
    kernel = ModularKernel(NoEP(), TritonExperts(cfg, weights, batch_invariant=True),
                           Workspace(CUDA))  # fmt: skip
    routing = _on_cuda(random_routing(M, 8, 2, seed=2, only=3))  # expert 3 gets every token
    assert_batch_invariant(kernel.forward, _hidden(M, 256, 3), routing, num_experts=8)


def test_reference_on_cuda_rows_are_bit_identical_whatever_their_batch() -> None:
    cfg = Case(QuantScheme.FP8_TOKEN, BF16, num_experts=8, hidden=256, intermediate=320).config()
    weights = random_expert_weights(cfg, seed=4).to(CUDA)
    kernel = ModularKernel(NoEP(), ReferenceExperts(cfg, weights, batch_invariant=True),
                           Workspace(CUDA))  # fmt: skip
    routing = _on_cuda(random_routing(70, 8, 2, seed=5))
    assert_batch_invariant(kernel.forward, _hidden(70, 256, 6), routing, num_experts=8)


def test_fixed_tile_gemm_rows_are_bit_identical_at_every_m() -> None:
    w = torch.randn(2048, 7168, device=CUDA, dtype=BF16) / 80
    a = torch.randn(1000, 7168, device=CUDA, dtype=BF16)
    full = triton_matmul(a, w)
    torch.testing.assert_close(full, torch.mm(a, w.T, out_dtype=torch.float32), rtol=2e-2,
                               atol=2e-2)  # fmt: skip
    for start, stop in ((0, 1), (7, 8), (5, 69), (100, 1000), (999, 1000)):
        assert torch.equal(triton_matmul(a[start:stop], w), full[start:stop])


def _deepseek_like(scheme: QuantScheme) -> MoEConfig:
    routing = RoutingConfig(
        top_k=4, scoring=Scoring.SIGMOID, num_groups=4, topk_groups=2,
        group_score=GroupScore.TOP2_SUM, routed_scaling_factor=2.5,
    )  # fmt: skip
    return MoEConfig(16, 512, 384, routing, quant=QuantConfig(scheme), dtype=BF16)


@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK], ids=str)
def test_whole_layer_rows_are_bit_identical_uncaptured_and_from_graphs(
    scheme: QuantScheme,
) -> None:
    cfg = _deepseek_like(scheme)
    weights = random_layer(cfg, CUDA, seed=7, router=True, shared_intermediate=256)
    layer, selection = build_layer(cfg, weights, CUDA, "triton", batch_invariant=True)
    assert layer.batch_invariant and selection.experts.name == "triton"
    hidden = _hidden(M, 512, 8)

    def eager(x: torch.Tensor, _routing: Routing) -> torch.Tensor:
        return layer.forward(ForwardInputs(x)).output.clone()

    assert_batch_invariant(eager, hidden, _on_cuda(random_routing(M, 16, 4, seed=9)), 16)

    graphs = LayerGraphs(layer, CUDA, max_tokens=96, with_logits=False)
    graphs.capture()
    full = eager(hidden, None)
    # every bucket, padded: 1, 3 (bucket 4), 33 (64), 65 and 96 (96)
    for start, stop in ((0, 1), (4, 7), (10, 43), (100, 165), (200, 296)):
        replayed = graphs.forward(ForwardInputs(hidden[start:stop])).output.output
        assert torch.equal(replayed, full[start:stop]), f"graph rows {start}:{stop} differ"
