"""Load a layer directory onto a device, validating everything before the service may serve it.

The header is checked with safetensors (names, shapes, dtypes, the file covering every tensor)
before any data is read. The data is then read with plain positioned reads at the header's
offsets, straight into the tensors' device buffers through pinned chunks of `READ_CHUNK_BYTES`:
an 11 GB DeepSeek-V3 layer never exists whole in CPU memory, and with `experts` only those
experts' bytes are read (expert parallelism). A second thread checksums each chunk while the
next one is read; the values are then checked finite on the device (weights.integrity).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from ..kernels.config import MoEConfig
from ..kernels.layer import LayerWeights
from .errors import LayerFileError, describe_validation_error
from .integrity import CHECKSUM, RowDigests, first_nonfinite
from .layout import (
    TensorSpec,
    check_names,
    check_tensor,
    expected_tensors,
    header_sha256,
    tensor_offsets,
)
from .manifest import MANIFEST_FILE, TENSORS_FILE, Manifest

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 << 20  # one pinned staging buffer (two are used in turn)
PROGRESS_MIN_BYTES = 512 << 20  # show a progress bar for loads at least this large


@dataclass
class LoadedLayer:
    name: str
    config: MoEConfig  # num_experts is the global count, also when `experts` selected a subset
    weights: LayerWeights  # expert tensors hold the selected experts, in the order asked
    device: torch.device  # where the weights are: the device that serves the layer
    manifest: Manifest
    path: Path
    load_seconds: float
    nbytes: int


def read_manifest(path: Path) -> Manifest:
    """The validated manifest of layer directory `path`."""
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        raise LayerFileError(file, None, "missing: not a layer directory")
    try:
        return Manifest.model_validate_json(file.read_bytes())
    except ValidationError as err:
        problems = describe_validation_error(err, "manifest")
        raise LayerFileError(file, None, f"invalid manifest: {problems}") from err


def load_layer(
    path: Path, device: torch.device, experts: Sequence[int] | None = None
) -> LoadedLayer:
    """Validate layer directory `path` and load it onto `device`.

    `experts`: the global expert ids to load (default all); expert tensors hold them in order.
    Raises LayerFileError naming the file and tensor on anything that does not check out.
    """
    start = time.perf_counter()
    path, device = Path(path), torch.device(device)
    manifest = inspect_layer(path)
    ids = _expert_ids(experts, manifest.config.num_experts)
    tensors = _read_checked(path, manifest, expected_tensors(manifest), ids, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    weights = LayerWeights.from_tensors(tensors)
    nbytes = weights.nbytes()
    log.info(
        "loaded layer %r (%.2f GB) onto %s in %.2f s: %.2f GB/s",
        manifest.name,
        nbytes / 1e9,
        device,
        seconds,
        nbytes / 1e9 / max(seconds, 1e-9),
    )
    return LoadedLayer(
        manifest.name, manifest.config, weights, device, manifest, path, seconds, nbytes
    )


def weight_bytes(manifest: Manifest) -> int:
    """The bytes the whole layer's weights take on a device, from its manifest alone."""
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in expected_tensors(manifest).values())


def inspect_layer(path: Path) -> Manifest:
    """Check layer directory `path` without reading tensor data: the manifest, the header hash,
    every tensor's name, shape and dtype, and the checksums' names and counts. Returns the
    manifest (a directory whose manifest has no checksums is logged as such)."""
    path = Path(path)
    manifest = read_manifest(path)
    file = path / TENSORS_FILE
    _check_header(file, manifest)
    specs = expected_tensors(manifest)
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            check_names(file, set(specs), set(f.keys()))
            for name, spec in specs.items():
                piece = f.get_slice(name)
                check_tensor(file, name, spec, tuple(piece.get_shape()), piece.get_dtype())
    except SafetensorError as err:
        raise LayerFileError(file, None, f"unreadable safetensors file: {err}") from err
    _check_checksum_list(path / MANIFEST_FILE, manifest, specs)
    return manifest


