"""Load a layer directory onto a device, validating everything before the service may serve it.

The header is checked with safetensors (names, shapes, dtypes, the file covering every tensor)
before any data is read. The data is then read with plain positioned reads at the header's
offsets, straight into the tensors' device buffers through pinned chunks of `READ_CHUNK_BYTES`:
an 11 GB DeepSeek-V3 layer never exists whole in CPU memory, and with `experts` only those
experts' bytes are read (expert parallelism).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from kernels.config import MoEConfig
from kernels.layer import LayerWeights
from weights.errors import LayerFileError
from weights.layout import (
    TensorSpec,
    check_names,
    check_tensor,
    expected_tensors,
    header_sha256,
    tensor_offsets,
    unflatten,
)
from weights.manifest import MANIFEST_FILE, TENSORS_FILE, Manifest

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 << 20  # one pinned staging buffer (two are used in turn)
PROGRESS_MIN_BYTES = 512 << 20  # show a progress bar for loads at least this large
_E8M0_NAN = 255


@dataclass
class LoadedLayer:
    name: str
    config: MoEConfig  # num_experts is the global count, also when `experts` selected a subset
    weights: LayerWeights  # expert tensors hold the selected experts, in the order asked
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
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'manifest'}: {e['msg']}" for e in err.errors()
        )
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
    ids = _expert_ids(experts, manifest.num_experts)
    file = path / TENSORS_FILE
    specs = expected_tensors(manifest)
    tensors = _read(file, specs, ids, device)
    for name, t in tensors.items():
        _check_finite(file, name, specs[name], t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    weights = unflatten(tensors)
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
        manifest.name, manifest.to_config(), weights, manifest, path, seconds, nbytes
    )


def inspect_layer(path: Path) -> Manifest:
    """Check layer directory `path` without reading tensor data: the manifest, the header hash,
    and every tensor's name, shape and dtype. Returns the manifest."""
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
    return manifest


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
    """Reads byte ranges of an open file into tensors on `device`.

    For CUDA it reads through two pinned buffers in turn, so that reading the next chunk from
    the file overlaps the asynchronous copy of the last one to the GPU; nothing larger than a
    chunk is ever staged in CPU memory. For the CPU it reads straight into the tensor.
    """

    def __init__(self, fd: int, device: torch.device, file: Path) -> None:
        self.fd, self.file, self.turn = fd, file, 0
        self.cuda = device.type == "cuda"
        self.buffers, self.copied = [], [None, None]
        if self.cuda:
            self.buffers = [
                torch.empty(READ_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]

    def read(self, offset: int, dst: torch.Tensor, tensor: str) -> None:
        """Fill contiguous `dst` with the file's bytes from `offset` on."""
        flat = dst.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), READ_CHUNK_BYTES):
            piece = flat[start : start + READ_CHUNK_BYTES]
            if not self.cuda:
                self._pread(offset + start, piece, tensor)
                continue
            buffer, done = self.buffers[self.turn], self.copied[self.turn]
            if done is not None:
                done.synchronize()  # the buffer's last copy to the GPU has finished
            staged = buffer[: piece.numel()]
            self._pread(offset + start, staged, tensor)
            piece.copy_(staged, non_blocking=True)
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()
            self.turn ^= 1

    def wait(self) -> None:
        """Block until the last copies out of the staging buffers have finished."""
        for done in self.copied:
            if done is not None:
                done.synchronize()

    def _pread(self, offset: int, into: torch.Tensor, tensor: str) -> None:
        view, got = memoryview(into.numpy()), 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n == 0:
                raise LayerFileError(self.file, tensor, "file ends inside the tensor's data")
            got += n


def _read(
    file: Path, specs: dict[str, TensorSpec], ids: list[int], device: torch.device
) -> dict[str, torch.Tensor]:
    """Read every tensor into a fresh buffer on `device`, expert tensors only at `ids`."""
    offsets = tensor_offsets(file)
    tensors = {
        n: torch.empty(
            (len(ids), *s.shape[1:]) if s.per_expert else s.shape, dtype=s.dtype, device=device
        )
        for n, s in specs.items()
    }
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
                    reader.read(offsets[name], out, name)
                    progress.update(out.numel() * out.element_size())
                    continue
                row_bytes = out[0].numel() * out.element_size()
                for pos, first, count in _runs(ids):
                    reader.read(offsets[name] + first * row_bytes, out[pos : pos + count], name)
                    progress.update(count * row_bytes)
    finally:
        reader.wait()
        os.close(fd)
    return tensors


def _check_finite(file: Path, name: str, spec: TensorSpec, t: torch.Tensor) -> None:
    if not spec.is_scale:
        return
    bad = t == _E8M0_NAN if t.dtype == torch.uint8 else ~torch.isfinite(t)
    if bad.any():
        where = [int(i) for i in bad.nonzero()[0]]
        raise LayerFileError(file, name, f"non-finite scale at index {where}")
