"""Triton's trace and log settings over HTTP: read and changed while the server runs
(service/tracing.py's TraceSettings, service/logs.py's log settings)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import RootModel

from ... import logs, tracing
from ...core import inference
from ..body import parse_body
from ..deps import BodyDep, EngineDep
from ..schemas import ErrorBody

router = APIRouter(prefix="/v2", tags=["kserve-v2 trace and log settings"])
_ERRORS = {400: {"model": ErrorBody, "description": "an unknown setting or value"}}


class SettingChanges(RootModel[dict[str, Any]]):
    """Setting name -> value; for a model, null clears its own (the global one applies)."""


@router.get("/trace/setting", summary="The global trace settings")
async def trace_settings() -> dict[str, Any]:
    return tracing.SETTINGS.get()


@router.post("/trace/setting", summary="Change the global trace settings", responses=_ERRORS)
async def update_trace_settings(body: BodyDep) -> dict[str, Any]:
    return tracing.SETTINGS.update(parse_body(SettingChanges, body).root)


@router.get(
    "/models/{name}/trace/setting",
    summary="A model's trace settings",
    responses={404: {"model": ErrorBody}},
)
async def model_trace_settings(name: str, engine: EngineDep) -> dict[str, Any]:
    return tracing.SETTINGS.get(inference.get_model(engine, name).name)


@router.post(
    "/models/{name}/trace/setting",
    summary="Change a model's trace settings",
    responses={**_ERRORS, 404: {"model": ErrorBody}},
)
async def update_model_trace_settings(name: str, body: BodyDep, engine: EngineDep) -> dict:
    changes = parse_body(SettingChanges, body).root
    return tracing.SETTINGS.update(changes, inference.get_model(engine, name).name)


@router.get("/logging", summary="The log settings")
async def log_settings() -> dict[str, Any]:
    return logs.log_settings()


@router.post("/logging", summary="Change the log level or format", responses=_ERRORS)
async def update_log_settings(body: BodyDep) -> dict[str, Any]:
    return logs.update_log_settings(parse_body(SettingChanges, body).root)