def verify_layer(path: Path) -> Manifest:
    """`inspect_layer`, then read every byte on the CPU, one expert at a time: checksums as the
    manifest records them, and every value finite. Returns the manifest."""
    manifest = inspect_layer(path)
    specs = expected_tensors(manifest)
    shared = {n: s for n, s in specs.items() if not s.per_expert}
    per_expert = {n: s for n, s in specs.items() if s.per_expert}
    cpu = torch.device("cpu")
    _read_checked(path, manifest, shared, [], cpu)
    for expert in range(manifest.config.num_experts):
        _read_checked(path, manifest, per_expert, [expert], cpu)
    return manifest


def _check_checksum_list(file: Path, manifest: Manifest, specs: dict[str, TensorSpec]) -> None:
    if not manifest.tensors_xxh3:
        log.warning(
            "%s: written before layer directories carried checksums, so its data cannot be "
            "verified; write it again (moe-serve convert or demo-weights) to add them",
            file.parent,
        )
        return
    check_names(file, set(specs), set(manifest.tensors_xxh3))
    for name, spec in specs.items():
        count = spec.shape[0] if spec.per_expert else 1
        if len(manifest.tensors_xxh3[name]) != count:
            raise LayerFileError(
                file,
                name,
                f"tensors_xxh3 lists {len(manifest.tensors_xxh3[name])} checksums, "
                f"expected {count}",
            )


def _expert_ids(experts: Sequence[int] | None, num_experts: int) -> list[int]:
    if experts is None:
        return list(range(num_experts))
    ids = [int(e) for e in experts]
    if not ids or len(set(ids)) != len(ids) or not all(0 <= e < num_experts for e in ids):
        raise ValueError(
            f"experts must be distinct ids in [0, {num_experts}) and not empty, got {ids}"
        )
    return ids


def _check_header(file: Path, manifest: Manifest) -> None:
    if file.exists() and not file.is_file():
        raise LayerFileError(file, None, "is not a regular file (a directory?)")
    if not file.is_file():
        raise LayerFileError(file, None, "missing")
    try:
        digest = header_sha256(file)
    except ValueError as err:
        raise LayerFileError(file, None, f"truncated or not a safetensors file: {err}") from err
    if digest != manifest.tensors_sha256:
        raise LayerFileError(
            file,
            None,
            f"header sha256 {digest[:12]}… does not match the manifest's "
            f"{manifest.tensors_sha256[:12]}…: the file changed after it was written",
        )


def _runs(ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """(position in ids, first id, count) for each run of consecutive ids."""
    pos = 0
    while pos < len(ids):
        count = 1
        while pos + count < len(ids) and ids[pos + count] == ids[pos] + count:
            count += 1
        yield pos, ids[pos], count
        pos += count


class _Reader:
    """Reads byte ranges of an open file into tensors on `device`, checksumming as it goes.

    For CUDA it reads through two pinned buffers in turn, so that reading the next chunk from
    the file overlaps the asynchronous copy of the last one to the GPU and its checksum (on a
    second thread: xxhash releases the GIL); nothing larger than a chunk is ever staged in CPU
    memory. For the CPU it reads straight into the tensor.
    """

    def __init__(self, fd: int, device: torch.device, file: Path) -> None:
        self.fd, self.file, self.turn = fd, file, 0
        self.cuda = device.type == "cuda"
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-checksum")
        self.hashed: list[Future[None]] = []
        self.buffers, self.copied = [], [None, None]
        if self.cuda:
            self.buffers = [
                torch.empty(READ_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]

    def read(self, offset: int, dst: torch.Tensor, tensor: str, digests: RowDigests) -> None:
        """Fill contiguous `dst` with the file's bytes from `offset` on, feeding `digests`."""
        flat = dst.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), READ_CHUNK_BYTES):
            piece = flat[start : start + READ_CHUNK_BYTES]
            if not self.cuda:
                self._pread(offset + start, piece, tensor)
                self.hashed.append(self.hasher.submit(digests.update, piece.numpy()))
                continue
            done = self.copied[self.turn]
            if done is not None:  # the buffer's last copy to the GPU and checksum have finished
                done[0].synchronize()
                done[1].result()
            staged = self.buffers[self.turn][: piece.numel()]
            self._pread(offset + start, staged, tensor)
            piece.copy_(staged, non_blocking=True)
            copy = torch.cuda.Event()
            copy.record()
            self.copied[self.turn] = (copy, self.hasher.submit(digests.update, staged.numpy()))
            self.turn ^= 1

    def close(self) -> None:
        """Block until the last copies out of the staging buffers and every checksum are done."""
        for done in self.copied:
            if done is not None:
                done[0].synchronize()
        self.hasher.shutdown(wait=True)
        for hashed in self.hashed:
            hashed.result()

    def _pread(self, offset: int, into: torch.Tensor, tensor: str) -> None:
        view, got = memoryview(into.numpy()), 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n == 0:
                raise LayerFileError(self.file, tensor, "file ends inside the tensor's data")
            got += n


