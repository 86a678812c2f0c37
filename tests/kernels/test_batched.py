"""The batched prepare/finalize: every pair on its expert's row, capacity from M alone up to
SYNC_FREE_TOKENS (no value read on the host: it runs on meta tensors), the busiest expert's
count above it, and the forward against the float64 loop on both sides of that bound."""

from __future__ import annotations

import pytest
import torch

from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.experts.reference import BatchedReferenceExperts
from moe_serve.kernels.experts.triton import TritonBatchedExperts
from moe_serve.kernels.layer_graphs import kernel_can_capture
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.batched import SYNC_FREE_TOKENS, Batched
from moe_serve.kernels.quant_scheme import ActQuant, QuantConfig, QuantScheme
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import contiguous_expert_map, route, to_local_ids
from moe_serve.kernels.stages import DispatchSpec
from moe_serve.kernels.tensors import Routing
from moe_serve.kernels.workspace import Workspace
from tests.kernels.oracle import FP8_ACT_TOL, assert_matches, moe_oracle
from tests.kernels.triton_cases import random_routing

CPU = torch.device("cpu")
META = torch.device("meta")
CFG = MoEConfig(6, 64, 96, RoutingConfig(top_k=2), quant=QuantConfig(QuantScheme.FP8_BLOCK),
                dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("act_quant", [None, ActQuant.GROUP])
@pytest.mark.parametrize("m", [1, 37, SYNC_FREE_TOKENS])
def test_up_to_the_bound_prepare_and_finalize_read_no_device_value(
    m: int, act_quant: ActQuant | None
) -> None:
    """Meta tensors have no values: any .item(), nonzero or data-sized shape would raise."""
    hidden = torch.empty(m, 64, device=META)
    ids = torch.empty(m, 2, dtype=torch.int32, device=META)
    routing = Routing(ids, torch.empty(m, 2, device=META))
    batched = Batched()
    x = batched.prepare(hidden, routing, DispatchSpec(act_quant, 6), Workspace(META))
    assert x.hidden.shape == (6, m, 64) and x.tokens_per_expert.shape == (6,)
    assert act_quant is None or x.scale.shape == (6, m, 1)
    out = torch.empty(m, 64, device=META)
    batched.finalize(torch.empty(6, m, 64, device=META), x, out, reduce=True)
    big = SYNC_FREE_TOKENS + 1  # and above it the host reads the busiest count
    hidden, ids = torch.empty(big, 64, device=META), torch.empty(big, 2, device=META).int()
    with pytest.raises(RuntimeError, match="meta"):
        batched.prepare(hidden, Routing(ids, ids.float()), DispatchSpec(None, 6), Workspace(META))


@pytest.mark.parametrize("m", [1, 13, SYNC_FREE_TOKENS, SYNC_FREE_TOKENS + 3])
@pytest.mark.parametrize("other_rank", [False, True])
def test_every_pair_takes_the_next_row_of_its_expert_in_token_order(
    m: int, other_rank: bool
) -> None:
    routing = random_routing(m, 6, 2, seed=m, only=4)  # 4 takes every token; others few
    expert_map = contiguous_expert_map(6, rank=1, world_size=2) if other_rank else None
    ids = to_local_ids(routing.topk_ids, expert_map)
    hidden = torch.randn(m, 64)
    experts = 3 if other_rank else 6
    x = Batched().prepare(hidden, routing, DispatchSpec(None, experts, expert_map), Workspace(CPU))
    counts = torch.bincount(ids[ids >= 0].long(), minlength=experts)
    assert torch.equal(x.tokens_per_expert, counts.int())
    assert x.hidden.shape[1] == (m if m <= SYNC_FREE_TOKENS else int(counts.max()))
    assert torch.equal(x.slots < 0, ids < 0)
    for e in range(experts):
        tokens = torch.nonzero((ids == e).any(dim=1)).squeeze(1)  # ascending
        assert torch.equal(x.hidden[e, : counts[e]], hidden[tokens]), e
        slot_of = x.slots[tokens][ids[tokens] == e]
        assert torch.equal(slot_of, torch.arange(counts[e])), e


@pytest.mark.parametrize("m", [1, 37, SYNC_FREE_TOKENS + 5])
@pytest.mark.parametrize("ep", [False, True])
def test_forward_matches_the_loop_on_both_sides_of_the_bound(m: int, ep: bool) -> None:
    torch.manual_seed(m)  # not the suite's order: a lone token can be all ambiguous
    expert_map = contiguous_expert_map(6, rank=0, world_size=2) if ep else None
    weights = random_expert_weights(CFG, seed=m)
    local = weights if expert_map is None else weights.select(torch.arange(3))
    kernel = ModularKernel(
        Batched(), BatchedReferenceExperts(CFG, local), Workspace(CPU), expert_map
    )
    logits = torch.randn(m, 6)
    logits[:, 5] += 4.0  # expert 5 in every token's top 2 (another rank's with ep)
    logits[:, 1] -= 20.0  # expert 1 empty
    routing = route(logits, CFG.routing)
    hidden = torch.randn(m, 64)
    expected = moe_oracle(CFG, weights, hidden, routing, expert_map)
    assert_matches(kernel.forward(hidden, routing), expected, tol=FP8_ACT_TOL)


def test_batched_kernels_capture_up_to_the_bound_only() -> None:
    triton = TritonBatchedExperts(CFG, random_expert_weights(CFG, seed=0))
    kernel = ModularKernel(Batched(), triton, Workspace(CPU))
    assert kernel_can_capture(kernel, SYNC_FREE_TOKENS)
    above = kernel_can_capture(kernel, SYNC_FREE_TOKENS + 1)
    assert not above and f"above {SYNC_FREE_TOKENS} tokens" in above.reason
    reference = BatchedReferenceExperts(CFG, random_expert_weights(CFG, seed=0))
    refused = kernel_can_capture(ModularKernel(Batched(), reference, Workspace(CPU)), 1)
    assert not refused and "reference-batched cannot be captured" in refused.reason
