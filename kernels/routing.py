"""Router logits -> which k experts each token visits and with what weight.

Ties between equal scores go to the lower expert (or group) index, on every device, so that
routing is a function of the logits alone.
"""

from __future__ import annotations

import torch

from .arith import ceil_div
from .config import GroupScore, RoutingConfig, Scoring
from .stages import HAS_TRITON
from .tensors import Routing

if HAS_TRITON:
    from .routing_kernel import route_rows


def stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last axis, lower index first among equals."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _limit_to_groups(choice: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """Mask (-inf) the experts outside each token's `topk_groups` best groups. [M, E] -> [M, E]."""
    m, e = choice.shape
    grouped = choice.view(m, cfg.num_groups, e // cfg.num_groups)
    if cfg.group_score == GroupScore.MAX:
        group_scores = grouped.amax(dim=-1)
    else:  # TOP2_SUM
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, stable_topk(group_scores, cfg.topk_groups), True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(m, e)


def mask_rows(topk_ids: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
    """topk_ids [M, k] with rows from `valid_rows` (a 0-d tensor) on set to -1: routed nowhere."""
    rows = torch.arange(topk_ids.shape[0], device=topk_ids.device)
    return topk_ids.masked_fill((rows >= valid_rows)[:, None], -1)


def route(
    logits: torch.Tensor,
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
    valid_rows: torch.Tensor | None = None,
) -> Routing:
    """logits [M, E] (+ score-correction bias [E]) -> Routing(topk_ids [M, k], weights [M, k]).

    The bias only steers the choice (DeepSeek-V3); weights come from the uncorrected scores.
    `valid_rows` (a 0-d int64 tensor, for CUDA graphs): rows from it on are padding, their ids
    set to -1 (`mask_rows`). On a GPU one Triton launch does it all (kernels.routing_kernel);
    elsewhere `route_torch`.
    """
    if logits.is_cuda and HAS_TRITON:
        return route_rows(logits, cfg, correction_bias, valid_rows)
    routing = route_torch(logits, cfg, correction_bias)
    if valid_rows is None:
        return routing
    return Routing(mask_rows(routing.topk_ids, valid_rows), routing.topk_weights)


def route_torch(
    logits: torch.Tensor,
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
) -> Routing:
    """`route` in torch: the CPU path, and the reference the Triton kernel is tested against."""
    logits = logits.float()
    if cfg.softmax_after_topk:
        ids = stable_topk(logits, cfg.top_k)
        weights = torch.softmax(logits.gather(1, ids), dim=-1)
        return Routing(ids.to(torch.int32), weights * cfg.routed_scaling_factor)

    scores = torch.softmax(logits, dim=-1) if cfg.scoring == Scoring.SOFTMAX else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1:
        choice = _limit_to_groups(choice, cfg)
    ids = stable_topk(choice, cfg.top_k)
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return Routing(ids.to(torch.int32), weights * cfg.routed_scaling_factor)


def contiguous_expert_map(num_experts: int, rank: int, world_size: int) -> torch.Tensor:
    """global id -> local id on `rank` (or -1), experts split in contiguous slices. [E] int32."""
    per_rank = ceil_div(num_experts, world_size)
    ids = torch.arange(num_experts)
    local = ids - rank * per_rank
    return torch.where((local >= 0) & (local < per_rank), local, -1).to(torch.int32)


def replica_slots(topk_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """topk_ids [M, k] (-1: nowhere) -> table's entry for each pair's replica, [M, k] int32.

    `table` [E, 1 + C] (kernels.placement): column 0 the expert's copies, column 1 + c the entry
    of its replica c. Token t's pair takes replica t % copies: every rank splits a replicated
    expert's pairs alike, on the device. Pairs routed nowhere get -1."""
    ids = topk_ids.long()
    experts = ids.clamp_min(0)
    table = table.to(topk_ids.device)
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
    replica = rows % table[experts, 0].long().clamp_min(1)
    return torch.where(ids >= 0, table[experts, 1 + replica], -1).to(torch.int32)


def to_local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global [M, k] ids -> local ids through `expert_map` (-1 = not on this rank): [E] global
    id -> local id, or a replica map [E, 1 + C] (Placement.replica_map). -1 ids stay -1."""
    if expert_map is None:
        return topk_ids
    if expert_map.dim() == 2:
        return replica_slots(topk_ids, expert_map).to(topk_ids.dtype)
    ids = topk_ids.long()
    local = expert_map.to(topk_ids.device)[ids.clamp_min(0)]
    return torch.where(ids >= 0, local, -1).to(topk_ids.dtype)
