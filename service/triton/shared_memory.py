"""Triton's shared-memory extension: regions a client registers, then names in an inference
request instead of sending tensor bytes (inputs read from it, outputs written into it).

A system region is a POSIX shared-memory object (`/dev/shm/<key>`, what
`tritonclient.utils.shared_memory` creates): inputs are read from it and outputs written into it
as bytes, through its file descriptor and against its size as it is at that moment, so a client
that shrinks its object gets a 400, never a server killed by SIGBUS. A CUDA region is a CUDA IPC
handle of the client's device buffer (`tritonclient.utils.cuda_shared_memory`), opened once, at
registration, with cuda-python: a request gets tensors that view the buffer, which the device
pipeline copies device to device (service/engine/pipeline.py), so no tensor byte goes through the
host. Both kinds share one namespace of names. Every offset and size is checked against the region
(a CUDA buffer's real size is asked of the driver), so nothing is read or written outside it; a
region is visible only to the token that registered it, which may hold at most `max_regions` of
them (a system region holds a descriptor of its object, a CUDA region a mapping of the client's
buffer, until it is unregistered, whenever its client left). A CUDA region unregistered while a
request uses it stays open until the last such request is done (its device copies finished); a
system region is read when a request arrives and written when its forward is done, each time
found by name (unregistered meanwhile: that request's output is a 400).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import math
import os
import re
import resource
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import Any

import torch

from .. import off_loop
from ..codecs.kserve import DATATYPE_NAMES, SHM_BYTE_SIZE, SHM_OFFSET, SHM_REGION
from ..codecs.safetensors_wire import tensor_bytes
from ..engine.copy_memory import CopyMemory, Loan
from ..errors import BadInput, Conflict, Forbidden, NotReady, Overloaded, UnknownRegion

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared-memory objects (shm_open)
_KEY = re.compile(r"/*([^/\0]+)")  # shm_open names: leading slashes, then no slash
CUDA_IPC_HANDLE_BYTES = 64
VIEWS_KEPT = 16  # a CUDA region's views kept for the next requests
# A region's name and a key are kept (and listed by status) as long as the region is: Triton's
# are short, and a file name has at most 255 bytes.
MAX_NAME_CHARS = 256
# A system region holds a descriptor of its object. One is refused once fewer than this many
# descriptors of the process's limit (RLIMIT_NOFILE) would be left: connections need them, the
# probes' among them.
DESCRIPTOR_RESERVE = 128


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

    def __init__(self, name: str, byte_size: int, owner: str | None) -> None:
        self.name, self.byte_size, self.owner = name, byte_size, owner

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
    def close(self) -> None: ...

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """The region in the status response's schema."""


def _descriptor_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _short_of_descriptors(key: str) -> NotReady:
    return NotReady(
        f"no file descriptor left for shared-memory object {key!r}: the server keeps "
        f"{DESCRIPTOR_RESERVE} of its limit for connections; unregister regions first"
    )


