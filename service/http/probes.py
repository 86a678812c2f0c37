"""The probes' HTTP answers from a ProbeState (service/core/probes.py): the engine process's routes
(service/http/routes/health.py, kserve.py) and the front ends (service/frontends/front_end.py)
answer with these, so both answer alike, byte for byte. No torch: the front ends import it."""

from __future__ import annotations

import re

from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response

from ..core.probes import ProbeState
from ..errors import ServiceError, error_response

# The probes' paths, which are their route templates too
HEALTH, READY, LIVE_V2, READY_V2 = "/health", "/ready", "/v2/health/live", "/v2/health/ready"
# KServe's model ready, of any version or of one; the route templates
MODEL_READY = "/v2/models/{name}/ready"
VERSION_READY = "/v2/models/{name}/versions/{version}/ready"
_MODEL_READY = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/ready")


# Their bodies, here rather than in schemas.py, whose examples are the demo layer's (torch)
class HealthResponse(BaseModel):
    status: str = "alive"


class ReadyResponse(BaseModel):
    ready: bool
    reason: str = Field("", description="what is missing when not ready; why when degraded")
    degraded: bool | None = Field(
        None, description="true: ready, but on fewer expert-parallel ranks than started"
    )


def health(state: ProbeState) -> Response:
    if state.not_live is not None:
        return error_response(503, f"not live: {state.not_live}")
    return JSONResponse(HealthResponse().model_dump())


def ready(state: ProbeState) -> Response:
    reason = state.ready_reason
    if reason is not None:
        body = ReadyResponse(ready=False, reason=reason)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=503)
    if state.degraded is None:
        return JSONResponse(ReadyResponse(ready=True).model_dump(exclude_none=True))
    body = ReadyResponse(ready=True, degraded=True, reason=state.degraded)
    return JSONResponse(body.model_dump())


def live_v2(state: ProbeState) -> Response:
    if state.not_live is not None:
        return error_response(503, f"not live: {state.not_live}")
    return JSONResponse({"live": True})


def ready_v2(state: ProbeState) -> Response:
    reason = state.ready_reason
    if reason is not None:
        return error_response(503, f"not ready: {reason}")
    return JSONResponse({"ready": True})


def model_ready(state: ProbeState, name: str, version: str = "") -> Response:
    """200 when model `name` (of `version`, or any) can serve, else the error a request to it
    would get."""
    try:
        state.check_model(name, version)
    except ServiceError as err:
        return error_response(err.status, err.message, err.headers)
    return JSONResponse({"ready": True})


def probe(method: str, path: str) -> tuple[str, str, str] | None:
    """The probe a request is, as (route template, model name, version), or None: not a probe
    (nor one of a method the probe does not take)."""
    if path in (HEALTH, READY) and method in ("GET", "HEAD"):
        return path, "", ""
    if path in (LIVE_V2, READY_V2) and method == "GET":
        return path, "", ""
    if method == "GET" and (match := _MODEL_READY.fullmatch(path)):
        name, version = match.groups()
        return (MODEL_READY if version is None else VERSION_READY), name, version or ""
    return None


def answer(state: ProbeState, route: str, name: str, version: str) -> Response:
    """The answer to the probe `route` (as `probe` names it)."""
    if route in (MODEL_READY, VERSION_READY):
        return model_ready(state, name, version)
    return {HEALTH: health, READY: ready, LIVE_V2: live_v2, READY_V2: ready_v2}[route](state)
