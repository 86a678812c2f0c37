"""`--ep-placement FILE`: JSON listing, per rank, the global expert ids it holds in local order.

{"ranks": [[0, 1, 2, 7], [3, 4, 5, 6]]}
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

from kernels.placement import Placement
from weights.errors import describe_validation_error


class _PlacementFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ranks: list[list[NonNegativeInt]]


def read_placement(path: Path, num_experts: int, world_size: int) -> Placement:
    """Read and check a placement file for a layer of `num_experts` over `world_size` ranks."""
    try:
        ranks = _PlacementFile.model_validate_json(Path(path).read_bytes()).ranks
    except OSError as err:
        raise ValueError(f"placement file {path}: cannot read it: {err}") from err
    except ValidationError as err:
        problems = describe_validation_error(err, "file")
        raise ValueError(f"placement file {path}: {problems}") from err
    if len(ranks) != world_size:
        raise ValueError(
            f"placement file {path}: lists {len(ranks)} ranks, the group has {world_size}"
        )
    try:
        return Placement(tuple(tuple(ids) for ids in ranks), num_experts)
    except ValueError as err:
        raise ValueError(f"placement file {path}: {err}") from err
