"""Batch invariance (kernels/batch_invariant.py): with it, a row's output is bit for bit the
same alone, among random other rows, and in any chunking of its batch; the experts run here on
the CPU (triton in the interpreter, fp16/fp32), the whole layer (router, sigmoid routing,
shared expert) with the reference. tests/kernels/test_batch_invariant_gpu.py: bf16 on CUDA."""

from __future__ import annotations

import pytest
import torch

from moe_serve.bench.random_layer import random_layer
from moe_serve.kernels.batch_invariant import fixed_order_topk_sum, row_by_row, triton_matmul
from moe_serve.kernels.config import GroupScore, MoEConfig, RoutingConfig, Scoring
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.experts.triton import TritonExperts
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.registry import experts_backends
from moe_serve.kernels.selection import select
from moe_serve.kernels.stages import weighted_topk_sum
from moe_serve.kernels.tensors import ForwardInputs, Routing
from moe_serve.kernels.workspace import Workspace
from tests.kernels.triton_cases import Case, random_routing

CPU = torch.device("cpu")
M = 37  # rows per batch: several M tiles, experts hit unevenly


def _rows(routing: Routing, rows: torch.Tensor | slice) -> Routing:
    return Routing(routing.topk_ids[rows], routing.topk_weights[rows])


def assert_batch_invariant(
    forward: object, hidden: torch.Tensor, routing: Routing, num_experts: int = 4, seed: int = 0
) -> None:
    """forward(hidden [m, H], routing) -> [m, H]: each row alone, among others and in other
    chunkings gives the full batch's row, bit for bit."""
    full = forward(hidden, routing)
    for i in (0, 5, hidden.shape[0] - 1):
        alone = forward(hidden[i : i + 1], _rows(routing, slice(i, i + 1)))
        assert torch.equal(alone[0], full[i]), f"row {i} alone differs"
    start = 0
    for size in (3, 13, 1, hidden.shape[0]):  # uneven chunks, then the rest
        stop = min(start + size, hidden.shape[0])
        part = forward(hidden[start:stop], _rows(routing, slice(start, stop)))
        assert torch.equal(part, full[start:stop]), f"chunk {start}:{stop} differs"
        start = stop
    # among other, random rows (enough for larger tiles without invariance), shuffled
    g = torch.Generator().manual_seed(seed + 7)
    others = torch.randn(4 * hidden.shape[0] + 5, hidden.shape[1], generator=g).to(hidden)
    k = routing.topk_ids.shape[1]
    other_routing = random_routing(others.shape[0], num_experts, k, seed=seed + 8)
    mixed = torch.cat([hidden, others])
    mixed_routing = Routing(
        torch.cat([routing.topk_ids, other_routing.topk_ids.to(routing.topk_ids)]),
        torch.cat([routing.topk_weights, other_routing.topk_weights.to(routing.topk_weights)]),
    )
    order = torch.randperm(mixed.shape[0], generator=g)
    out = forward(mixed[order], _rows(mixed_routing, order))
    back = torch.empty_like(out)
    back[order] = out
    assert torch.equal(back[: hidden.shape[0]], full), "rows among others differ"


def _experts_forward(cls: type, case: Case, device: torch.device) -> tuple[object, torch.Tensor]:
    cfg = case.config()
    weights = random_expert_weights(cfg, seed=1).to(device)
    kernel = ModularKernel(NoEP(), cls(cfg, weights, batch_invariant=True), Workspace(device))
    g = torch.Generator().manual_seed(2)
    hidden = (torch.randn(M, cfg.hidden_size, generator=g) * 2).to(cfg.dtype).to(device)
    return kernel.forward, hidden


INVARIANT_SCHEMES = (
    QuantScheme.NONE, QuantScheme.FP8_TOKEN, QuantScheme.FP8_BLOCK, QuantScheme.INT8_W8A16,
    QuantScheme.INT4_W4A16, QuantScheme.MXFP4,
)  # fmt: skip