class SystemRegion(Region):
    kind = "system"

    def __init__(
        self,
        name: str,
        key: str,
        offset: int,
        byte_size: int,
        owner: str | None,
        key_prefix: str = "",
    ):
        super().__init__(name, byte_size, owner)
        if len(key) > MAX_NAME_CHARS:
            raise BadInput(f"key of {len(key)} characters is longer than {MAX_NAME_CHARS}")
        match = _KEY.fullmatch(key)
        if match is None or match[1] in (".", ".."):
            raise BadInput(f"key {key!r} is not a shared-memory object name ('/name')")
        if not match[1].startswith(key_prefix):
            raise Forbidden(
                f"key {key!r} does not start with '/{key_prefix}': this server accepts only "
                "such shared-memory objects (--shared-memory-prefix)"
            )
        self.key, self.offset = key, offset
        path = SHM_DIR / match[1]
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # a symlink could lead anywhere
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                raise _short_of_descriptors(key) from None
            raise BadInput(f"cannot open shared-memory object {key!r}: {err.strerror}") from None
        try:
            # open() returns the lowest free descriptor: every one below it is in use
            if self._fd >= _descriptor_limit() - DESCRIPTOR_RESERVE:
                raise _short_of_descriptors(key)
            stat = os.fstat(self._fd)
            if not S_ISREG(stat.st_mode):
                raise BadInput(f"shared-memory object {key!r} is not a regular object")
            if key_prefix and stat.st_nlink > 1:
                raise Forbidden(
                    f"shared-memory object {key!r} has {stat.st_nlink} links: a hard link could "
                    "name another's object under the prefix (--shared-memory-prefix)"
                )
            self._check_object(f"offset {offset} + byte_size {byte_size} exceed", byte_size)
        except Exception:
            os.close(self._fd)
            raise

    # The object is read and written through a descriptor (pread/pwrite), never mapped: its
    # owner may shrink it at any time, and touching a mapped page past the object's end is a
    # SIGBUS that kills the process. A read past the end is short and a write past it grows
    # the client's object, so a shrink between the size check and the copy harms no one.
    def _check_object(self, what: str, end: int, fd: int | None = None) -> None:
        """Refuse when the object, as it is now, ends before the region's byte `end`."""
        size = os.fstat(self._fd if fd is None else fd).st_size
        if self.offset + end > size:
            raise BadInput(f"{what} shared-memory object {self.key!r}, now of {size} bytes")

    @contextmanager
    def _own_descriptor(self) -> Iterator[int]:
        """A descriptor of the object for one copy on a worker thread: an unregister meanwhile
        closes the region's, not this one."""
        try:
            fd = os.dup(self._fd)
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                raise _short_of_descriptors(self.key) from None
            raise
        try:
            yield fd
        finally:
            os.close(fd)

    async def _copy(
        self,
        copy: Callable[[int, int, memoryview], None],
        offset: int,
        raw: memoryview,
        alone: bool,
    ) -> None:
        """`copy(fd, offset, raw)`: on the event loop where it is small (larger where the
        request is `alone`: off_loop.py), through the region's own descriptor, which nothing
        closes before the copy ends (an unregister runs on the loop too); else on a thread,
        through a descriptor of its own."""
        if off_loop.BINARY.stays(raw.nbytes, alone):
            copy(self._fd, offset, raw)
            return
        with self._own_descriptor() as fd:
            await off_loop.BINARY.off_loop(copy, fd, offset, raw)

    async def read(self, offset: int, into: memoryview, alone: bool = False) -> None:
        """Fill `into` (CPU memory) with as many bytes at `offset`: one copy, straight from the
        object, off the event loop when it is large (larger where the request is `alone`)."""
        await self._copy(self._read, offset, into, alone)

    def _read(self, fd: int, offset: int, into: memoryview) -> None:
        size = into.nbytes
        what = f"region {self.name!r}: {size} bytes at offset {offset} lie past the end of its"
        self._check_object(what, offset + size, fd)
        done = 0
        while done < size:  # a read is short at the object's end, or when a signal cuts it
            got = self._io(os.preadv, fd, into[done:], offset + done)
            if not got:
                raise BadInput(
                    f"shared-memory object {self.key!r} of region {self.name!r} shrank while "
                    f"{size} bytes at region offset {offset} were read"
                )
            done += got

    async def write(
        self, offset: int, data: torch.Tensor | memoryview, alone: bool = False
    ) -> None:
        """Write a CPU tensor's bytes (or bytes) at `offset` (one copy, straight into the
        object, off the event loop when it is large, larger where the request is `alone`);
        visible to the client when this returns."""
        raw = data if isinstance(data, memoryview) else tensor_bytes(data)
        await self._copy(self._write, offset, raw, alone)

    def _write(self, fd: int, offset: int, raw: memoryview) -> None:
        what = (
            f"region {self.name!r}: {raw.nbytes} bytes at offset {offset} lie past the end of its"
        )
        self._check_object(what, offset + raw.nbytes, fd)
        done = 0
        while done < raw.nbytes:
            done += self._io(os.pwritev, fd, raw[done:], offset + done)

    def _io(self, call: Callable[..., int], fd: int, buffer: memoryview, offset: int) -> int:
        try:
            return call(fd, [buffer], self.offset + offset)
        except OSError as err:  # e.g. ENOSPC: /dev/shm is full
            raise BadInput(
                f"shared-memory object {self.key!r} of region {self.name!r}: {err.strerror}"
            ) from None

    def close(self) -> None:
        os.close(self._fd)

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class DeviceRegion(Region):
    """A CUDA region as this process sees it: its bytes as a tensor (`memory`, uint8), which a
    request views without a copy; the forward then copies from and into those views on the
    device. CudaRegion opens one from a client's IPC handle (tests wrap any tensor)."""

    kind = "cuda"

    def __init__(
        self,
        name: str,
        memory: torch.Tensor,
        device_id: int,
        owner: str | None,
        release: Callable[[], None] = lambda: None,
    ):
        super().__init__(name, memory.numel(), owner)
        self.memory: torch.Tensor | None = memory
        self.device_id = device_id
        self.users = 0  # requests whose device work may still read or write the memory
        # views made, by (offset, dtype, shape): a client names the same places request after
        # request, and a view's slicing and reshaping cost more host time than the rest of the
        # request's shared-memory handling (`bench/transport_bench.py`, CUDA shared memory)
        self._views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._closing = False
        self._release = release  # let the memory go (close the IPC handle)

    def acquire(self) -> None:
        """A request will use the memory: it stays open until the request's `release`."""
        self.users += 1

    def release(self) -> None:
        """A request is done with the memory (its device copies have finished)."""
        self.users -= 1
        if self._closing and not self.users:
            self._free()

    def view(
        self,
        tensor: str,
        place: TensorPlace,
        dtype: torch.dtype,
        shape: Sequence[int],
        exact: bool,
    ) -> torch.Tensor:
        """The `dtype` tensor of `shape` at `place`, viewing the region (place checked)."""
        needed = math.prod(shape) * dtype.itemsize
        self.check(tensor, place, needed, exact)
        if place.offset % dtype.itemsize:  # a misaligned view would fault in a kernel
            raise BadInput(
                f"{tensor}: {SHM_OFFSET} {place.offset} in CUDA region {self.name!r} is not a "
                f"multiple of the {DATATYPE_NAMES.get(dtype, dtype)} element size "
                f"({dtype.itemsize} bytes)"
            )
        key = (place.offset, dtype, tuple(shape))
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            view = self.memory[place.offset : place.offset + needed].view(dtype).view(key[2])
            self._views[key] = view
        return view

    def close(self) -> None:
        """Unregistered: the memory goes now, or when the last request using it is done."""
        self._closing = True
        if not self.users:
            self._free()

    def _free(self) -> None:
        # explicitly, not when the last view is collected: a view may outlive its request
        # (found on the H100: views kept alive from C++ after the request had finished)
        self.memory = None
        self._views.clear()
        self._release()

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


