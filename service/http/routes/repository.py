"""Triton's model repository extension over HTTP: the index, load and unload
(service/triton/repository.py). A server started without --model-repository answers 400."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from ...core.runtime import ready, repository_of
from ...triton.repository import check_load_parameters
from ..body import parse_body
from ..deps import BodyDep, RuntimeDep
from ..schemas import ErrorBody

router = APIRouter(prefix="/v2/repository", tags=["kserve-v2 model repository"])

_ERRORS = {
    400: {"model": ErrorBody, "description": "no repository, a broken layer directory"},
    404: {"model": ErrorBody, "description": "no such model directory or served model"},
}


class IndexRequest(BaseModel):
    ready: bool = False  # only the models that are serving


class ModelRequest(BaseModel):
    parameters: dict[str, Any] = Field(default_factory=dict)


@router.post("/index", summary="Every model directory of the repository and its state")
async def index(body: BodyDep, runtime: RuntimeDep) -> list[dict[str, str]]:
    request = parse_body(IndexRequest, body)
    entries = repository_of(runtime).index(runtime, request.ready)
    return [entry.to_json() for entry in entries]


@router.post(
    "/models/{name}/load",
    summary="Load (or reload) a model from its directory; a failed load keeps the old version",
    responses=_ERRORS,
)
async def load(name: str, body: BodyDep, runtime: RuntimeDep) -> dict:
    check_load_parameters(parse_body(ModelRequest, body).parameters)
    await repository_of(runtime).load(ready(runtime), name)
    return {}


@router.post(
    "/models/{name}/unload",
    summary="Unload a model once its admitted requests are answered",
    responses=_ERRORS,
)
async def unload(name: str, body: BodyDep, runtime: RuntimeDep) -> dict:
    parse_body(ModelRequest, body)
    await repository_of(runtime).unload(ready(runtime), name)
    return {}
