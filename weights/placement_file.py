"""`--ep-placement FILE`: JSON listing, per rank, the global expert ids it holds in local order.

{"ranks": [[0, 1, 2, 7], [3, 4, 5, 6]]}

An expert may sit on several ranks (redundant copies of a hot expert). The optional "counts"
lists tokens per expert (from a previous run's moe_serve_expert_tokens); `--ep-redundant N`
then adds its N copies to the hottest of them.

{"ranks": [[0, 1, 2, 7], [3, 4, 5, 6, 0]], "counts": [900, 10, 12, 8, 30, 11, 9, 20]}
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, ValidationError

from ..kernels.placement import Placement
from .errors import describe_validation_error


class _PlacementFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ranks: list[list[NonNegativeInt]]
    counts: list[NonNegativeFloat] | None = None  # tokens per expert, for --ep-redundant


def _read(path: Path, num_experts: int) -> _PlacementFile:
    try:
        parsed = _PlacementFile.model_validate_json(Path(path).read_bytes())
    except OSError as err:
        raise ValueError(f"placement file {path}: cannot read it: {err}") from err
    except ValidationError as err:
        problems = describe_validation_error(err, "file")
        raise ValueError(f"placement file {path}: {problems}") from err
    if parsed.counts is not None and len(parsed.counts) != num_experts:
        raise ValueError(
            f"placement file {path}: {len(parsed.counts)} expert counts for {num_experts} experts"
        )
    return parsed


def read_expert_counts(path: Path, num_experts: int) -> list[float] | None:
    """The file's tokens per expert, or None when it has none."""
    return _read(path, num_experts).counts


def read_placement(path: Path, num_experts: int, world_size: int) -> Placement:
    """Read and check a placement file for a layer of `num_experts` over `world_size` ranks."""
    ranks = _read(path, num_experts).ranks
    if len(ranks) != world_size:
        raise ValueError(
            f"placement file {path}: lists {len(ranks)} ranks, the group has {world_size}"
        )
    try:
        return Placement(tuple(tuple(ids) for ids in ranks), num_experts)
    except ValueError as err:
        raise ValueError(f"placement file {path}: {err}") from err