class _IpcMapping:
    """An opened CUDA IPC handle as __cuda_array_interface__: torch wraps the pointer without a
    copy and holds this object while any tensor views it. The handle is closed by `close()`
    (the region's release, once no request uses it), or else when the last view is freed."""

    def __init__(self, cudart: Any, pointer: int, size: int, device_id: int, region: str):
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
        }
        self.close = weakref.finalize(self, _close_ipc, cudart, pointer, device_id, region)
        self.close.atexit = False  # at exit the driver unmaps it anyway


def _close_ipc(cudart: Any, pointer: int, device_id: int, region: str) -> None:
    with torch.cuda.device(device_id):
        err = cudart.cudaIpcCloseMemHandle(pointer)[0]
    if err != cudart.cudaError_t.cudaSuccess:
        log.warning("closing the IPC handle of CUDA region %s: %s", region, err.name)
    else:
        log.info("closed the IPC handle of CUDA region %s", region)


class CudaRegion(DeviceRegion):
    def __init__(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str | None
    ):
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
            mapping = _IpcMapping(cudart, int(pointer), byte_size, device_id, name)
            try:
                _check_buffer(driver, int(pointer), device_id, byte_size)
            except BadInput:
                mapping.close()
                raise
            memory = torch.as_tensor(mapping, device=f"cuda:{device_id}")
        super().__init__(name, memory, device_id, owner, release=mapping.close)


