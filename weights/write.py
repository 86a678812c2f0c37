"""Write a layer directory atomically: into a temp dir beside it, fsync, rename.

A reader sees the old directory or the new one, never half of either; on any error (SIGINT, and
SIGTERM under `moe-serve convert`) nothing is left behind. Writers of one parent directory take
turns (an flock on it), so temp dirs of the target found meanwhile were left by a process that
died (SIGKILL, power loss) and are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..kernels.layer import LayerWeights
from .errors import LayerFileError
from .integrity import checksums
from .layout import check_names, check_tensor, expected_tensors, header_sha256
from .manifest import MANIFEST_FILE, TENSORS_FILE, Manifest

log = logging.getLogger(__name__)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_layer(out_dir: Path, weights: LayerWeights, manifest: Manifest) -> Manifest:
    """Write `weights` and `manifest` (hashes filled in) as the layer directory `out_dir`.

    An existing layer directory there is replaced; any other non-empty directory is refused.
    Returns the manifest as written.
    """
    out_dir = Path(out_dir)
    tensors = {n: t.detach().cpu().contiguous() for n, t in weights.tensors().items()}
    specs = expected_tensors(manifest)
    check_names(out_dir / TENSORS_FILE, set(specs), set(tensors))
    for name, t in tensors.items():
        check_tensor(out_dir / TENSORS_FILE, name, specs[name], tuple(t.shape), t.dtype)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).exists():
        raise LayerFileError(out_dir, None, "exists and is not a layer directory; not replacing")
    sums = {name: checksums(t, specs[name].per_expert) for name, t in tensors.items()}
    manifest = manifest.model_copy(update={"tensors_xxh3": sums})

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _writing_beside(out_dir):
        manifest = _write_new(out_dir, tensors, manifest)
    log.info("wrote layer %r to %s", manifest.name, out_dir)
    return manifest


def _temp_prefixes(target: Path) -> tuple[str, str]:
    """The names of the temp dirs made beside `target`: the new copy, the old one moved aside."""
    return f".{target.name}.tmp-", f".{target.name}.old-"


@contextlib.contextmanager
def _writing_beside(target: Path) -> Iterator[None]:
    """Hold the parent directory's lock; remove the temp dirs of `target` that dead writers left
    (restoring the old layer first if one died between moving it aside and renaming the new)."""
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        stale = sorted(
            p for p in target.parent.iterdir() if p.name.startswith(_temp_prefixes(target))
        )
        for path in stale:
            moved_aside = path / target.name
            if moved_aside.is_dir() and not target.exists():
                log.warning("restoring %s from %s, left by an interrupted write", target, path)
                moved_aside.rename(target)
            log.warning("removing %s, left by an interrupted write", path)
            shutil.rmtree(path, ignore_errors=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_new(out_dir: Path, tensors: dict[str, torch.Tensor], manifest: Manifest) -> Manifest:
    new_prefix, _ = _temp_prefixes(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=new_prefix, dir=out_dir.parent))
    try:
        save_file(tensors, tmp / TENSORS_FILE)
        manifest = manifest.model_copy(update={"tensors_sha256": header_sha256(tmp / TENSORS_FILE)})
        (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2) + "\n")
        # mkdtemp makes a private dir; a layer dir is for every user of the machine to read
        for path, mode in ((tmp / TENSORS_FILE, 0o644), (tmp / MANIFEST_FILE, 0o644), (tmp, 0o755)):
            path.chmod(mode)
            _fsync(path)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(out_dir.parent)
    return manifest


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing `target` is moved aside first, then deleted."""
    if not target.exists():
        new.rename(target)
        return
    _, old_prefix = _temp_prefixes(target)
    old = Path(tempfile.mkdtemp(prefix=old_prefix, dir=target.parent))
    target.rename(old / target.name)
    try:
        new.rename(target)
    except BaseException:
        (old / target.name).rename(target)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
