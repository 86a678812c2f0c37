"""Which rank holds which experts: contiguous slices by default, or explicit lists (read from a
placement file by weights.placement_file), with redundant copies of hot experts.

Every expert sits on at least one rank, at most once per rank, and every rank holds at least
one expert. An expert held by several ranks is a replicated one: the pairs routed to it split
between its copies by token index (`replica = token % copies`, copies in rank order), the same
rule on every rank, so each (token, expert) pair is still computed on exactly one rank and the
sum over ranks is the layer output.

The split is read on the device from small tables, without a host sync:
- `replica_map(rank)` [E, 1 + C] int32: column 0 the expert's number of copies, column 1 + c
  its local id on `rank` when its c-th copy is there, else -1 (kernels.routing.to_local_ids);
- `owner_map()` [E, 1 + C] int32: the same with the rank of each copy (for the load per rank).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .routing import contiguous_expert_map, replica_slots


@dataclass(frozen=True)
class Placement:
    ranks: tuple[tuple[int, ...], ...]  # rank -> global expert ids, in local id order
    num_experts: int

    def __post_init__(self) -> None:
        held = {e for ids in self.ranks for e in ids}
        missing = sorted(set(range(self.num_experts)) - held)
        outside = sorted(e for e in held if e >= self.num_experts)
        if missing or outside:
            raise ValueError(
                f"every expert of 0..{self.num_experts - 1} must sit on at least one rank: "
                f"missing {missing}, out of range {outside}"
            )
        for rank, ids in enumerate(self.ranks):
            twice = sorted({e for e in ids if ids.count(e) > 1})
            if twice:
                raise ValueError(f"rank {rank} lists experts {twice} more than once")
        empty = [r for r, ids in enumerate(self.ranks) if not ids]
        if empty:
            raise ValueError(f"ranks {empty} would hold no experts")

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> Placement:
        """Rank r holds experts [r * n, (r + 1) * n), n = ceil(E / world_size)."""
        maps = (contiguous_expert_map(num_experts, r, world_size) for r in range(world_size))
        return cls(
            tuple(tuple(torch.nonzero(m >= 0).flatten().tolist()) for m in maps), num_experts
        )

    @classmethod
    def balanced(cls, counts: Sequence[float], world_size: int, redundant: int = 0) -> Placement:
        """A placement for experts with these token counts: the hottest first, each onto the
        least loaded rank that still has a slot (ceil(E / world_size) per rank), then
        `redundant` extra copies (`with_redundant`). Ties go to the lower index."""
        slots = -(-len(counts) // world_size)
        ranks: list[list[int]] = [[] for _ in range(world_size)]
        loads = [0.0] * world_size
        for e in sorted(range(len(counts)), key=lambda e: (-counts[e], e)):
            rank = min(
                (r for r in range(world_size) if len(ranks[r]) < slots),
                key=lambda r: (loads[r], r),
            )
            ranks[rank].append(e)
            loads[rank] += counts[e]
        placement = cls(tuple(tuple(sorted(ids)) for ids in ranks), len(counts))
        return placement.with_redundant(counts, redundant)

    @functools.cached_property
    def _holders(self) -> tuple[tuple[int, ...], ...]:
        holders: list[list[int]] = [[] for _ in range(self.num_experts)]
        for rank, ids in enumerate(self.ranks):
            for e in ids:
                holders[e].append(rank)
        return tuple(map(tuple, holders))

    def copies(self, expert: int) -> list[int]:
        """The ranks holding `expert`, in rank order (its replica c is on the c-th)."""
        return list(self._holders[expert])

    @property
    def replicated(self) -> bool:
        return sum(len(ids) for ids in self.ranks) > self.num_experts

    def rank_loads(self, counts: Sequence[float]) -> list[float]:
        """Tokens per rank if each expert's `counts` split evenly between its copies."""
        share = [counts[e] / len(self.copies(e)) for e in range(self.num_experts)]
        return [sum(share[e] for e in ids) for ids in self.ranks]

    def with_redundant(self, counts: Sequence[float], redundant: int) -> Placement:
        """`redundant` more copies, one at a time: the expert with the most tokens per copy
        gets one more, on the least loaded rank that lacks it. Ties go to the lower index."""
        if len(counts) != self.num_experts:
            raise ValueError(f"{len(counts)} expert counts for {self.num_experts} experts")
        ranks = [list(ids) for ids in self.ranks]
        for _ in range(redundant):
            current = Placement(tuple(map(tuple, ranks)), self.num_experts)
            spreadable = [e for e in range(self.num_experts) if len(current.copies(e)) < len(ranks)]
            if not spreadable:
                raise ValueError(
                    f"{redundant} redundant copies do not fit: every expert is already on "
                    f"all {len(ranks)} ranks"
                )
            expert = max(spreadable, key=lambda e: (counts[e] / len(current.copies(e)), -e))
            loads = current.rank_loads(counts)
            rank = min(
                (r for r in range(len(ranks)) if expert not in ranks[r]),
                key=lambda r: (loads[r], r),
            )
            ranks[rank].append(expert)
        return Placement(tuple(map(tuple, ranks)), self.num_experts)

    def surviving(self, live: Sequence[int]) -> Placement:
        """This placement over the ranks `live` only (group rank i is `live[i]`; each keeps its
        experts and local ids). ValueError naming the experts left with no live copy."""
        lost = sorted(e for e in range(self.num_experts) if not set(self.copies(e)) & set(live))
        if lost:
            raise ValueError(f"experts {lost} have no copy on a live rank")
        return Placement(tuple(self.ranks[r] for r in live), self.num_experts)

    def local_experts(self, rank: int) -> list[int]:
        """The global ids `rank` loads, in local id order."""
        return list(self.ranks[rank])

    def expert_map(self, rank: int) -> torch.Tensor:
        """global id -> local id on `rank`, -1 where another rank holds it. [E] int32.
        Only for placements without replicas (`replica_map` covers both)."""
        if self.replicated:
            raise ValueError("a placement with replicated experts needs replica_map")
        emap = torch.full((self.num_experts,), -1, dtype=torch.int32)
        ids = torch.tensor(self.ranks[rank], dtype=torch.long)
        emap[ids] = torch.arange(len(ids), dtype=torch.int32)
        return emap

    def _table(self, entry: dict[tuple[int, int], int]) -> torch.Tensor:
        """[E, 1 + C] int32: copies, then entry[(expert, c)] per replica c (-1 where absent)."""
        holders = [self.copies(e) for e in range(self.num_experts)]
        table = torch.full((self.num_experts, 1 + max(map(len, holders))), -1, dtype=torch.int32)
        for e, ranks in enumerate(holders):
            table[e, 0] = len(ranks)
            for c in range(len(ranks)):
                table[e, 1 + c] = entry.get((e, c), -1)
        return table

    def replica_map(self, rank: int) -> torch.Tensor:
        """[E, 1 + C] int32: copies per expert, then for replica c its local id on `rank`
        when that replica is `rank`'s, else -1 (kernels.routing.to_local_ids reads it)."""
        local = {e: i for i, e in enumerate(self.ranks[rank])}
        return self._table({(e, self.copies(e).index(rank)): i for e, i in local.items()})

    def owner_map(self) -> torch.Tensor:
        """[E, 1 + C] int32: copies per expert, then the rank holding each replica."""
        return self._table(
            {(e, c): r for e in range(self.num_experts) for c, r in enumerate(self.copies(e))}
        )


def rank_tokens(topk_ids: torch.Tensor, owner_map: torch.Tensor, world_size: int) -> torch.Tensor:
    """Pairs each rank computes for routing topk_ids [M, k] (-1: nowhere) under `owner_map`
    (Placement.owner_map, on topk_ids' device). [world_size] int64, on the device, no sync."""
    owners = replica_slots(topk_ids, owner_map).flatten().long()
    owners = torch.where(owners >= 0, owners, world_size)
    counts = torch.zeros(world_size + 1, dtype=torch.int64, device=topk_ids.device)
    return counts.scatter_add_(0, owners, torch.ones_like(owners))[:world_size]


def balancedness(tokens_per_rank: torch.Tensor) -> torch.Tensor:
    """Mean over max of the tokens per rank (1: perfectly even; 1 too for an empty step).
    A 0-d float32 tensor on the same device, no sync."""
    t = tokens_per_rank.float()
    return torch.where(t.max() > 0, t.mean() / t.max().clamp_min(1), torch.ones_like(t.max()))
