"""Every backend registers here by name (kernels/selection.py chooses among them).

`/backends` lists them as they are: each backend, whether it can run here, and if not, why.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from kernels.stages import Experts, PrepareFinalize

_EXPERTS: dict[str, type[Experts]] = {}
_PREPARE_FINALIZE: dict[str, type[PrepareFinalize]] = {}

# Modules whose import registers backends. Each imports without its optional packages and
# reports what is missing through `environment()`.
_BACKEND_MODULES = (
    "kernels.prepare_finalize.no_ep",
    "kernels.prepare_finalize.batched",
    "kernels.prepare_finalize.naive_ep",
    "kernels.experts.reference",
    "kernels.experts.triton",
    "kernels.experts.deep_gemm",
    "kernels.experts.deep_gemm_fp4",
    "kernels.experts.triton_or_deep_gemm",
    "kernels.experts.oai_triton",
)

T = TypeVar("T")


def _register(table: dict[str, T], cls: T) -> T:
    name = cls.name  # type: ignore[attr-defined]
    if name in table:
        raise ValueError(f"backend {name!r} is registered twice ({table[name]} and {cls})")
    table[name] = cls
    return cls


def register_experts(cls: type[Experts]) -> type[Experts]:
    return _register(_EXPERTS, cls)


def register_prepare_finalize(cls: type[PrepareFinalize]) -> type[PrepareFinalize]:
    return _register(_PREPARE_FINALIZE, cls)


def _load_backends() -> None:
    for module in _BACKEND_MODULES:
        importlib.import_module(module)


def experts_backends() -> dict[str, type[Experts]]:
    _load_backends()
    return dict(_EXPERTS)


def prepare_finalize_backends() -> dict[str, type[PrepareFinalize]]:
    _load_backends()
    return dict(_PREPARE_FINALIZE)
