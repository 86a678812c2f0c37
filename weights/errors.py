"""The one error every bad layer file or checkpoint raises: which file, which tensor, what."""

from __future__ import annotations

from pathlib import Path


class LayerFileError(ValueError):
    """A layer directory or source checkpoint that cannot be used as is."""

    def __init__(self, path: Path | str, tensor: str | None, message: str) -> None:
        self.path = Path(path)
        self.tensor = tensor
        self.message = message
        where = f"{self.path}" if tensor is None else f"{self.path}: tensor {tensor!r}"
        super().__init__(f"{where}: {message}")
