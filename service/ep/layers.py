"""What every expert-parallel rank builds alike: the layers' plan that rank 0 publishes, each
rank's device, and its slice of a layer composed with naive-ep's sender mode."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kernels.layer import MoELayer, build_layer
from ...kernels.modular import ModularKernel
from ...kernels.placement import Placement
from ...kernels.prepare_finalize.naive_ep import NaiveEP
from ...kernels.selection import Selection
from ...kernels.workspace import Workspace
from ...weights.placement_file import read_expert_counts, read_placement
from ..engine.interface import LayerSource
from ..settings import Settings
from .group import Generation

# How long a rank waits in a collective for the others. Idle ranks wait on the store, not in a
# collective, so this bounds only the skew within one forward (first-call compiles).
COLLECTIVE_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 600.0  # how long ranks wait for each other to load and join


@dataclass(frozen=True)
class LayerPlan:
    name: str
    path: str
    ranks: tuple[tuple[int, ...], ...]  # its placement over the global ranks
    num_experts: int

    @property
    def placement(self) -> Placement:
        return Placement(self.ranks, self.num_experts)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs, published by rank 0 in the store."""

    world_size: int
    device_type: str  # "cuda" or "cpu"
    backend: str
    chunk_tokens: int  # --max-batch-tokens: rank 0's largest batch, so every rank's largest pass
    layers: tuple[LayerPlan, ...]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankSpec:
        raw = json.loads(text)
        plans = tuple(
            LayerPlan(p["name"], p["path"], tuple(map(tuple, p["ranks"])), p["num_experts"])
            for p in raw.pop("layers")
        )
        return cls(**raw, layers=plans)


def rank_device(base: torch.device, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU from `base` (all ranks share the CPU when base is the CPU)."""
    if base.type != "cuda":
        return base
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"expert parallelism needs GPU {index} for rank {rank}, but only "
            f"{torch.cuda.device_count()} are visible"
        )
    return torch.device("cuda", index)


def initial_placement(settings: Settings, num_experts: int) -> Placement:
    """--ep-placement (or contiguous slices), plus --ep-redundant copies of the hottest experts
    by the file's counts (without counts, of the lowest ids)."""
    file = settings.ep_placement
    if file is None:
        placement, counts = Placement.contiguous(num_experts, settings.ep), None
    else:
        placement = read_placement(file, num_experts, settings.ep)
        counts = read_expert_counts(file, num_experts)
    return placement.with_redundant(counts or [1.0] * num_experts, settings.ep_redundant)


def build_ep_kernel(
    source: LayerSource,
    placement: Placement,
    rank: int,
    current: Callable[[], Generation | None],
    spec: RankSpec,
    device: torch.device,
    workspace: Workspace,
) -> tuple[MoELayer, Selection]:
    """`source` holds `rank`'s experts of `placement` (over the group's ranks): compose them
    with naive-ep's sender mode and the replica map, waiting through `current()` generation."""
    layer, choice = build_layer(
        source.config,
        source.weights,
        device,
        spec.backend,
        workspace,
        spec.chunk_tokens,
        expert_map=placement.replica_map(rank).to(device),
        # no generation yet (a rank building before the group forms): set by regroup_kernel
        prepare_finalize=NaiveEP(
            None if current() is None else current().group,
            sender=0,
            wait=lambda work: current().wait(work),
        ),
    )
    counts = [len(ids) for ids in placement.ranks]
    reason = f"{choice.reason}; experts over {placement.world_size} ranks, per rank {counts}"
    return layer, dataclasses.replace(choice, reason=reason)


def regroup_kernel(
    kernel: ModularKernel, placement: Placement, index: int, generation: Generation
) -> None:
    """Point `kernel` at a new group in which this rank is `index` of `placement`'s ranks."""
    kernel.prepare_finalize.group = generation.group
    device = kernel.spec.expert_map.device
    kernel.spec = dataclasses.replace(
        kernel.spec, expert_map=placement.replica_map(index).to(device)
    )
