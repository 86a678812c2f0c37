"""Triton's shared-memory extension: regions a client registers, then names in an inference
request instead of sending tensor bytes (inputs read from it, outputs written into it).

A system region is a POSIX shared-memory object (`/dev/shm/<key>`, what
`tritonclient.utils.shared_memory` creates); a CUDA region is a CUDA IPC handle of the
client's device buffer (`tritonclient.utils.cuda_shared_memory`), opened here with cuda-python.
Both kinds share one namespace of names. Every offset and size is checked against the region
(a CUDA buffer's real size is asked of the driver), so nothing is read or written outside it;
a region is visible only to the token that registered it; a region unregistered while a request
uses it closes when that request is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import mmap
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import Any

import torch

from service.errors import BadInput, Conflict, Forbidden, UnknownRegion
from service.kserve_codec import SHM_BYTE_SIZE, SHM_OFFSET, SHM_REGION

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared-memory objects (shm_open)
_KEY = re.compile(r"/*([^/\0]+)")  # shm_open names: leading slashes, then no slash
CUDA_IPC_HANDLE_BYTES = 64


def owner_of(authorization: str) -> str:
    """Who registers and may use a region: a digest of the bearer token ("Bearer <token>")."""
    return hashlib.sha256(authorization.partition(" ")[2].encode()).hexdigest()


@dataclass(frozen=True)
class TensorPlace:
    """Where a request's tensor lives: a region, an offset in it and a size, all checked."""

    region: str
    offset: int
    byte_size: int

    @classmethod
    def of(cls, tensor: str, parameters: dict[str, Any]) -> TensorPlace | None:
        """The place named by a tensor's parameters, or None when they name no region."""
        region = parameters.get(SHM_REGION)
        if region is None:
            return None
        size, offset = parameters.get(SHM_BYTE_SIZE), parameters.get(SHM_OFFSET, 0)
        if not isinstance(region, str):
            raise BadInput(f"{tensor}: {SHM_REGION} must be a string")
        for key, value in ((SHM_BYTE_SIZE, size), (SHM_OFFSET, offset)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadInput(f"{tensor}: {key} must be an integer >= 0, got {value!r}")
        return cls(region, offset, size)


class Region(ABC):
    """A registered region: `byte_size` bytes the server may read and write."""

    kind: str  # "system" or "cuda"
    on_device = False  # copies in and out wait for the GPU: run them off the event loop

    def __init__(self, name: str, byte_size: int, owner: str | None) -> None:
        self.name, self.byte_size, self.owner = name, byte_size, owner
        self.users = 0  # requests using it now
        self.unregistered = False  # close once the last user is done

    def check(self, tensor: str, place: TensorPlace, needed: int, exact: bool) -> None:
        """Refuse a place outside the region, or of the wrong size for `needed` bytes."""
        if place.offset + place.byte_size > self.byte_size:
            raise BadInput(
                f"{tensor}: {SHM_OFFSET} {place.offset} + {SHM_BYTE_SIZE} {place.byte_size} "
                f"exceed region {self.name!r} of {self.byte_size} bytes"
            )
        if place.byte_size != needed if exact else place.byte_size < needed:
            wanted = "" if exact else "at least "
            raise BadInput(
                f"{tensor}: {SHM_BYTE_SIZE} is {place.byte_size} but the tensor takes "
                f"{wanted}{needed} bytes"
            )

    @abstractmethod
    def read(self, offset: int, size: int) -> bytes:
        """The `size` bytes at `offset`."""

    @abstractmethod
    def write(self, offset: int, data: bytes) -> None:
        """Write `data` at `offset`; visible to the client when this returns."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """The region in the status response's schema."""


class SystemRegion(Region):
    kind = "system"

    def __init__(self, name: str, key: str, offset: int, byte_size: int, owner: str | None):
        super().__init__(name, byte_size, owner)
        match = _KEY.fullmatch(key)
        if match is None or match[1] in (".", ".."):
            raise BadInput(f"key {key!r} is not a shared-memory object name ('/name')")
        self.key, self.offset = key, offset
        path = SHM_DIR / match[1]
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # a symlink could lead anywhere
        except OSError as err:
            raise BadInput(f"cannot open shared-memory object {key!r}: {err.strerror}") from None
        try:
            stat = os.fstat(fd)
            if not S_ISREG(stat.st_mode):
                raise BadInput(f"shared-memory object {key!r} is not a regular object")
            object_size = stat.st_size
            if offset + byte_size > object_size:
                raise BadInput(
                    f"offset {offset} + byte_size {byte_size} exceed shared-memory object "
                    f"{key!r} of {object_size} bytes"
                )
            # mmap offsets must be page-aligned: map from 0 and add `offset` on each access
            self._map = mmap.mmap(fd, offset + byte_size) if offset + byte_size else None
        finally:
            os.close(fd)

    def read(self, offset: int, size: int) -> bytes:
        start = self.offset + offset
        return self._map[start : start + size] if size else b""

    def write(self, offset: int, data: bytes) -> None:
        start = self.offset + offset
        if data:
            self._map[start : start + len(data)] = data

    def close(self) -> None:
        if self._map is not None:
            self._map.close()

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class _CudaArray:
    """A device pointer as __cuda_array_interface__, so torch can wrap it without a copy."""

    def __init__(self, pointer: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }


class CudaRegion(Region):
    kind = "cuda"
    on_device = True

    def __init__(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str | None
    ):
        super().__init__(name, byte_size, owner)
        self.device_id = device_id
        cudart, driver = _cuda_bindings()
        if not 0 <= device_id < torch.cuda.device_count():
            raise BadInput(
                f"device_id {device_id} is not a GPU of this server "
                f"({torch.cuda.device_count()} visible)"
            )
        if len(raw_handle) != CUDA_IPC_HANDLE_BYTES:
            raise BadInput(
                f"raw_handle has {len(raw_handle)} bytes; a CUDA IPC handle has "
                f"{CUDA_IPC_HANDLE_BYTES}"
            )
        handle = cudart.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw_handle, CUDA_IPC_HANDLE_BYTES)
        with torch.cuda.device(device_id):
            err, pointer = cudart.cudaIpcOpenMemHandle(
                handle, cudart.cudaIpcMemLazyEnablePeerAccess
            )
            if err != cudart.cudaError_t.cudaSuccess:
                raise BadInput(
                    f"raw_handle is not a CUDA IPC handle of a live buffer on device "
                    f"{device_id} that this server can open ({err.name})"
                )
            self._pointer, self._cudart = pointer, cudart
            # the client states byte_size; the driver knows the allocation's real size
            err, base, allocated = driver.cuMemGetAddressRange(driver.CUdeviceptr(int(pointer)))
            if (
                err != driver.CUresult.CUDA_SUCCESS
                or int(base) + int(allocated) < int(pointer) + byte_size
            ):
                self.close()
                raise BadInput(
                    f"byte_size {byte_size} exceeds the CUDA buffer behind raw_handle "
                    f"({int(allocated) if err == driver.CUresult.CUDA_SUCCESS else '?'} bytes)"
                )
        self.memory = torch.as_tensor(
            _CudaArray(int(pointer), byte_size), device=f"cuda:{device_id}"
        )

    def read(self, offset: int, size: int) -> bytes:
        return self.memory[offset : offset + size].cpu().numpy().tobytes()  # waits for the copy

    def write(self, offset: int, data: bytes) -> None:
        if data:
            source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.memory[offset : offset + len(data)].copy_(source)
        # the client reads the buffer from its own process: the bytes must be there now
        torch.cuda.current_stream(self.memory.device).synchronize()

    def close(self) -> None:
        self.memory = None
        err = self._cudart.cudaIpcCloseMemHandle(self._pointer)[0]
        if err != self._cudart.cudaError_t.cudaSuccess:
            log.warning("closing CUDA region %s: %s", self.name, err.name)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