def _read(
    file: Path, specs: dict[str, TensorSpec], ids: list[int], device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Read every tensor into a fresh buffer on `device`, expert tensors only at `ids`; with the
    checksum of each expert read (of the whole tensor for tensors without an expert axis)."""
    offsets = tensor_offsets(file)
    tensors = {
        n: torch.empty(
            (len(ids), *s.shape[1:]) if s.per_expert else s.shape, dtype=s.dtype, device=device
        )
        for n, s in specs.items()
    }
    digests: dict[str, RowDigests] = {}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    fd = os.open(file, os.O_RDONLY)
    reader = _Reader(fd, device, file)
    try:
        progress = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"loading {file.parent.name}",
            disable=total < PROGRESS_MIN_BYTES,
        )
        with progress:
            for name, spec in specs.items():
                out = tensors[name]
                if not spec.per_expert:
                    digests[name] = RowDigests(out.numel() * out.element_size())
                    reader.read(offsets[name], out, name, digests[name])
                    progress.update(out.numel() * out.element_size())
                    continue
                row_bytes = out[0].numel() * out.element_size()
                digests[name] = RowDigests(row_bytes)
                for pos, first, count in _runs(ids):
                    where = offsets[name] + first * row_bytes
                    reader.read(where, out[pos : pos + count], name, digests[name])
                    progress.update(count * row_bytes)
    finally:
        reader.close()
        os.close(fd)
    return tensors, {name: d.digests for name, d in digests.items()}


def _read_checked(
    path: Path,
    manifest: Manifest,
    specs: dict[str, TensorSpec],
    ids: list[int],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """`_read`, then refuse a checksum that differs from the manifest's or a non-finite value,
    naming the tensor and the expert."""
    file = path / TENSORS_FILE
    tensors, found = _read(file, specs, ids, device)
    for name, spec in specs.items():
        expected = manifest.tensors_xxh3.get(name)
        rows = ids if spec.per_expert else [0]
        for row, got in zip(rows, found[name], strict=True):
            want = None if expected is None else expected[row]
            if want is not None and got != want:
                what = f"expert {row}'s bytes" if spec.per_expert else "its bytes"
                raise LayerFileError(
                    file,
                    name,
                    f"{CHECKSUM} of {what} is {got}, the manifest says {want}: the data "
                    "changed after it was written (disk or copy corruption)",
                )
        bad = first_nonfinite(tensors[name], e8m0=spec.is_scale and spec.dtype == torch.uint8)
        if bad is not None:
            if spec.per_expert:
                bad[0] = ids[bad[0]]  # the global expert id
            raise LayerFileError(file, name, f"holds NaN or Inf (first at index {bad})")
    return tensors
