"""The one error every bad layer file or checkpoint raises (which file, which tensor, what), and
the one way a pydantic error becomes a message (files here, request bodies in the service)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol


class LayerFileError(ValueError):
    """A layer directory or source checkpoint that cannot be used as is."""

    def __init__(self, path: Path | str, tensor: str | None, message: str) -> None:
        self.path = Path(path)
        self.tensor = tensor
        self.message = message
        where = f"{self.path}" if tensor is None else f"{self.path}: tensor {tensor!r}"
        super().__init__(f"{where}: {message}")


class ValidationErrors(Protocol):
    """pydantic's ValidationError, or FastAPI's RequestValidationError."""

    def errors(self) -> Sequence[Mapping[str, Any]]: ...


def describe_validation_error(err: ValidationErrors, document: str) -> str:
    """Pydantic's errors as one line naming each field: 'hidden_states.0.1: Input should be...'.

    `document` names what an error without a field is about (invalid JSON, say); FastAPI's
    leading `body` is left out of field paths.
    """
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"] if p != "body") or document
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)
