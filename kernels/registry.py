"""The one table of backends: every experts and prepare/finalize class, by name.

kernels/selection.py chooses among them, and `/backends` lists them as they are: each backend,
whether it can run here, and if not, why. Every backend module imports without its optional
packages (triton, deep_gemm, triton_kernels) and says what is missing through `environment()`,
so the table always holds every backend. A new backend is a class here (DEVELOPERS.md).
"""

from __future__ import annotations

from typing import TypeVar

from .experts.deep_gemm import DeepGemmBatchedExperts, DeepGemmExperts
from .experts.deep_gemm_fp4 import DeepGemmFp4Experts
from .experts.oai_triton import OaiTritonExperts, UnfusedOaiTritonExperts
from .experts.reference import BatchedReferenceExperts, ReferenceExperts
from .experts.token_switch import TritonOrDeepGemmExperts
from .experts.triton import TritonBatchedExperts, TritonExperts
from .prepare_finalize.batched import Batched
from .prepare_finalize.naive_ep import NaiveEP
from .prepare_finalize.no_ep import NoEP
from .stages import Experts, PrepareFinalize

T = TypeVar("T", type[Experts], type[PrepareFinalize])


def by_name(*classes: T) -> dict[str, T]:
    """{cls.name: cls} in the order given; a name used twice is an error."""
    table: dict[str, T] = {}
    for cls in classes:
        if cls.name in table:
            raise ValueError(
                f"backend {cls.name!r} is registered twice ({table[cls.name]} and {cls})"
            )
        table[cls.name] = cls
    return table


EXPERTS: dict[str, type[Experts]] = by_name(
    ReferenceExperts,
    BatchedReferenceExperts,
    TritonExperts,
    TritonBatchedExperts,
    DeepGemmExperts,
    DeepGemmBatchedExperts,
    DeepGemmFp4Experts,
    TritonOrDeepGemmExperts,
    OaiTritonExperts,
    UnfusedOaiTritonExperts,
)

# the first whose format matches an experts backend's is its stage (naive-ep only when asked for)
PREPARE_FINALIZE: dict[str, type[PrepareFinalize]] = by_name(NoEP, Batched, NaiveEP)


def experts_backends() -> dict[str, type[Experts]]:
    return dict(EXPERTS)


def prepare_finalize_backends() -> dict[str, type[PrepareFinalize]]:
    return dict(PREPARE_FINALIZE)
