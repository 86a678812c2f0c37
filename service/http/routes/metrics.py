"""GET /metrics: Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..deps import RuntimeDep

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    summary="Prometheus metrics: requests, latency, batch sizes, queue depth, tokens per expert",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def metrics(runtime: RuntimeDep) -> Response:
    return Response(await runtime.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)
