"""Every backend registers here by name; `select` picks one for a layer and says why.

`/backends` shows `describe()` as is: each backend, whether it can run here, and if not, why.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from kernels.config import MoEConfig
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

# `auto` follows the measured rule table of kernels/selection.py where this GPU and layer have
# one; otherwise it tries these in order and the first that supports the layer wins. Fast GPU
# paths first, the exact torch reference last (it runs everywhere).
AUTO_ORDER: tuple[str, ...] = (
    "deep-gemm",
    "oai-triton",
    "triton-or-deep-gemm",
    "triton",
    "oai-triton-unfused",
    "reference",
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


@dataclass(frozen=True)
class Selection:
    experts: type[Experts]
    prepare_finalize: type[PrepareFinalize]
    reason: str  # why this pair
    rejected: dict[str, str] = field(default_factory=dict)  # backend name -> why not


def _prepare_finalize_for(
    experts: type[Experts], device: torch.device, expert_parallel: bool = False
) -> type[PrepareFinalize]:
    if expert_parallel:
        return prepare_finalize_backends()["naive-ep"]
    for pf in prepare_finalize_backends().values():
        if pf.format == experts.format and pf.supports(device) and pf.name != "naive-ep":
            return pf
    raise LookupError(f"no prepare/finalize stage for the {experts.format} format")


def _expert_parallel_problem(experts: type[Experts]) -> str:
    """Why `experts` cannot hold one rank's slice of a layer under naive-ep; "" if it can."""
    from kernels.tensors import Format

    if experts.format != Format.STANDARD:
        return "expert parallelism (naive-ep) dispatches in the standard format"
    if not experts.supports_expert_map:
        return "takes no expert_map, so it cannot hold a slice of the experts"
    return ""


def select(
    cfg: MoEConfig, device: torch.device, requested: str = "auto", expert_parallel: bool = False
) -> Selection:
    """Choose the experts backend for one layer on `device`.

    `requested` is a backend name (forced: an error if it cannot run the layer) or "auto".
    `expert_parallel`: this rank holds a slice of the experts; the backend pairs with naive-ep.
    """
    backends = experts_backends()
    rejected = {}
    for name, cls in backends.items():
        support = cls.supports(cfg, device)
        if not support:
            rejected[name] = support.reason
        elif expert_parallel and _expert_parallel_problem(cls):
            rejected[name] = _expert_parallel_problem(cls)
    if requested != "auto":
        if requested not in backends:
            raise ValueError(f"unknown backend {requested!r}; registered: {', '.join(backends)}")
        if requested in rejected:
            raise ValueError(f"backend {requested!r} cannot run this layer: {rejected[requested]}")
        cls = backends[requested]
        pf = _prepare_finalize_for(cls, device, expert_parallel)
        return Selection(cls, pf, "forced by --backend", rejected)
    from kernels.selection import auto_choice  # selection reads this module's AUTO_ORDER

    available = [name for name in backends if name not in rejected]
    choice = auto_choice(cfg, device, available, AUTO_ORDER)
    if choice is not None:
        cls = backends[choice.name]
        pf = _prepare_finalize_for(cls, device, expert_parallel)
        return Selection(cls, pf, choice.reason, rejected)
    details = "; ".join(f"{n}: {r}" for n, r in rejected.items())
    raise ValueError(f"no backend can run this layer on {device}: {details}")
