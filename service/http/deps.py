"""What FastAPI's routes need, as typed dependencies: the runtime, the engine, the body.

Dependencies are `async def` although they never wait: FastAPI runs a plain `def` one on a
worker thread, a thread hop per dependency per request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ..core.runtime import Runtime, ready
from ..engine.interface import ServingEngine
from .body import read_body


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


async def get_engine(runtime: RuntimeDep) -> ServingEngine:
    return ready(runtime).engine


async def get_body(request: Request, runtime: RuntimeDep) -> bytes:
    return await read_body(request, runtime)


EngineDep = Annotated[ServingEngine, Depends(get_engine)]
BodyDep = Annotated[bytes, Depends(get_body)]
