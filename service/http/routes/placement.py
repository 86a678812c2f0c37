"""GET and POST /v1/layers/{name}/placement: which expert-parallel rank holds which experts,
and a switch to another placement at run time (service/ep/engine.py's rebalance)."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, NonNegativeInt, model_validator

from ...errors import BadInput, Conflict
from ..body import parse_body
from ..deps import BodyDep, EngineDep
from ..schemas import ErrorBody

router = APIRouter(prefix="/v1/layers", tags=["expert parallelism"])

_ERRORS = {
    400: {"model": ErrorBody, "description": "a placement that does not fit the layer"},
    404: {"model": ErrorBody, "description": "no such layer"},
    409: {"model": ErrorBody, "description": "no expert parallelism, degraded, or busy"},
}


class PlacementRequest(BaseModel):
    """Either `ranks` (each rank's global expert ids, in local order; an expert may sit on
    several ranks) or `placement: "auto"`: balanced on the tokens per expert seen since the
    last switch, with `redundant` copies of the hottest experts (default: as many as now)."""

    model_config = ConfigDict(extra="forbid")

    ranks: list[list[NonNegativeInt]] | None = None
    placement: Literal["auto"] | None = None
    redundant: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _one_of(self) -> PlacementRequest:
        if (self.ranks is None) == (self.placement is None):
            raise ValueError('give either "ranks" or "placement": "auto"')
        if self.redundant is not None and self.placement is None:
            raise ValueError('"redundant" goes with "placement": "auto"')
        return self


@router.get(
    "/{name}/placement",
    summary="The experts each expert-parallel rank holds, the live ranks, the last step's "
    "balancedness, the tokens per expert since the last switch and the rebalance state",
    responses=_ERRORS,
)
async def get_placement(name: str, engine: EngineDep) -> dict:
    return engine.placement(name)


@router.post(
    "/{name}/placement",
    summary="Switch the layer to another placement: the ranks load their new experts in the "
    "background, the old placement serves until every rank has, then all switch between two "
    "forwards (202; GET follows the rebalance)",
    status_code=202,
    responses=_ERRORS,
)
async def post_placement(name: str, body: BodyDep, engine: EngineDep) -> JSONResponse:
    request = parse_body(PlacementRequest, body)
    try:  # on a thread: it waits for the forward in progress
        placement = await asyncio.to_thread(
            engine.rebalance, name, request.ranks, request.redundant
        )
    except ValueError as err:
        raise BadInput(f"placement for layer {name!r}: {err}") from None
    except RuntimeError as err:
        raise Conflict(str(err)) from None
    body = {"layer": name, "ranks": [list(ids) for ids in placement.ranks], "rebalance": "staging"}
    return JSONResponse(body, status_code=202)
