"""Triton's shared-memory extension over HTTP: /v2/systemsharedmemory/... and
/v2/cudasharedmemory/... register, unregister and list regions (service/triton/shared_memory.py).
Every route answers 403 unless the server runs with --allow-shared-memory."""

from __future__ import annotations

import base64
import binascii

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from ...core.runtime import Runtime
from ...errors import BadInput
from ...triton.shared_memory import owner_of
from ..body import parse_body
from ..deps import BodyDep, RuntimeDep
from ..schemas import ErrorBody

router = APIRouter(prefix="/v2", tags=["kserve-v2 shared memory"])

_ERRORS = {
    status: {"model": ErrorBody, "description": what}
    for status, what in {
        400: "bad key, handle, offset or size; a name or key over 256 characters",
        403: "shared memory is off (--allow-shared-memory); with --shared-memory-prefix, a key "
        "outside it or an object with more than one link",
        404: "no region of that name",
        409: "a region of that name is already registered",
        429: "as many regions as MOE_SERVE_MAX_SHARED_MEMORY_REGIONS are registered",
        503: "no file descriptor to spare for another system region",
    }.items()
}


# Strict: pydantic would read true as 1 and "8" or 8.0 as 8.
class SystemRegister(BaseModel):
    key: str  # the shared-memory object's name, as given to shm_open ("/name")
    offset: int = Field(0, ge=0, strict=True)  # where the region starts in the object
    byte_size: int = Field(ge=0, strict=True)


class RawHandle(BaseModel):
    b64: str


class CudaRegister(BaseModel):
    raw_handle: RawHandle  # the cudaIpcMemHandle_t bytes, base64
    device_id: int = Field(ge=0, strict=True)
    byte_size: int = Field(ge=0, strict=True)


def caller(request: Request, runtime: Runtime) -> str | None:
    """Whose regions this request may use: its bearer token's (auth on), else everyone's."""
    if runtime.settings.api_token is None:
        return None
    return owner_of(request.headers.get("authorization", ""))


def _status_and_unregister(kind: str, prefix: str) -> None:
    """GET {prefix}[/region/{name}]/status and POST {prefix}[/region/{name}]/unregister."""

    async def status_all(request: Request, runtime: RuntimeDep) -> list[dict]:
        return runtime.shared_memory.status(kind, "", caller(request, runtime))

    async def status(name: str, request: Request, runtime: RuntimeDep) -> list[dict]:
        return runtime.shared_memory.status(kind, name, caller(request, runtime))

    async def unregister_all(request: Request, runtime: RuntimeDep) -> dict:
        runtime.shared_memory.unregister(kind, "", caller(request, runtime))
        return {}

    async def unregister(name: str, request: Request, runtime: RuntimeDep) -> dict:
        runtime.shared_memory.unregister(kind, name, caller(request, runtime))
        return {}

    router.get(f"{prefix}/status", summary=f"Every registered {kind} region")(status_all)
    router.get(f"{prefix}/region/{{name}}/status", summary=f"One {kind} region", responses=_ERRORS)(
        status
    )
    router.post(f"{prefix}/unregister", summary=f"Unregister every {kind} region")(unregister_all)
    router.post(
        f"{prefix}/region/{{name}}/unregister",
        summary=f"Unregister one {kind} region",
        responses=_ERRORS,
    )(unregister)


_status_and_unregister("system", "/systemsharedmemory")
_status_and_unregister("cuda", "/cudasharedmemory")


@router.post(
    "/systemsharedmemory/region/{name}/register",
    summary="Register a POSIX shared-memory object (or part of it) as region `name`",
    responses=_ERRORS,
)
async def system_register(name: str, body: BodyDep, request: Request, runtime: RuntimeDep) -> dict:
    register = parse_body(SystemRegister, body)
    owner = caller(request, runtime)
    runtime.shared_memory.register_system(
        name, register.key, register.offset, register.byte_size, owner
    )
    return {}


@router.post(
    "/cudasharedmemory/region/{name}/register",
    summary="Register a client's CUDA buffer (its CUDA IPC handle) as region `name`",
    responses=_ERRORS,
)
async def cuda_register(name: str, body: BodyDep, request: Request, runtime: RuntimeDep) -> dict:
    register = parse_body(CudaRegister, body)
    try:
        raw = base64.b64decode(register.raw_handle.b64, validate=True)
    except binascii.Error:
        raise BadInput("raw_handle.b64 is not base64") from None
    owner = caller(request, runtime)
    runtime.shared_memory.register_cuda(name, raw, register.device_id, register.byte_size, owner)
    return {}