@pytest.mark.parametrize("scheme", INVARIANT_SCHEMES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_reference_rows_are_bit_identical_whatever_their_batch(
    scheme: QuantScheme, dtype: torch.dtype
) -> None:
    forward, hidden = _experts_forward(ReferenceExperts, Case(scheme, dtype, has_bias=True), CPU)
    routing = random_routing(M, 4, 2, seed=3)
    assert_batch_invariant(forward, hidden, routing)


@pytest.mark.parametrize(
    "scheme", [QuantScheme.NONE, QuantScheme.FP8_BLOCK, QuantScheme.INT4_W4A16], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_rows_are_bit_identical_whatever_their_batch(
    scheme: QuantScheme, dtype: torch.dtype, device: torch.device
) -> None:
    forward, hidden = _experts_forward(TritonExperts, Case(scheme, dtype), device)
    routing = random_routing(M, 4, 2, seed=4, only=1)  # expert 1 gets every token
    routing = Routing(routing.topk_ids.to(device), routing.topk_weights.to(device))
    assert_batch_invariant(forward, hidden, routing)


def test_triton_invariant_runs_one_tile_set_at_every_batch_size() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK).config()
    experts = TritonExperts(cfg, random_expert_weights(cfg), batch_invariant=True)
    varying = TritonExperts(cfg, random_expert_weights(cfg))
    sizes = (1, 16, 300, 4096)
    assert len({experts.tiles(m, CPU) for m in sizes}) == 1
    assert len({varying.tiles(m, CPU) for m in sizes}) > 1  # what invariance turns off


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_matmul_matches_torch_and_is_row_invariant(
    dtype: torch.dtype, device: torch.device
) -> None:
    g = torch.Generator().manual_seed(5)
    a = torch.randn(70, 72, generator=g).to(dtype).to(device)
    w = torch.randn(40, 72, generator=g).to(dtype).to(device)
    out = triton_matmul(a, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, a.float() @ w.float().T, rtol=1e-3, atol=1e-3)
    assert torch.equal(triton_matmul(a[9:10], w)[0], out[9])
    assert torch.equal(triton_matmul(a[30:], w), out[30:])
    assert triton_matmul(a[:0], w).shape == (0, 40)


def test_fixed_order_topk_sum_matches_the_weighted_sum_and_skips_remote_slots() -> None:
    g = torch.Generator().manual_seed(6)
    y = torch.randn(9, 3, 16, generator=g)
    ids = torch.randint(-1, 4, (9, 3), generator=g, dtype=torch.int32)
    weights = torch.rand(9, 3, generator=g)
    y[ids < 0] = float("nan")  # rows of remote slots hold anything
    torch.testing.assert_close(
        fixed_order_topk_sum(y, ids, weights), weighted_topk_sum(y, ids, weights)
    )


def test_row_by_row_concatenates_tuples_and_passes_empty_batches_through() -> None:
    x = torch.arange(12.0).view(4, 3)
    a, b = row_by_row(lambda r: (r * 2, r.sum(1)), x)
    assert torch.equal(a, x * 2) and torch.equal(b, x.sum(1))
    assert row_by_row(lambda r: r + 1, x[:0]).shape == (0, 3)


# ---- the whole layer: router, routing, shared expert ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_whole_layer_rows_are_bit_identical_on_the_cpu(dtype: torch.dtype) -> None:
    routing = RoutingConfig(
        top_k=2, scoring=Scoring.SIGMOID, num_groups=2, topk_groups=1,
        group_score=GroupScore.TOP2_SUM, routed_scaling_factor=2.5,
    )  # fmt: skip
    cfg = MoEConfig(4, 72, 96, routing, quant=QuantConfig(QuantScheme.FP8_BLOCK), dtype=dtype)
    weights = random_layer(cfg, CPU, seed=9, router=True, shared_intermediate=80)
    layer, selection = build_layer(cfg, weights, CPU, "reference", batch_invariant=True)
    assert layer.batch_invariant and selection.experts.name == "reference"
    g = torch.Generator().manual_seed(10)
    hidden = torch.randn(M, 72, generator=g).to(dtype)

    def forward(x: torch.Tensor, _routing: Routing) -> torch.Tensor:
        return layer.forward(ForwardInputs(x)).output

    assert_batch_invariant(forward, hidden, random_routing(M, 4, 2, seed=0))


# ---- which backends and schemes can ------------------------------------------------------------


def test_fp8_tensor_is_refused_with_the_reason() -> None:
    cfg = Case(QuantScheme.FP8_TENSOR).config()
    with pytest.raises(ValueError, match="one scale over the whole batch"):
        select(cfg, CPU, "reference", batch_invariant=True)


def test_selection_keeps_only_backends_with_an_invariant_mode() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK).config()
    chosen = select(cfg, CPU, batch_invariant=True)
    assert chosen.experts.name == "reference"
    assert "batched format" in chosen.rejected["reference-batched"]
    assert experts_backends()["deep-gemm"].batch_invariance(cfg).ok is False
    assert experts_backends()["triton"].batch_invariance(cfg).ok
    with pytest.raises(ValueError, match="expert parallelism"):
        select(cfg, CPU, expert_parallel=True, batch_invariant=True)
