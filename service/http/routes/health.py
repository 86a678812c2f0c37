"""Probes: /health (the process answers) and /ready (layers loaded and warmed up), answered
from the runtime's probe state as a front end answers them (service/http/probes.py)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from .. import probes
from ..deps import RuntimeDep

router = APIRouter(tags=["health"])


# HEAD too: some load balancers and uptime checkers probe with it. A route of its own, left out of
# the API description: one route of two methods gives both operations one operationId there.
@router.head(probes.HEALTH, include_in_schema=False)
@router.get(
    probes.HEALTH,
    summary="Liveness: 200 while the process serves",
    response_model=probes.HealthResponse,
)
async def health(runtime: RuntimeDep) -> Response:
    return probes.health(runtime.probe_state())


@router.head(probes.READY, include_in_schema=False)
@router.get(
    probes.READY,
    summary="Readiness: 200 once every layer is loaded and warmed up, else 503 with the reason",
    response_model=probes.ReadyResponse,
    responses={503: {"model": probes.ReadyResponse}},
)
async def ready(runtime: RuntimeDep) -> Response:
    return probes.ready(runtime.probe_state())