def _cuda_bindings() -> tuple[Any, Any]:
    """cuda-python's runtime and driver modules, or a 400 saying what this server lacks."""
    if not torch.cuda.is_available():
        raise BadInput("CUDA shared memory needs a CUDA GPU; this server has none")
    try:
        from cuda.bindings import driver
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise BadInput(
            "CUDA shared memory needs the cuda-python package on the server "
            "(pip install 'moe-serve[cuda]')"
        ) from None
    return cudart, driver


@dataclass
class SharedMemory:
    """The registered regions of both kinds, by name."""

    allowed: bool  # --allow-shared-memory
    regions: dict[str, Region] = field(default_factory=dict)

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise Forbidden("shared memory is off: start the server with --allow-shared-memory")

    def register_system(
        self, name: str, key: str, offset: int, byte_size: int, owner: str | None
    ) -> None:
        self._add(name, lambda: SystemRegion(name, key, offset, byte_size, owner))

    def register_cuda(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str | None
    ) -> None:
        self._add(name, lambda: CudaRegion(name, raw_handle, device_id, byte_size, owner))

    def _add(self, name: str, open_region: Callable[[], Region]) -> None:
        self._check_allowed()
        if name in self.regions:
            raise Conflict(f"a shared-memory region named {name!r} is already registered")
        region = open_region()  # checks the key or handle, offset and size
        self.regions[name] = region
        log.info(
            "registered %s shared-memory region %s (%d B)", region.kind, name, region.byte_size
        )

    def _visible(self, kind: str, owner: str | None) -> list[Region]:
        return [r for r in self.regions.values() if r.kind == kind and r.owner == owner]

    def find(self, kind: str | None, name: str, owner: str | None) -> Region:
        region = self.regions.get(name)
        if region is None or region.owner != owner or kind not in (None, region.kind):
            what = "" if kind is None else f"{kind} "
            raise UnknownRegion(f"no {what}shared-memory region named {name!r} is registered")
        return region

    def status(self, kind: str, name: str, owner: str | None) -> list[dict[str, Any]]:
        self._check_allowed()
        regions = [self.find(kind, name, owner)] if name else self._visible(kind, owner)
        return [r.status() for r in regions]

    def unregister(self, kind: str, name: str, owner: str | None) -> None:
        """Unregister region `name`, or every region of `kind` the owner sees when empty."""
        self._check_allowed()
        for region in [self.find(kind, name, owner)] if name else self._visible(kind, owner):
            del self.regions[region.name]
            region.unregistered = True
            if not region.users:
                region.close()

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        self.regions.clear()

    @contextmanager
    def using(self, tensor: str, place: TensorPlace, owner: str | None) -> Iterator[Region]:
        """The region of `place`, held open for the block even if it is unregistered meanwhile."""
        self._check_allowed()
        try:
            region = self.find(None, place.region, owner)
        except UnknownRegion as err:
            raise BadInput(f"{tensor}: {err.message}") from None
        region.users += 1
        try:
            yield region
        finally:
            region.users -= 1
            if region.unregistered and not region.users:
                region.close()

    def check(
        self, tensor: str, place: TensorPlace, size: int, owner: str | None, exact: bool
    ) -> None:
        """Refuse `place` for `size` bytes now, before a forward whose output would not fit."""
        with self.using(tensor, place, owner) as region:
            region.check(tensor, place, size, exact)

    async def read(self, tensor: str, place: TensorPlace, size: int, owner: str | None) -> bytes:
        """The `size` bytes at `place`; `size` must be the place's byte size."""
        with self.using(tensor, place, owner) as region:
            region.check(tensor, place, size, exact=True)
            if region.on_device:
                return await asyncio.to_thread(region.read, place.offset, size)
            return region.read(place.offset, size)

    async def write(self, tensor: str, place: TensorPlace, data: bytes, owner: str | None) -> None:
        """Write `data` at `place`, which must hold at least len(data) bytes."""
        with self.using(tensor, place, owner) as region:
            region.check(tensor, place, len(data), exact=False)
            if region.on_device:
                await asyncio.to_thread(region.write, place.offset, data)
            else:
                region.write(place.offset, data)