def _check_buffer(driver: Any, pointer: int, device_id: int, byte_size: int) -> None:
    """Refuse a buffer smaller than `byte_size` or on another GPU than `device_id` (the driver
    knows both; the client only states them)."""
    address = driver.CUdeviceptr(pointer)
    err, base, allocated = driver.cuMemGetAddressRange(address)
    if err != driver.CUresult.CUDA_SUCCESS or int(base) + int(allocated) < pointer + byte_size:
        raise BadInput(
            f"byte_size {byte_size} exceeds the CUDA buffer behind raw_handle "
            f"({int(allocated) if err == driver.CUresult.CUDA_SUCCESS else '?'} bytes)"
        )
    ordinal = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    err, device = driver.cuPointerGetAttribute(ordinal, address)
    if err == driver.CUresult.CUDA_SUCCESS and int(device) != device_id:
        raise BadInput(
            f"raw_handle is a buffer on GPU {int(device)} of this server, not on "
            f"device_id {device_id}"
        )


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


@dataclass(frozen=True)
class CopyReservation:
    """Bytes a request copied out of system regions, counted until it is done."""

    memory: SharedMemory
    nbytes: int

    def release(self) -> None:
        self.memory.copied_bytes -= self.nbytes


@dataclass
class SharedMemory:
    """The registered regions of both kinds, by name."""

    allowed: bool  # --allow-shared-memory
    key_prefix: str = ""  # --shared-memory-prefix
    max_regions: int = 256  # per owner: MOE_SERVE_MAX_SHARED_MEMORY_REGIONS
    # what requests in flight may hold copied out of system regions:
    # MOE_SERVE_MAX_SHARED_MEMORY_COPY_BYTES
    max_copied_bytes: int = 1 << 30
    regions: dict[str, Region] = field(default_factory=dict)
    copied_bytes: int = 0  # held now by requests in flight
    copy_memory: CopyMemory = field(init=False)

    def __post_init__(self) -> None:
        self.copy_memory = CopyMemory(self.max_copied_bytes)

    def reserve_copies(self, nbytes: int) -> CopyReservation:
        """Room for `nbytes` of inputs copied out of system regions, held until the request
        releases it: a request of a few hundred bytes would otherwise have the server hold up to
        MOE_SERVE_MAX_BODY_BYTES of its memory each. One request alone always gets its room."""
        if self.copied_bytes and self.copied_bytes + nbytes > self.max_copied_bytes:
            raise Overloaded(
                f"requests in flight hold {self.copied_bytes} bytes copied out of system "
                f"shared memory; {nbytes} more would pass the limit of {self.max_copied_bytes} "
                "(MOE_SERVE_MAX_SHARED_MEMORY_COPY_BYTES): retry once they are answered",
                {"Retry-After": "1"},
            )
        self.copied_bytes += nbytes
        return CopyReservation(self, nbytes)

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise Forbidden("shared memory is off: start the server with --allow-shared-memory")

    def register_system(
        self, name: str, key: str, offset: int, byte_size: int, owner: str | None
    ) -> None:
        self._add(
            name, owner, lambda: SystemRegion(name, key, offset, byte_size, owner, self.key_prefix)
        )

    def register_cuda(
        self, name: str, raw_handle: bytes, device_id: int, byte_size: int, owner: str | None
    ) -> None:
        self._add(name, owner, lambda: CudaRegion(name, raw_handle, device_id, byte_size, owner))

    def _add(self, name: str, owner: str | None, open_region: Callable[[], Region]) -> None:
        self._check_allowed()
        if len(name) > MAX_NAME_CHARS:
            raise BadInput(f"region name of {len(name)} characters is longer than {MAX_NAME_CHARS}")
        if not name or "/" in name or name in (".", "..") or not name.isprintable():
            # the HTTP routes name a region in their path (and an empty name means every region)
            raise BadInput(
                f"region name {name!r} cannot be used: a name is printable characters, not "
                "'.' or '..', with no '/'"
            )
        if name in self.regions:
            raise Conflict(f"a shared-memory region named {name!r} is already registered")
        if sum(r.owner == owner for r in self.regions.values()) >= self.max_regions:
            raise Overloaded(
                f"{self.max_regions} shared-memory regions are registered, the limit "
                "(MOE_SERVE_MAX_SHARED_MEMORY_REGIONS); unregister one first"
            )
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
            region.close()

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        self.regions.clear()

    def _region_of(
        self, tensor: str, place: TensorPlace, owner: str | None, kind: str | None = None
    ) -> Region:
        """The region `place` names (of `kind`, or either kind); a 400 naming the tensor if none."""
        self._check_allowed()
        try:
            return self.find(kind, place.region, owner)
        except UnknownRegion as err:
            raise BadInput(f"{tensor}: {err.message}") from None

    def check(
        self, tensor: str, place: TensorPlace, size: int, owner: str | None, exact: bool
    ) -> None:
        """Refuse `place` for `size` bytes now, before a forward whose output would not fit."""
        self._region_of(tensor, place, owner).check(tensor, place, size, exact)

    def view(
        self,
        tensor: str,
        place: TensorPlace,
        dtype: torch.dtype,
        shape: Sequence[int],
        owner: str | None,
        exact: bool,
        held: list[DeviceRegion],
    ) -> torch.Tensor | None:
        """`place` as a `dtype` tensor of `shape` that views a CUDA region (its byte size
        `exact`ly the tensor's, or at least), the region acquired and appended to `held` (the
        caller releases it once the request is done); None when `place` is in a system region,
        which is read and written as bytes instead."""
        region = self._region_of(tensor, place, owner)
        if not isinstance(region, DeviceRegion):
            return None
        view = region.view(tensor, place, dtype, shape, exact)
        region.acquire()
        held.append(region)
        return view

    async def read(
        self,
        tensor: str,
        place: TensorPlace,
        dtype: torch.dtype,
        shape: Sequence[int],
        owner: str | None,
        held: list[Loan],
        pinned: bool,
        alone: bool = False,
    ) -> torch.Tensor:
        """A copy of the `dtype` tensor of `shape` at `place` in a system region, whose byte
        size must be the tensor's: in copy memory (pinned if `pinned`), its loan appended to
        `held` (the caller releases it once the request is done). `alone`: the request is the
        server's only one (off_loop.py)."""
        region = self._region_of(tensor, place, owner, "system")
        region.check(tensor, place, math.prod(shape) * dtype.itemsize, exact=True)
        if not place.byte_size:  # no bytes to read (and none to view as `dtype`)
            return torch.empty(shape, dtype=dtype)
        loan = self.copy_memory.lend(place.byte_size, pinned)
        held.append(loan)
        await region.read(place.offset, loan.raw, alone)
        return loan.view(dtype, shape)

    async def write(
        self,
        tensor: str,
        place: TensorPlace,
        data: memoryview,
        owner: str | None,
        alone: bool = False,
    ) -> None:
        """Write bytes (an output in copy memory: Loan.raw) at `place` in a system region,
        which must hold at least as many; `alone`: the request is the server's only one
        (off_loop.py)."""
        region = self._region_of(tensor, place, owner, "system")
        region.check(tensor, place, data.nbytes, exact=False)
        await region.write(place.offset, data, alone)
