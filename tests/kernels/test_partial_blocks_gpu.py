"""fp8-block layers whose H and I are not multiples of 128 (transformers' fine-grained fp8:
partial last scale blocks, w13's gate and up blocked apart) on the GPU, bf16: triton and
triton-batched against the reference at M in {1, 7, 64, 333}, all tokens on one expert, both
gate/up layouts; the whole layer (router, shared expert) from CUDA graphs; DeepGEMM refused."""

from __future__ import annotations

import pytest
import torch

from moe_serve.bench.random_layer import random_layer
from moe_serve.kernels.accuracy import relative_error, tolerance
from moe_serve.kernels.config import Activation, GateUp
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.layer_graphs import LayerGraphs
from moe_serve.kernels.quant_scheme import QuantScheme
from moe_serve.kernels.selection import select
from moe_serve.kernels.tensors import Format, ForwardInputs
from tests.kernels.triton_cases import Case, random_routing, triton_vs_reference

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
PARTIAL = {"num_experts": 8, "hidden": 200, "intermediate": 328}


@pytest.mark.parametrize("m", [1, 7, 64, 333])
@pytest.mark.parametrize("fmt", [Format.STANDARD, Format.BATCHED])
@pytest.mark.parametrize("layout", list(GateUp))
def test_triton_serves_partial_fp8_blocks_like_the_reference(
    m: int, fmt: Format, layout: GateUp
) -> None:
    activation = Activation.SWIGLUOAI if layout == GateUp.INTERLEAVED else Activation.SILU
    cfg = Case(QuantScheme.FP8_BLOCK, torch.bfloat16, activation, layout, **PARTIAL).config()
    routing = random_routing(m, 8, 2, seed=m)
    assert triton_vs_reference(cfg, routing, CUDA, fmt) < tolerance(cfg)
    one = random_routing(m, 8, 2, seed=m, only=5)  # every token on expert 5, others empty
    assert triton_vs_reference(cfg, one, CUDA, fmt) < tolerance(cfg)


def test_whole_layer_with_partial_blocks_replays_from_graphs_as_the_reference() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK, torch.bfloat16, **PARTIAL).config()
    weights = random_layer(cfg, CUDA, seed=1, router=True, shared_intermediate=200)
    layer, _ = build_layer(cfg, weights, CUDA, "triton")
    reference, _ = build_layer(cfg, weights, CUDA, "reference")
    graphs = LayerGraphs(layer, CUDA, max_tokens=64, with_logits=False)
    graphs.capture()
    x = torch.randn(50, 200, device=CUDA, dtype=torch.bfloat16)
    out = graphs.forward(ForwardInputs(x)).output.output.clone()
    expected = reference.forward(ForwardInputs(x)).output
    assert relative_error(out, expected) < tolerance(cfg)


def test_deep_gemm_refuses_partial_blocks_saying_why() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK, torch.bfloat16, **PARTIAL).config()
    rejected = select(cfg, CUDA).rejected
    assert "not a multiple of 128" in rejected["deep-gemm"]
    assert "not a multiple of 128" in rejected["triton-or-deep-gemm"]
