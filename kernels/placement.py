"""Which rank holds which experts: contiguous slices by default, or explicit lists (read from a
placement file by weights.placement_file).

Every expert sits on exactly one rank (naive EP sums the ranks' partial outputs, so a copy on
two ranks would count twice) and every rank holds at least one expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.routing import contiguous_expert_map


@dataclass(frozen=True)
class Placement:
    ranks: tuple[tuple[int, ...], ...]  # rank -> global expert ids, in local id order
    num_experts: int

    def __post_init__(self) -> None:
        held = sorted(e for ids in self.ranks for e in ids)
        if held != list(range(self.num_experts)):
            twice = sorted({e for e in held if held.count(e) > 1})
            missing = sorted(set(range(self.num_experts)) - set(held))
            outside = sorted(e for e in set(held) if e >= self.num_experts)
            raise ValueError(
                f"every expert of 0..{self.num_experts - 1} must sit on exactly one rank: "
                f"missing {missing}, on two ranks {twice}, out of range {outside}"
            )
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

    def local_experts(self, rank: int) -> list[int]:
        """The global ids `rank` loads, in local id order."""
        return list(self.ranks[rank])

    def expert_map(self, rank: int) -> torch.Tensor:
        """global id -> local id on `rank`, -1 where another rank holds it. [E] int32."""
        emap = torch.full((self.num_experts,), -1, dtype=torch.int32)
        ids = torch.tensor(self.ranks[rank], dtype=torch.long)
        emap[ids] = torch.arange(len(ids), dtype=torch.int32)
        return emap
