"""Write a layer directory atomically: into a temp dir beside it, fsync, rename.

A reader sees the old directory or the new one, never half of either; on any error nothing is
left behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from kernels.layer import LayerWeights
from weights.errors import LayerFileError
from weights.layout import check_names, check_tensor, expected_tensors, flatten, header_sha256
from weights.manifest import MANIFEST_FILE, TENSORS_FILE, Manifest

log = logging.getLogger(__name__)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_layer(out_dir: Path, weights: LayerWeights, manifest: Manifest) -> Manifest:
    """Write `weights` and `manifest` (hash filled in) as the layer directory `out_dir`.

    An existing layer directory there is replaced; any other non-empty directory is refused.
    Returns the manifest as written.
    """
    out_dir = Path(out_dir)
    tensors = {n: t.detach().cpu() for n, t in flatten(weights).items()}
    specs = expected_tensors(manifest)
    check_names(out_dir / TENSORS_FILE, set(specs), set(tensors))
    for name, t in tensors.items():
        check_tensor(out_dir / TENSORS_FILE, name, specs[name], tuple(t.shape), t.dtype)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_FILE).exists():
        raise LayerFileError(out_dir, None, "exists and is not a layer directory; not replacing")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
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
    log.info("wrote layer %r to %s", manifest.name, out_dir)
    return manifest


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing `target` is moved aside first, then deleted."""
    if not target.exists():
        new.rename(target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    target.rename(old / target.name)
    try:
        new.rename(target)
    except BaseException:
        (old / target.name).rename(target)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
