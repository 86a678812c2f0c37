"""/backends (what can run here, and what runs each layer, and why) and /v1/layers."""

from __future__ import annotations

import platform

import torch
from fastapi import APIRouter

from ....kernels.registry import experts_backends, prepare_finalize_backends
from ...engine.interface import ServedLayer
from ..deps import EngineDep
from ..schemas import (
    BackendInfo,
    BackendsResponse,
    DeviceInfo,
    ErrorBody,
    LayerBackend,
    LayerInfo,
    LayersResponse,
    TokenRange,
)

router = APIRouter(tags=["introspection"])


def device_info(device: torch.device) -> DeviceInfo:
    if device.type != "cuda":
        return DeviceInfo(type=device.type, name=platform.processor() or platform.machine())
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo(
        type="cuda",
        name=props.name,
        compute_capability=f"{props.major}.{props.minor}",
        memory_bytes=props.total_memory,
    )


def by_tokens(served: ServedLayer) -> list[TokenRange]:
    return [TokenRange(from_tokens=m, backend=name) for m, name in served.by_tokens]


def layer_info(served: ServedLayer) -> LayerInfo:
    cfg = served.config
    return LayerInfo(
        name=served.name,
        top_k=cfg.top_k,
        **cfg.as_json(),
        device=str(served.device),
        device_bytes=served.device_bytes,
        shared_experts=served.layer.shared is not None,
        backend=served.backend,
        by_tokens=by_tokens(served),
        batch_invariant=served.layer.batch_invariant,
    )


@router.get("/backends", summary="Registered backends, whether they run here, and each layer's")
async def backends(engine: EngineDep) -> BackendsResponse:
    device = engine.devices[0]
    experts = []
    for name, cls in experts_backends().items():
        support = cls.supports(None, device)
        experts.append(
            BackendInfo(
                name=name,
                available=support.ok,
                reason=support.reason,
                format=cls.format,
                schemes=sorted(cls.schemes),
                activations=sorted(cls.activations),
                batch_invariant=cls.batch_invariance(None).ok,
            )
        )
    stages = []
    for name, cls in prepare_finalize_backends().items():
        support = cls.supports(device)
        stages.append(
            BackendInfo(name=name, available=support.ok, reason=support.reason, format=cls.format)
        )
    layers = [
        LayerBackend(
            layer=served.name,
            device=str(served.device),
            experts=served.selection.experts.name,
            prepare_finalize=served.selection.prepare_finalize.name,
            reason=served.selection.reason,
            rejected=served.selection.rejected,
            by_tokens=by_tokens(served),
            workspace_bytes=served.layer.kernel.workspace.nbytes,
            batch_invariant=served.layer.batch_invariant,
            graph_buckets=served.graphs.captured_buckets() if served.graphs is not None else [],
        )
        for served in engine.layers.values()
    ]
    return BackendsResponse(
        device=device_info(device), experts=experts, prepare_finalize=stages, layers=layers
    )


@router.get("/v1/layers", summary="Every served layer's shape, numerics and backend")
async def list_layers(engine: EngineDep) -> LayersResponse:
    return LayersResponse(layers=[layer_info(s) for s in engine.layers.values()])


@router.get(
    "/v1/layers/{name}",
    summary="One served layer",
    responses={404: {"model": ErrorBody, "description": "no layer of that name"}},
)
async def get_layer(name: str, engine: EngineDep) -> LayerInfo:
    return layer_info(engine.get(name))
