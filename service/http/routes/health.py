"""Probes: /health (the process answers) and /ready (layers loaded and warmed up)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ..deps import RuntimeDep
from ..schemas import HealthResponse, ReadyResponse

router = APIRouter(tags=["health"])


# HEAD too: some load balancers and uptime checkers probe with it
@router.api_route(
    "/health", methods=["GET", "HEAD"], summary="Liveness: 200 while the process serves"
)
async def health() -> HealthResponse:
    return HealthResponse()


@router.api_route(
    "/ready",
    methods=["GET", "HEAD"],
    summary="Readiness: 200 once every layer is loaded and warmed up, else 503 with the reason",
    responses={503: {"model": ReadyResponse}},
)
async def ready(runtime: RuntimeDep) -> JSONResponse:
    if runtime.not_ready is None:
        if runtime.degraded is None:
            return JSONResponse(ReadyResponse(ready=True).model_dump(exclude_none=True))
        body = ReadyResponse(ready=True, degraded=True, reason=runtime.degraded)
        return JSONResponse(body.model_dump())
    body = ReadyResponse(ready=False, reason=runtime.not_ready)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=503)
